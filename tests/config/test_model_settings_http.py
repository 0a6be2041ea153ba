"""`[model."<pattern>"]` through a real server and the real SDKs: the config's sampling,
max_tokens and template kwargs fill what a request leaves out, and the request's win.

demo-hybrid speaks Qwen3.6's format (its generation prompt opens `<think>`, and
`enable_thinking = false` closes an empty one); the forced-output hook makes it write
"Hello there.", so where that text lands (reasoning or answer) shows which kwargs rendered.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import anthropic
import httpx
import openai
import pytest

from tests.conftest import REPO, fresh_cache_dir, start_server

CONFIG = """
[model."demo-*"]
temperature = 0.0
top_p = 0.5

[model."demo-llama"]
top_p = 0.9
max_tokens = 5

[model."demo-hybrid"]
chat_template_kwargs = { enable_thinking = false, preserve_thinking = false }
restore_reasoning = false

[model."demo-swa"]
max_tokens = 100000000
"""
HELLO = [{"role": "user", "content": "[case=hello] hi"}]
TOOL = {
    "type": "function",
    "function": {
        "name": "look",
        "parameters": {"type": "object", "properties": {"at": {"type": "string"}}},
    },
}
STORY = [{"role": "user", "content": "Tell me a long story about a cat and a boat."}]


@pytest.fixture(scope="module")
def configured(demo_root, tmp_path_factory):
    root = tmp_path_factory.mktemp("model-settings")
    config = root / "config.toml"
    config.write_text(CONFIG)
    forced = root / "forced.json"
    outputs = [{"match": "[case=hello]", "text": "Hello there."}]
    call = "<tool_call>\n<function=look>\n<parameter=at>\nsky\n</parameter>\n</function>\n</tool_call>"
    outputs.append({"match": "[case=call]", "text": f"I look.\n</think>\n\n{call}"})
    forced.write_text(json.dumps({"outputs": outputs}))
    server = start_server(
        fresh_cache_dir(demo_root, root / "cache"),
        "--config",
        str(config),
        "--upstream",
        "http://127.0.0.1:9",
        env={"MLX_PROMPT_CACHE_FORCE_OUTPUT": str(forced)},
    )
    yield server
    server.stop()


@pytest.fixture
def oai(configured):
    return openai.OpenAI(base_url=configured.url + "/v1", api_key="t", max_retries=0, timeout=120)


@pytest.fixture
def ant(configured):
    return anthropic.Anthropic(base_url=configured.url, api_key="t", max_retries=0, timeout=120)


EXPECTED = {
    "demo-llama": {"temperature": 0.0, "top_p": 0.9, "max_tokens": 5},
    "demo-hybrid": {
        "temperature": 0.0,
        "top_p": 0.5,
        "restore_reasoning": False,
        # The config's kwargs over the engine's template defaults, whatever those are.
        "chat_template_kwargs": {"enable_thinking": False, "preserve_thinking": False},
    },
    "demo-swa": {"temperature": 0.0, "top_p": 0.5, "max_tokens": 100000000},
}


def test_models_list_shows_each_local_models_effective_settings(configured):
    data = httpx.get(configured.url + "/v1/models", timeout=30).json()["data"]
    assert {m["id"]: m["settings"] for m in data} == EXPECTED
    # LM Studio's own list shape shows them too.
    data = httpx.get(configured.url + "/api/v0/models", timeout=30).json()["data"]
    assert {m["id"]: m["settings"] for m in data} == EXPECTED


def test_restore_reasoning_false_leaves_reasoning_a_client_dropped_out_of_the_prompt(
    configured, oai
):
    """Off for demo-hybrid: the memo still keeps what the model wrote, and puts none back.
    Its template shows reasoning on turns after the last question, as in a tool loop."""

    def memo() -> dict:
        stats = httpx.get(configured.url + "/v1/cache/stats", timeout=30).json()
        return stats["reasoning_memo"]

    thinking = {"extra_body": {"chat_template_kwargs": {"enable_thinking": True}}}
    ask = [{"role": "user", "content": "[case=call] hi"}]
    before = memo()
    r = oai.chat.completions.create(
        model="demo-hybrid", messages=ask, tools=[TOOL], max_tokens=60, **thinking
    )
    m = r.choices[0].message
    assert (m.reasoning_content.strip(), m.tool_calls[0].function.name) == ("I look.", "look")
    deadline = time.monotonic() + 30
    while memo()["remembered"] == before["remembered"]:  # kept on a pool after the answer
        assert time.monotonic() < deadline, "the reasoning memo never kept the turn"
        time.sleep(0.05)

    def prompt_tokens(**reasoning) -> int:
        turn = {"role": "assistant", "content": m.content or "", **reasoning}
        turn["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        result = {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "dark"}
        return oai.chat.completions.create(
            model="demo-hybrid", messages=[*ask, turn, result], tools=[TOOL], max_tokens=4,
            **thinking,
        ).usage.prompt_tokens  # fmt: skip

    assert prompt_tokens() < prompt_tokens(reasoning_content=m.reasoning_content)
    assert memo()["restored"] == before["restored"]


def test_without_temperature_the_configs_greedy_sampling_runs_and_an_explicit_one_wins(oai):
    def text(**kw) -> str:
        r = oai.chat.completions.create(model="demo-llama", messages=STORY, max_tokens=12, **kw)
        return r.choices[0].message.content

    greedy = text(temperature=0)
    assert text(seed=1) == greedy  # the config's temperature 0: no seed changes a greedy run
    assert text(seed=1, temperature=1.0, top_p=1.0) != greedy  # the request's own wins


def test_without_max_tokens_the_configs_limit_applies_and_the_requests_wins(oai):
    r = oai.chat.completions.create(model="demo-llama", messages=STORY)
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (5, "length")
    r = oai.completions.create(model="demo-llama", prompt="Once upon a time")
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (5, "length")
    r = oai.chat.completions.create(model="demo-llama", messages=STORY, max_tokens=2)
    assert r.usage.completion_tokens == 2


def test_a_configured_limit_past_the_context_means_up_to_the_context(oai):
    r = oai.chat.completions.create(model="demo-swa", messages=HELLO)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("Hello there.", "stop")
    with pytest.raises(openai.BadRequestError) as err:  # a client's own limit is checked
        oai.chat.completions.create(model="demo-swa", messages=HELLO, max_tokens=100000000)
    assert "max_tokens 100000000 exceeds the model's context" in str(err.value)


def test_responses_echo_the_sampling_the_request_ran_with(oai):
    r = oai.responses.create(model="demo-llama", input="Tell me a story.")
    assert (r.temperature, r.top_p, r.usage.output_tokens) == (0.0, 0.9, 5)
    r = oai.responses.create(
        model="demo-llama", input="Tell me a story.", temperature=0.7, top_p=0.3,
        max_output_tokens=3,
    )  # fmt: skip
    assert (r.temperature, r.top_p, r.usage.output_tokens) == (0.7, 0.3, 3)


@pytest.mark.parametrize(
    "extra,thinks",
    [
        ({}, False),  # the config's enable_thinking = false
        ({"extra_body": {"chat_template_kwargs": {"enable_thinking": True}}}, True),
        ({"reasoning_effort": "high"}, True),
    ],
    ids=["config", "chat_template_kwargs", "reasoning_effort"],
)
def test_config_template_kwargs_reach_the_template_under_the_requests_own(oai, extra, thinks):
    r = oai.chat.completions.create(model="demo-hybrid", max_tokens=50, messages=HELLO, **extra)
    m = r.choices[0].message
    got = (m.content, getattr(m, "reasoning_content", None))
    assert got == (("", "Hello there.") if thinks else ("Hello there.", None))


def test_anthropic_thinking_wins_over_the_config_and_count_tokens_renders_the_same(ant):
    msg = ant.messages.create(model="demo-hybrid", max_tokens=50, messages=HELLO)
    assert [(b.type, getattr(b, "text", None)) for b in msg.content] == [("text", "Hello there.")]
    on = {"type": "enabled", "budget_tokens": 1024}
    msg = ant.messages.create(model="demo-hybrid", max_tokens=50, messages=HELLO, thinking=on)
    assert [b.type for b in msg.content] == ["thinking"]

    def count(**kw) -> int:
        return ant.messages.count_tokens(model="demo-hybrid", messages=HELLO, **kw).input_tokens

    # The config's kwargs and an explicit "disabled" render alike; "enabled" renders less
    # (an open <think>, not the closed empty block).
    assert count() == count(thinking={"type": "disabled"}) > count(thinking=on)


def test_probe_renders_with_the_config_kwargs_as_the_request_does(configured, oai):
    body = {"model": "demo-hybrid", "messages": HELLO, "max_tokens": 4}
    ran = oai.chat.completions.create(**body)
    probe = httpx.post(configured.url + "/v1/cache/probe", json=body, timeout=60).json()
    assert probe["prompt_tokens"] == ran.usage.prompt_tokens
    body["chat_template_kwargs"] = {"enable_thinking": True}
    other = httpx.post(configured.url + "/v1/cache/probe", json=body, timeout=60).json()
    assert other["prompt_tokens"] < probe["prompt_tokens"]


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "proxy.cli", *args]
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=120)


def test_print_config_and_doctor_show_the_effective_settings(configured):
    printed = _cli(
        "serve", "--config", str(configured.cache_dir.parent / "config.toml"), "--print-config"
    )
    assert printed.returncode == 0, printed.stderr
    assert '\n# "demo-llama" = { temperature = 0.0, top_p = 0.9, max_tokens = 5 }\n' in (
        printed.stdout
    )
    env = {
        "MLX_PROMPT_CACHE_SERVER_PORT": str(configured.port),
        "MLX_PROMPT_CACHE_UPSTREAM_URL": "http://127.0.0.1:9",
        "MLX_PROMPT_CACHE_CACHE_SSD_DIR": str(configured.cache_dir),
    }
    doctor = _cli(
        "doctor", "--config", str(configured.cache_dir.parent / "config.toml"), "--json", env=env
    )
    assert doctor.returncode == 0, doctor.stderr
    report = json.loads(doctor.stdout)
    assert report["server"]["running"] is True
    assert {r["id"]: r["settings"] for r in report["models"]} == EXPECTED


@pytest.mark.parametrize(
    "line,message",
    [
        ("top_k = 20\ntemprature = 0.6", 'model."demo-*".temprature: unknown key'),
        ("top_k = 20\ntop_p = 1.5", 'model."demo-*".top_p: must be more than 0 and at most 1'),
        ("top_k = 20\nrestore_reasoning = 1", 'model."demo-*".restore_reasoning: expected'),
    ],
)
def test_serve_stops_on_a_bad_key_or_value_naming_it_and_its_line(tmp_path, line, message):
    config = tmp_path / "bad.toml"
    config.write_text(textwrap.dedent(f'[model."demo-*"]\n{line}\n'))
    done = _cli("serve", "--config", str(config), "--port", "1")
    assert done.returncode == 2
    assert done.stderr.startswith(f"mlx-prompt-cache: config error: config key {message}")
    assert done.stderr.endswith(f" (at {config} line 3)\n")
