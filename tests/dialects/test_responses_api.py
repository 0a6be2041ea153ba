"""POST /v1/responses through the official openai SDK: the response object, its event
stream, the cache across turns, previous_response_id, errors and the upstream passthrough."""

from __future__ import annotations

import uuid

import httpx
import openai
import orjson
import pytest
from aiohttp import web

from engine_bridge.engine import Engine, EngineSettings
from proxy.app import create_app
from proxy.config.model import UpstreamConfig
from proxy.state import ProxySettings
from tests.conftest import DEMO_IDS, fresh_cache_dir

LLAMA = "demo-llama"
HIT = "x-prompt-cache-hit-tokens"
BYPASS = {"x-prompt-cache": "bypass"}
TOOLS = [
    {
        "type": "function",
        "name": "exec_command",
        "description": "Run a shell command",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
        "strict": False,
    }
]


def conversation(tag: str) -> list[dict]:
    """Two developer messages, a user turn, and a call with its output (Codex's shape)."""
    return [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": f"You are Codex {tag}."}]},
        {"type": "message", "role": "developer", "content": "Sandbox: none."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files."}]},
        {"type": "function_call", "call_id": "call_a", "name": "exec_command", "arguments": '{"cmd": "ls"}'},
        {"type": "function_call_output", "call_id": "call_a", "output": "a.txt b.txt"},
    ]  # fmt: skip


def as_chat(tag: str) -> list[dict]:
    """The same conversation as /v1/chat/completions messages."""
    call = {"id": "call_a", "type": "function", "function": {"name": "exec_command", "arguments": '{"cmd": "ls"}'}}  # fmt: skip
    return [
        {"role": "system", "content": f"You are Codex {tag}.\n\nSandbox: none."},
        {"role": "user", "content": "List the files."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_a", "content": "a.txt b.txt"},
    ]


def tag() -> str:
    return uuid.uuid4().hex[:8]


def text_of(response) -> str:
    return "".join(
        c.text for item in response.output if item.type == "message" for c in item.content
    )


def expected_events(events: list) -> list[str]:
    """The event types the final output implies, with as many deltas as each item got."""
    deltas: dict[str, int] = {}
    for e in events:
        if e.type.endswith(".delta"):
            deltas[e.item_id] = deltas.get(e.item_id, 0) + 1
    want = ["response.created", "response.in_progress"]
    for item in events[-1].response.output:
        n = deltas.get(item.id, 0)
        want.append("response.output_item.added")
        if item.type == "message":
            want += ["response.content_part.added", *["response.output_text.delta"] * n]
            want += ["response.output_text.done", "response.content_part.done"]
        elif item.type == "reasoning":
            want += ["response.reasoning_summary_part.added"]
            want += ["response.reasoning_summary_text.delta"] * n
            want += ["response.reasoning_summary_text.done", "response.reasoning_summary_part.done"]
        else:
            want += ["response.function_call_arguments.delta"] * n
            want += ["response.function_call_arguments.done"]
        want.append("response.output_item.done")
    return [*want, "response.completed"]


def test_a_response_object_the_sdk_parses_with_usage_and_cache_headers(openai_client):
    raw = openai_client.responses.with_raw_response.create(
        model=LLAMA, input=f"Say hi {tag()}", max_output_tokens=8, temperature=0
    )
    r = raw.parse()
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [i.type for i in r.output] == ["message"] and text_of(r)
    assert r.usage.output_tokens == 8
    assert r.usage.total_tokens == r.usage.input_tokens + 8
    assert r.usage.input_tokens_details.cached_tokens == int(raw.headers[HIT])
    assert raw.headers["x-prompt-cache-source"] in ("ram", "ssd", "shared", "none")


@pytest.mark.parametrize("model", [LLAMA, "demo-hybrid"])
def test_stream_events_come_in_order_and_add_up_to_the_whole_answer(openai_client, model):
    kwargs = dict(model=model, input=conversation(tag()), tools=TOOLS, max_output_tokens=8)
    events = list(openai_client.responses.create(**kwargs, temperature=0, stream=True))
    assert [e.type for e in events] == expected_events(events)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress"
    final = events[-1].response
    assert final.usage.output_tokens == 8
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == text_of(final)
    whole = openai_client.responses.create(**kwargs, temperature=0)
    assert [i.type for i in whole.output] == [i.type for i in final.output]
    assert text_of(whole) == text_of(final)


def test_greedy_output_equals_chat_completions_and_a_bypassed_request(openai_client):
    t = tag()
    kwargs = dict(model=LLAMA, tools=TOOLS, max_output_tokens=8, temperature=0)
    cached = openai_client.responses.create(input=conversation(t), **kwargs)
    bypass = openai_client.responses.create(input=conversation(t), **kwargs, extra_headers=BYPASS)
    chat_tools = [
        {
            "type": "function",
            "function": {
                k: v for k, v in TOOLS[0].items() if k in ("name", "description", "parameters")
            },
        }  # fmt: skip
    ]
    chat = openai_client.chat.completions.create(
        model=LLAMA, messages=as_chat(t), tools=chat_tools, max_tokens=8, temperature=0
    )
    assert text_of(cached) == text_of(bypass) == chat.choices[0].message.content
    assert cached.usage.input_tokens == bypass.usage.input_tokens == chat.usage.prompt_tokens


def test_instructions_reach_the_prompt_as_its_system_message(openai_client):
    """`instructions` is the system turn, as chat completions' system message renders."""
    t = tag()
    question = "Which file is newest?"
    r = openai_client.responses.create(
        model=LLAMA, instructions=f"You are Codex {t}. Answer tersely.", input=question,
        max_output_tokens=8, temperature=0,
    )  # fmt: skip
    chat = openai_client.chat.completions.create(
        model=LLAMA,
        messages=[
            {"role": "system", "content": f"You are Codex {t}. Answer tersely."},
            {"role": "user", "content": question},
        ],
        max_tokens=8,
        temperature=0,
    )
    bare = openai_client.responses.create(
        model=LLAMA, input=question, max_output_tokens=8, temperature=0
    )
    assert r.usage.input_tokens == chat.usage.prompt_tokens > bare.usage.input_tokens
    assert text_of(r) == chat.choices[0].message.content


def test_turn_two_of_a_conversation_is_served_from_the_cache(openai_client):
    key = f"codex-{tag()}"
    turn1 = conversation(key)
    first = openai_client.responses.create(
        model=LLAMA, input=turn1, tools=TOOLS, max_output_tokens=8, temperature=0,
        prompt_cache_key=key, store=False,
    )  # fmt: skip
    turn2 = [
        *turn1,
        *[i.model_dump(exclude_none=True) for i in first.output],
        {"type": "message", "role": "user", "content": "And the hidden ones?"},
    ]
    raw = openai_client.responses.with_raw_response.create(
        model=LLAMA, input=turn2, tools=TOOLS, max_output_tokens=8, temperature=0,
        prompt_cache_key=key, store=False,
    )  # fmt: skip
    second = raw.parse()
    cached = second.usage.input_tokens_details.cached_tokens
    # The whole first prompt at least: Codex re-sends what the first turn answered.
    assert cached >= first.usage.input_tokens
    assert raw.headers[HIT] == str(cached) and raw.headers["x-prompt-cache-source"] == "ram"
    records = httpx.get(str(openai_client.base_url) + "cache/requests", timeout=30).json()
    mine = [r for r in records["requests"] if r["session"] == key]
    assert [r["hit_tokens"] for r in mine] == [cached, first.usage.input_tokens_details.cached_tokens]  # fmt: skip


def test_previous_response_id_continues_as_the_full_history_would(openai_client):
    t = tag()
    kwargs = dict(model=LLAMA, tools=TOOLS, max_output_tokens=8, temperature=0)
    first = openai_client.responses.create(input=conversation(t), **kwargs)
    follow = {"type": "message", "role": "user", "content": "Now count them."}
    chained = openai_client.responses.create(
        previous_response_id=first.id, input=[follow], **kwargs
    )
    history = [*conversation(t), *[i.model_dump(exclude_none=True) for i in first.output]]
    resent = openai_client.responses.create(
        input=[*history, follow], **kwargs, extra_headers=BYPASS
    )
    assert chained.previous_response_id == first.id
    assert chained.usage.input_tokens == resent.usage.input_tokens
    assert chained.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert text_of(chained) == text_of(resent)
    # A chain of two: the store holds the conversation each response ended with.
    third = openai_client.responses.create(previous_response_id=chained.id, input="Thanks.", **kwargs)  # fmt: skip
    assert third.usage.input_tokens > chained.usage.input_tokens + chained.usage.output_tokens


def test_unknown_or_unstored_previous_response_id_is_a_400_naming_it(openai_client):
    unstored = openai_client.responses.create(
        model=LLAMA, input=f"hi {tag()}", max_output_tokens=2, store=False
    )
    for rid in ("resp_nope", unstored.id):
        with pytest.raises(openai.BadRequestError) as e:
            openai_client.responses.create(model=LLAMA, previous_response_id=rid, input="more")
        assert e.value.body["param"] == "previous_response_id"
        assert e.value.body["code"] == "previous_response_not_found"


BAD = [
    ({"input": 5}, "input"),
    ({"input": [{"type": "bogus"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "call_id": "c1", "arguments": "{}"}]}, "input[0].name"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "message", "role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input[0].content[0].type"),
    ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"input": "x", "tools": [{"type": "namespace", "name": "n", "tools": [{"type": "function", "name": 3}]}]}, "tools[0].tools[0].name"),
    ({"input": "x", "tool_choice": "sometimes"}, "tool_choice"),
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "rm"}}, "tool_choice.name"),
    ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 10**7}, "max_output_tokens"),
    ({}, "input"),
]  # fmt: skip


