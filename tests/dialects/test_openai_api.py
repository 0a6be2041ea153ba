"""The official openai SDK drives the real server; its parsers must accept every response."""

from __future__ import annotations

import pytest

from tests.conftest import DEMO_IDS

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.mark.parametrize("model", DEMO_IDS)
def test_every_demo_model_generates(openai_client, model):
    r = openai_client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say something about caches."}],
        max_tokens=16,
        temperature=0,
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens >= 1
    assert r.usage.prompt_tokens > 5
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_non_stream_with_tools_and_tool_history(openai_client):
    r = openai_client.chat.completions.create(
        model="demo-llama",
        messages=[
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
        ],
        tools=TOOLS,
        max_tokens=12,
        temperature=0,
    )
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_matches_non_stream_and_reports_usage(openai_client):
    kwargs = dict(
        model="demo-llama",
        messages=[{"role": "user", "content": "Count to five."}],
        max_tokens=16,
        temperature=0,
    )
    full = openai_client.chat.completions.create(**kwargs)
    chunks = list(
        openai_client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    content = "".join(d.content or "" for d in deltas)
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    message = full.choices[0].message
    assert content == (message.content or "")
    assert reasoning == (getattr(message, "reasoning_content", None) or "")
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == [full.choices[0].finish_reason]


def test_max_completion_tokens_limits_output(openai_client):
    r = openai_client.chat.completions.create(
        model="demo-hybrid",
        messages=[{"role": "user", "content": "Write a long story."}],
        max_completion_tokens=3,
        temperature=0,
    )
    assert r.usage.completion_tokens <= 3


def test_stop_string_ends_generation_before_it(openai_client):
    base = openai_client.chat.completions.create(
        model="demo-llama",
        messages=[{"role": "user", "content": "Tell me about SSDs."}],
        max_tokens=24,
        temperature=0,
    )
    text = base.choices[0].message.content or ""
    # Pick a stop string from the middle of the greedy output; the same request with it
    # must end right before it.
    if len(text) < 6:
        pytest.skip("greedy output too short to pick a stop string")
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    r = openai_client.chat.completions.create(
        model="demo-llama",
        messages=[{"role": "user", "content": "Tell me about SSDs."}],
        max_tokens=24,
        temperature=0,
        stop=[stop],
    )
    assert r.choices[0].message.content == text[: text.find(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(openai_client):
    kwargs = dict(
        model="demo-swa",
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=12,
        temperature=0.9,
        top_p=0.95,
        seed=1234,
        extra_body={"top_k": 40, "min_p": 0.01, "repetition_penalty": 1.1},
    )
    a = openai_client.chat.completions.create(**kwargs)
    b = openai_client.chat.completions.create(**kwargs)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_legacy_completions_stream_and_not(openai_client):
    r = openai_client.completions.create(
        model="demo-llama", prompt="The cache", max_tokens=8, temperature=0
    )
    assert r.choices[0].text is not None
    chunks = list(
        openai_client.completions.create(
            model="demo-llama", prompt="The cache", max_tokens=8, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


def test_models_lists_the_demo_models(openai_client):
    ids = {m.id for m in openai_client.models.list().data}
    assert set(DEMO_IDS) <= ids


def test_cache_headers_on_every_generation(server):
    import httpx

    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={
            "model": "demo-llama",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
        },
        timeout=60,
    )
    assert r.status_code == 200
    assert r.headers["x-prompt-cache-source"] in ("ram", "ssd", "none")
    assert int(r.headers["x-prompt-cache-hit-tokens"]) >= 0
    assert r.headers["x-request-id"]


def test_concurrent_requests_to_all_models_match_sequential_answers(openai_client):
    """One MLX thread serves every model: concurrent requests queue and answer as alone."""
    from concurrent.futures import ThreadPoolExecutor

    def ask(model: str) -> str:
        r = openai_client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Concurrency check for {model}."}],
            max_tokens=12,
            temperature=0,
            extra_headers={"x-prompt-cache": "bypass"},
        )
        return r.choices[0].message.content

    alone = {m: ask(m) for m in DEMO_IDS}
    with ThreadPoolExecutor(6) as pool:
        together = list(pool.map(ask, DEMO_IDS * 2))
    assert together == [alone[m] for m in DEMO_IDS * 2]
