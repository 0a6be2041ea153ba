"""Our user's exact prompt path: demo-qwen36's weights and real vocabulary under Qwen3.6's
real chat template (`../shared/templates/qwen3_6.jinja`), through the server.

The folder is demo-qwen36's, its template swapped for the real one, as a user's LM Studio
download ships it. An agent session (bench/agent_session.py: three questions of two tool
steps, forced real markup) runs through the official OpenAI SDK with the reasoning dropped;
preserve_thinking is on by default, so every tool step reuses all the server saw
and every new question misses only its own tokens, as on the family models of
test_agent_templates.py, which have the real template over a small vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from bench import agent_session
from engine_bridge.models.demo import real_templates
from tests.conftest import QWEN36, fresh_cache_dir, start_server
from tests.prompting.test_agent_templates import SIZES, assert_served, describe

TEMPLATE = "qwen3_6.jinja"
REAL = real_templates.templates_dir() / TEMPLATE
pytestmark = pytest.mark.skipif(
    not REAL.is_file(), reason=f"the real chat templates are not here: {REAL.resolve()}"
)


def real_template_copy(demo_root: Path, out: Path) -> Path:
    """demo-qwen36's folder with the real template: its files linked, its config rewritten."""
    built = demo_root / "models" / QWEN36
    out.mkdir(parents=True)
    for f in built.iterdir():
        if f.name not in ("tokenizer_config.json", "demo_build.json"):
            (out / f.name).symlink_to(f)
    config = json.loads((built / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = REAL.read_text(encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return out


@pytest.fixture(scope="module")
def served(demo_root, tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen36-real")
    path = real_template_copy(demo_root, root / "models" / "Qwen3.6-35B-A3B-real-template")
    plan = agent_session.script(TEMPLATE, **SIZES)
    forced = root / "forced.json"
    forced.write_text(json.dumps({"outputs": plan.forced()}))
    cache_dir = fresh_cache_dir(demo_root, root / "cache")
    server = start_server(
        cache_dir,
        "--upstream",
        "http://127.0.0.1:9",
        "--model",
        str(path),
        env={"MLX_PROMPT_CACHE_FORCE_OUTPUT": str(forced)},
    )
    model = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]
    yield server, model, plan, path
    server.stop()


def test_the_real_template_keeps_earlier_reasoning_by_default(served):
    _, model, _, _ = served
    assert model["settings"]["chat_template_kwargs"]["preserve_thinking"] is True


def test_an_agent_session_on_qwen36_and_its_real_template_is_served_from_the_cache(served):
    """OpenAI's chat API with the reasoning dropped, the harder case: the reasoning memo and
    preserve_thinking together (both dialects run on the family model's real template)."""
    server, model, plan, path = served
    dialect, sent_back = "openai", False
    records = agent_session.run_session(
        server.url, model["id"], dialect, plan, send_back_reasoning=sent_back,
        session=f"qwen36 real {dialect} {sent_back}",
    )  # fmt: skip
    summary = f"{TEMPLATE} on {QWEN36} {dialect} sent_back={sent_back}: {describe(records)}"
    print(summary)
    assert_served(records, plan, path, TEMPLATE, summary)