@pytest.mark.parametrize("body,param", BAD, ids=[p for _, p in BAD])
def test_bad_input_is_a_400_naming_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/responses", json={"model": LLAMA, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"


def test_metrics_count_the_routes_refusals(server):
    httpx.post(server.url + "/v1/responses", json={"model": LLAMA, "input": 5}, timeout=30)
    text = httpx.get(server.url + "/metrics", timeout=30).text
    assert 'mlx_prompt_cache_http_errors_total{route="/v1/responses",status="400"}' in text


# ---------------------------------------------------------------------------------------
# A model not served here goes to the upstream


@pytest.fixture
async def with_upstream(aiohttp_client, aiohttp_server, demo_root, tmp_path):
    seen: list[dict] = []

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "lms-model"}]})

    async def responses(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.json_response(
            {"id": "resp_up", "object": "response", "created_at": 0, "status": "completed",
             "model": "lms-model", "output": [], "parallel_tool_calls": True,
             "tool_choice": "auto", "tools": []},
            headers={"x-upstream": "yes"},
        )  # fmt: skip

    upstream = web.Application()
    upstream.router.add_get("/v1/models", models)
    upstream.router.add_post("/v1/responses", responses)
    up = await aiohttp_server(upstream)
    engine = Engine(
        EngineSettings(
            cache_dir=fresh_cache_dir(demo_root, tmp_path / "cache"),
            model_specs=list(DEMO_IDS),
            ssd_enabled=False,
        )
    )
    config = UpstreamConfig(url=str(up.make_url("")).rstrip("/"))
    client = await aiohttp_client(create_app(engine, ProxySettings(), config))
    return client, seen


async def test_a_model_not_served_here_passes_through_to_the_upstream(with_upstream):
    client, seen = with_upstream
    sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="t", max_retries=0)
    raw = await sdk.responses.with_raw_response.create(model="lms-model", input="hello")
    assert raw.headers["x-upstream"] == "yes" and HIT not in raw.headers
    assert raw.parse().id == "resp_up"
    assert seen == [{"model": "lms-model", "input": "hello"}]


