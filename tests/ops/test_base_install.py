"""The base install serves: with the optional extras' packages made unimportable, the
engine and the CLI import, the real server answers both dialects, and a setting whose
extra is missing stops the start with the pip line. (`.ci/run` also serves from a venv
that has only the base install: scripts/check-base-install.)"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import anthropic
import openai
import pytest

from tests.conftest import REPO, fresh_cache_dir, start_server

# What the extras bring (test, bench, shared, vision); the base install has none of them.
EXTRAS = ("redis", "mlx_vlm", "matplotlib", "playwright", "schemathesis", "hypothesis")

# Run first in every interpreter that has this folder on PYTHONPATH: a `None` in
# sys.modules makes `import name` fail and importlib.util.find_spec(name) say None,
# as on an install without the package.
SITECUSTOMIZE = textwrap.dedent(
    f"""
    import sys
    for name in {EXTRAS!r}:
        sys.modules[name] = None
    """
)


@pytest.fixture(scope="module")
def blocked_env(tmp_path_factory):
    folder = tmp_path_factory.mktemp("no-extras")
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return {"PYTHONPATH": f"{folder}:{REPO}"}


def test_engine_and_cli_import_without_the_extras(blocked_env):
    code = textwrap.dedent(
        """
        import sys
        import engine_bridge.engine, engine_bridge.models.loading, engine_bridge.vision.model
        import proxy.app, proxy.cli, proxy.wiring
        from proxy.cli import build_parser
        build_parser().parse_args(["serve"])
        leaked = [m for m in sys.modules if m.split(".")[0] in BLOCKED and sys.modules[m]]
        assert not leaked, leaked
        print("imported")
        import redis
        """
    ).replace("BLOCKED", repr(EXTRAS))
    r = subprocess.run(
        [sys.executable, "-c", code],
        env={**_env(), **blocked_env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    # Everything imported; only the last line, `import redis`, failed: the block held.
    assert r.returncode == 1 and r.stdout == "imported\n", r.stderr
    assert "import of redis halted" in r.stderr.strip().splitlines()[-1], r.stderr


def test_the_server_answers_both_dialects_without_the_extras(demo_root, tmp_path, blocked_env):
    server = start_server(
        fresh_cache_dir(demo_root, tmp_path / "cache"),
        "--upstream",
        "http://127.0.0.1:9",
        env=blocked_env,
    )
    try:
        oa = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
        chat = oa.chat.completions.create(
            model="demo-llama", max_tokens=8, messages=[{"role": "user", "content": "Hello"}]
        )
        assert chat.usage.completion_tokens == 8
        an = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=120)
        msg = an.messages.create(
            model="demo-llama", max_tokens=8, messages=[{"role": "user", "content": "Hello"}]
        )
        assert msg.usage.output_tokens == 8 and msg.usage.cache_read_input_tokens > 0
    finally:
        server.stop()
    assert "Traceback" not in server.log()


def test_a_setting_whose_extra_is_missing_stops_the_start_with_the_pip_line(tmp_path, blocked_env):
    config = tmp_path / "shared.toml"
    config.write_text('[cache.shared]\nurl = "redis://127.0.0.1:6379/0"\n')
    r = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "serve", "--config", str(config), "--port", "9"],
        env={**_env(), **blocked_env},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "cache.shared.url" in r.stderr
    assert "pip install 'mlx-prompt-cache[shared]'" in r.stderr
    assert "Traceback" not in r.stderr


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
