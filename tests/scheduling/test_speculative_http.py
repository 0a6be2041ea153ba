"""Speculative decoding through the server, with the official SDKs: the model is forced
(through its logits) to write back a span of its prompt, as an edit does; prompt lookup
drafts it, sampled or greedy, in both dialects; `x-speculative: off` turns it off for one
request; the counters reach /v1/cache/stats and /metrics."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from tests.conftest import fresh_cache_dir, start_server

FILE = "".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(8))
COPIED = FILE[: len(FILE) // 2]
PROMPT = [{"role": "user", "content": f"Here is a file:\n{FILE}\nWrite its first half back."}]


@pytest.fixture(scope="module")
def server(demo_root, tmp_path_factory):
    root = tmp_path_factory.mktemp("spec-http")
    forced = root / "forced.json"
    forced.write_text(json.dumps({"outputs": [{"match": "Here is a file", "text": COPIED}]}))
    s = start_server(
        fresh_cache_dir(demo_root, root / "cache"),
        "--upstream",
        "http://127.0.0.1:9",
        # "auto" drafts only on a GPU: on this CPU prompt lookup is asked for by name.
        env={
            "MLX_PROMPT_CACHE_FORCE_OUTPUT": str(forced),
            "MLX_PROMPT_CACHE_ENGINE_SPECULATIVE": "prompt-lookup",
        },
    )
    yield s
    s.stop()


def _spec(server) -> dict:
    return httpx.get(server.url + "/v1/cache/stats", timeout=30).json()["scheduler"]


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0},
        {
            "temperature": 0.8,
            "top_p": 0.9,
            "extra_body": {"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1},
        },
    ],  # noqa: E501
    ids=["greedy", "sampled"],
)
def test_openai_copies_are_drafted_and_kept(server, sampling):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="t", max_retries=0)
    before = _spec(server)
    r = client.chat.completions.create(model="demo-llama", messages=PROMPT, max_tokens=400,
                                       **sampling)  # fmt: skip
    after = _spec(server)
    assert r.choices[0].message.content == COPIED
    tokens = r.usage.completion_tokens
    kept = after["spec_accepted"] - before["spec_accepted"]
    steps = after["decode_steps"] - before["decode_steps"]
    assert kept > tokens / 2, (kept, tokens)
    assert steps < tokens / 2, (steps, tokens)


def test_anthropic_stream_is_the_same_text_with_fewer_steps(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="t", max_retries=0)
    before = _spec(server)
    # Anthropic samples at temperature 1 by default: the sampled acceptance rule.
    with client.messages.stream(model="demo-swa", messages=PROMPT, max_tokens=400) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    after = _spec(server)
    assert text == COPIED
    assert after["spec_accepted"] - before["spec_accepted"] > final.usage.output_tokens / 2


def test_the_header_turns_speculation_off_for_one_request(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="t", max_retries=0)
    before = _spec(server)
    r = client.chat.completions.create(
        model="demo-llama", messages=PROMPT, max_tokens=400, temperature=0,
        extra_headers={"x-speculative": "off"},
    )  # fmt: skip
    after = _spec(server)
    assert r.choices[0].message.content == COPIED
    assert after["spec_drafted"] == before["spec_drafted"]
    assert after["decode_steps"] - before["decode_steps"] >= r.usage.completion_tokens - 1
    bad = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": "demo-llama", "messages": PROMPT, "max_tokens": 4},
        headers={"x-speculative": "sometimes"},
        timeout=30,
    )
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "x-speculative"


def test_metrics_show_drafts_acceptance_and_tokens_per_step(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="t", max_retries=0)
    client.chat.completions.create(model="demo-llama", messages=PROMPT, max_tokens=400,
                                   temperature=0)  # fmt: skip
    s = _spec(server)
    text = httpx.get(server.url + "/metrics", timeout=30).text
    values = {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    prefix = "mlx_prompt_cache_"
    assert values[prefix + "speculative_accepted_tokens_total"] == s["spec_accepted"] > 0
    assert values[prefix + "speculative_drafted_tokens_total"] == s["spec_drafted"]
    assert values[prefix + "speculative_acceptance_ratio"] == s["spec_acceptance"]
    assert values[prefix + "decode_tokens_per_step"] == s["tokens_per_step"] > 1


@pytest.mark.parametrize("limit", [{"stop": ["x * 2"]}, {"max_tokens": 37}], ids=["stop", "max"])
def test_a_stop_inside_a_verified_run_ends_where_plain_decode_ends(server, limit):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="t", max_retries=0)
    body = {"model": "demo-llama", "messages": PROMPT, "temperature": 0, "max_tokens": 400}
    body |= limit
    plain = client.chat.completions.create(**body, extra_headers={"x-speculative": "off"})
    before = _spec(server)
    spec = client.chat.completions.create(**body)
    assert _spec(server)["spec_accepted"] > before["spec_accepted"]
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert spec.choices[0].finish_reason == plain.choices[0].finish_reason
    assert spec.usage.completion_tokens == plain.usage.completion_tokens
    if "stop" in limit:
        assert spec.choices[0].message.content == COPIED[: COPIED.index("x * 2")]
    else:
        assert spec.usage.completion_tokens == 37