def test_answers_and_codex_bodies_match_the_documented_schemas(openai_client, server):
    import jsonschema_rs

    from tests.dialects.test_responses_codex import CODEX_BODY

    doc = httpx.get(server.url + "/openapi.json", timeout=30).json()
    op = doc["paths"]["/v1/responses"]["post"]

    def validator(name: str):
        root = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
        return jsonschema_rs.Draft202012Validator(root)

    body = {"model": LLAMA, "input": conversation(tag()), "tools": TOOLS, "max_output_tokens": 4}
    validator("ResponsesRequest").validate(body)
    validator("ResponsesRequest").validate(CODEX_BODY)
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 200
    validator("Response").validate(r.json())
    for name, header in op["responses"]["200"]["headers"].items():
        assert name in r.headers or not header.get("required"), name


async def test_a_generation_failing_mid_stream_ends_it_with_response_failed(
    aiohttp_client, demo_root, tmp_path, monkeypatch
):
    from engine_bridge.types import GenerationFailed
    from proxy.generation import Generation

    real = Generation.parts

    async def fails_after_one(self):
        async for p in real(self):
            yield p
            raise GenerationFailed("generation failed: the GPU caught fire")

    monkeypatch.setattr(Generation, "parts", fails_after_one)
    engine = Engine(
        EngineSettings(
            cache_dir=fresh_cache_dir(demo_root, tmp_path / "cache"),
            model_specs=[LLAMA],
            ssd_enabled=False,
        )
    )
    client = await aiohttp_client(create_app(engine, ProxySettings(), UpstreamConfig(enabled=False)))  # fmt: skip
    body = {"model": LLAMA, "input": "hi", "max_output_tokens": 8, "stream": True}
    r = await client.post("/v1/responses", json=body)
    assert r.status == 200
    text = await r.text()
    events = [orjson.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events][-1] == "response.failed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert "the GPU caught fire" in failed["error"]["message"]
    assert failed["output"][0]["type"] == "message"  # what was sent before the failure
    assert "[DONE]" not in text
