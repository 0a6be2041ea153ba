"""The proxy at the engine's boundary: how refusals and failures reach each dialect.

The app runs in-process on a real engine and the real demo-llama. A model failure is
injected on the engine's MLX side (the loaded model raises from its forward pass); a
refusal the engine has no easy real trigger for here (429, a failure before the first
event) is raised from `Engine.start`, the boundary itself.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
from dataclasses import dataclass
from pathlib import Path

import anthropic
import httpx
import openai
import orjson
import pytest

from engine_bridge.engine import Engine, EngineSettings
from engine_bridge.models import loading as models
from engine_bridge.types import EngineError, GenerationFailed, GenerationRequest
from proxy.app import create_app
from proxy.config.model import UpstreamConfig
from proxy.state import ProxySettings
from tests.conftest import fresh_cache_dir, start_server

MODEL = "demo-llama"
USER = [{"role": "user", "content": "hi"}]
OPENAI_ROUTES = {
    "/v1/chat/completions": {"messages": USER},
    "/v1/completions": {"prompt": "The cache"},
    "/api/v0/chat/completions": {"messages": USER},
    "/api/v0/completions": {"prompt": "The cache"},
}
ROUTES = {**OPENAI_ROUTES, "/v1/messages": {"messages": USER}}


def body(route: str, **extra) -> dict:
    return {"model": MODEL, "max_tokens": 24, "temperature": 0, **ROUTES[route], **extra}


class Fault:
    """Makes the model's forward pass raise from call number `at` on, while armed."""

    def __init__(self, at: int):
        self.at = at
        self.armed = True
        self.calls = itertools.count()

    def wrap(self, loaded: models.LoadedModel) -> models.LoadedModel:
        model = loaded.model
        cls = type(model)
        fault = self

        def call(self, *args, **kwargs):
            if fault.armed and next(fault.calls) >= fault.at:
                raise RuntimeError("injected fault: the forward pass failed")
            return cls.__call__(self, *args, **kwargs)

        # A subclass, not a wrapper object: isinstance checks and attributes stay as they are.
        model.__class__ = type(cls.__name__, (cls,), {"__call__": call})
        return loaded


@dataclass
class App:
    client: object  # aiohttp TestClient
    engine: Engine

    @property
    def url(self) -> str:
        return str(self.client.make_url("")).rstrip("/")

    async def post(self, route: str, json: dict, headers: dict | None = None, **kwargs):
        headers = {"Content-Type": "application/json", **(headers or {})}
        return await self.client.post(route, data=orjson.dumps(json), headers=headers, **kwargs)


@pytest.fixture
async def app(aiohttp_client, demo_root, tmp_path) -> App:
    engine = Engine(
        EngineSettings(
            cache_dir=fresh_cache_dir(demo_root, tmp_path / "cache"),
            model_specs=[MODEL],
            ssd_enabled=False,
        )
    )
    application = create_app(engine, ProxySettings(), UpstreamConfig(enabled=False))
    return App(await aiohttp_client(application), engine)


@pytest.fixture
def fault(monkeypatch) -> Fault:
    """Every model loaded from now on fails on its fourth forward pass (after a few tokens)."""
    f = Fault(at=3)
    real_load = models.load
    monkeypatch.setattr(models, "load", lambda ref: f.wrap(real_load(ref)))
    return f


def sse_events(raw: bytes) -> list[tuple[str | None, str]]:
    """(event name, data) for every event of a raw SSE body, in order."""
    out = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
        out.append((name, "\n".join(data)))
    return out


# ---------------------------------------------------------------------------------------
# A failure after the response started ends the stream in the dialect's own way


@pytest.mark.parametrize("route", list(OPENAI_ROUTES))
async def test_openai_stream_failing_mid_generation_ends_with_error_chunk_then_done(
    app, fault, route
):
    r = await app.post(route, body(route, stream=True))
    assert r.status == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(await r.read())
    datas = [d for _, d in events]
    assert datas[-1] == "[DONE]"
    error = orjson.loads(datas[-2])
    assert set(error) == {"error"}
    assert error["error"]["type"] == "server_error"
    assert error["error"]["code"] == "generation_failed"
    assert "injected fault" in error["error"]["message"]
    chunks = [orjson.loads(d) for d in datas[:-2]]
    assert chunks, "the stream had started before the failure"
    # No chunk claims a normal end: the only ending is the error.
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
    assert all(name is None for name, _ in events)

    fault.armed = False  # the server keeps serving once the fault is gone
    ok = await app.post(route, body(route, max_tokens=2))
    assert ok.status == 200


async def test_anthropic_stream_failing_mid_generation_ends_with_error_event(app, fault):
    r = await app.post("/v1/messages", body("/v1/messages", stream=True))
    assert r.status == 200
    events = sse_events(await r.read())
    names = [name for name, _ in events]
    assert names[0] == "message_start"
    assert names[-1] == "error"
    assert "message_stop" not in names and "message_delta" not in names
    error = orjson.loads(events[-1][1])
    assert error["type"] == "error"
    assert error["error"]["type"] == "api_error"
    assert "injected fault" in error["error"]["message"]
    assert set(error) == {"type", "error"} and set(error["error"]) == {"type", "message"}


async def test_sdks_raise_the_mid_stream_error(app, fault):
    oa = openai.AsyncOpenAI(base_url=app.url + "/v1", api_key="t", max_retries=0)
    stream = await oa.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=24, temperature=0, stream=True
    )
    with pytest.raises(openai.APIError, match="injected fault"):
        async for _ in stream:
            pass
    an = anthropic.AsyncAnthropic(base_url=app.url, api_key="t", max_retries=0)
    with pytest.raises(anthropic.APIStatusError, match="injected fault"):
        async with an.messages.stream(model=MODEL, messages=USER, max_tokens=24) as s:
            async for _ in s:
                pass


@pytest.mark.parametrize("route", list(ROUTES))
async def test_non_streaming_failure_mid_generation_is_500_in_dialect_shape(app, fault, route):
    r = await app.post(route, body(route))
    assert r.status == 500
    data = await r.json()
    if route == "/v1/messages":
        assert data["type"] == "error" and data["error"]["type"] == "api_error"
    else:
        assert data["error"]["type"] == "server_error"
        assert data["error"]["code"] == "generation_failed"
    assert "injected fault" in data["error"]["message"]


# ---------------------------------------------------------------------------------------
# Failures and refusals from Engine.start, before any byte of the response


def refuse_with(app: App, monkeypatch, exc: Exception) -> list[GenerationRequest]:
    seen: list[GenerationRequest] = []

    async def start(req: GenerationRequest):
        seen.append(req)
        raise exc

    monkeypatch.setattr(app.engine, "start", start)
    return seen


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("route", list(ROUTES))
async def test_failure_before_the_first_event_is_a_plain_500(app, monkeypatch, route, stream):
    refuse_with(app, monkeypatch, GenerationFailed("generation failed: restore broke"))
    r = await app.post(route, body(route, stream=stream))
    assert r.status == 500
    assert r.headers["content-type"].startswith("application/json")
    data = await r.json()
    assert "restore broke" in data["error"]["message"]
    if route == "/v1/messages":
        assert data == {
            "type": "error",
            "error": {"type": "api_error", "message": data["error"]["message"]},
        }
    else:
        assert data["error"]["type"] == "server_error"


@pytest.mark.parametrize(
    "retry_after_s,header", [(2.2, "3"), (0.1, "1"), (0.0, "1"), (None, "1"), (30, "30")]
)
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/messages", "/api/v0/completions"])
async def test_engine_429_has_retry_after_seconds_and_the_dialect_shape(
    app, monkeypatch, route, retry_after_s, header
):
    refuse_with(
        app,
        monkeypatch,
        EngineError("the queue is full", status=429, retry_after_s=retry_after_s),
    )
    r = await app.post(route, body(route, stream=True))
    assert r.status == 429
    assert r.headers["Retry-After"] == header
    assert r.headers["x-request-id"]
    data = await r.json()
    if route == "/v1/messages":
        assert data == {
            "type": "error",
            "error": {"type": "rate_limit_error", "message": "the queue is full"},
        }
    else:
        assert data == {
            "error": {
                "message": "the queue is full",
                "type": "requests",
                "param": None,
                "code": "rate_limit_exceeded",
            }
        }


async def test_engine_4xx_names_its_field_in_both_dialects(app, monkeypatch):
    refuse_with(app, monkeypatch, EngineError("prompt too long", field="messages"))
    r = await app.post("/v1/chat/completions", body("/v1/chat/completions"))
    assert r.status == 400 and "Retry-After" not in r.headers
    assert (await r.json())["error"]["param"] == "messages"
    r = await app.post("/v1/messages", body("/v1/messages"))
    assert r.status == 400
    assert (await r.json())["error"]["type"] == "invalid_request_error"


# ---------------------------------------------------------------------------------------
# What the proxy hands the engine: the session, token prompts


# A client that names no session gets one from its first user message, the same each turn.
FIRST_USER = "h-" + hashlib.sha256(b"hi").hexdigest()[:16]

SESSION_CASES = [
    # (route, headers, extra body, expected session)
    ("/v1/messages", {}, {}, FIRST_USER),
    ("/v1/chat/completions", {}, {}, FIRST_USER),
    ("/v1/messages", {}, {"metadata": {"user_id": "u1"}}, "u1"),
    ("/v1/chat/completions", {}, {"user": "u2"}, "u2"),
    ("/v1/completions", {}, {"user": "u3"}, "u3"),
    ("/api/v0/chat/completions", {}, {"user": "u4"}, "u4"),
    ("/v1/messages", {"x-session-id": "s1"}, {"metadata": {"user_id": "u1"}}, "s1"),
    ("/v1/chat/completions", {"x-session-id": "s2"}, {"user": "u2"}, "s2"),
    (
        "/v1/messages",
        {"X-Claude-Code-Session-Id": "cc", "x-session-id": "s1"},
        {"metadata": {"user_id": "u1"}},
        "cc",
    ),
    ("/v1/chat/completions", {"X-Claude-Code-Session-Id": "cc"}, {"user": "u2"}, "cc"),
    ("/v1/messages", {}, {"metadata": {}}, FIRST_USER),
    ("/v1/messages", {}, {"metadata": {"user_id": None}}, FIRST_USER),
    # A legacy completion has no messages: no conversation to name it after.
    ("/v1/completions", {}, {}, ""),
]


@pytest.mark.parametrize("route,headers,extra,session", SESSION_CASES)
async def test_session_comes_from_headers_then_the_body(
    app, monkeypatch, route, headers, extra, session
):
    seen = refuse_with(app, monkeypatch, EngineError("stop here", status=503))
    r = await app.post(route, body(route, **extra), headers=headers)
    assert r.status == 503
    assert [req.session for req in seen] == [session]


@pytest.fixture(scope="module")
def tokenizer(demo_root):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(Path(demo_root) / "models" / MODEL))


async def test_token_array_prompt_generates_as_its_text_does(app, tokenizer):
    text = "The prompt cache keeps"
    ids = tokenizer.encode(text, add_special_tokens=False)
    common = {"model": MODEL, "max_tokens": 8, "temperature": 0}
    # Each request bypasses the cache, so the second cannot be served from the first.
    bypass = {"x-prompt-cache": "bypass"}
    by_text = await (
        await app.post("/v1/completions", {**common, "prompt": text}, headers=bypass)
    ).json()
    by_ids = await (
        await app.post("/v1/completions", {**common, "prompt": ids}, headers=bypass)
    ).json()
    nested = await (
        await app.post("/v1/completions", {**common, "prompt": [ids]}, headers=bypass)
    ).json()
    assert by_text["usage"]["prompt_tokens"] == len(ids)
    assert by_ids["usage"]["prompt_tokens"] == len(ids)
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert nested["choices"][0]["text"] == by_text["choices"][0]["text"]


async def test_token_array_prompt_reaches_the_engine_as_tokens(app, monkeypatch):
    seen = refuse_with(app, monkeypatch, EngineError("stop here", status=503))
    await app.post("/v1/completions", {"model": MODEL, "prompt": [5, 0, 17]})
    await app.post("/v1/completions", {"model": MODEL, "prompt": "text"})
    assert [(r.prompt_tokens, r.prompt) for r in seen] == [([5, 0, 17], None), (None, "text")]


# ---------------------------------------------------------------------------------------
# Model state as the engine reports it


async def test_health_and_lmstudio_models_show_what_model_info_says(app):
    health = await (await app.client.get("/health")).json()
    assert health["models"] == [MODEL] and health["loaded"] == []
    entry = (await (await app.client.get("/api/v0/models")).json())["data"][0]
    assert entry["id"] == MODEL and entry["state"] == "not-loaded"
    assert "arch" not in entry

    r = await app.post("/v1/chat/completions", body("/v1/chat/completions", max_tokens=1))
    assert r.status == 200
    info = app.engine.model_info(MODEL)
    assert info.loaded and info.context_length
    health = await (await app.client.get("/health")).json()
    assert health["loaded"] == [MODEL]
    entry = (await (await app.client.get("/api/v0/models")).json())["data"][0]
    assert entry["state"] == "loaded"
    assert entry["arch"] == info.arch == "llama"
    assert entry["max_context_length"] == info.context_length


# ---------------------------------------------------------------------------------------
# Real servers: the scheduler's queue limit, and token ids the model does not have


def long_body(route: str, i: int) -> dict:
    # Long enough (seconds on the demo model) that the first is still decoding when the
    # third arrives; every stream is closed as soon as the check is done.
    content = f"Write forever, story {i}."
    prompt = {"prompt": content} if "messages" not in ROUTES[route] else {}
    messages = {"messages": [{"role": "user", "content": content}]} if not prompt else {}
    return {
        "model": MODEL,
        "max_tokens": 2000,
        "temperature": 0,
        "stream": True,
        **prompt,
        **messages,
    }


async def three_at_once(url: str, route: str) -> tuple[list[int], httpx.Response, bytes]:
    """One decoding, one waiting (a full queue at max_batch=1, max_queue=1), then a third."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:

        async def open_stream(i: int) -> httpx.Response:
            return await c.send(
                c.build_request("POST", route, json=long_body(route, i)), stream=True
            )

        first = await open_stream(0)  # its headers come once it is admitted
        second = asyncio.create_task(open_stream(1))
        await asyncio.sleep(0.3)
        third = await open_stream(2)
        body = await third.aread() if third.status_code != 200 else b""
        await third.aclose()
        await first.aclose()
        if second.done():
            await (await second).aclose()
        else:
            second.cancel()
        statuses = [first.status_code, third.status_code]
        return statuses, third, body


def test_a_full_queue_answers_429_with_retry_after(demo_root, tmp_path):
    s = start_server(
        fresh_cache_dir(demo_root, tmp_path / "c"),
        "--upstream",
        "http://127.0.0.1:9",
        "--model",
        MODEL,
        "--max-batch",
        "1",
        env={"MLX_PROMPT_CACHE_ENGINE_MAX_QUEUE": "1"},
    )
    try:
        for route in ("/v1/chat/completions", "/v1/messages"):
            statuses, refused, raw = asyncio.run(three_at_once(s.url, route))
            assert statuses == [200, 429]
            assert int(refused.headers["Retry-After"]) >= 1
            data = orjson.loads(raw)
            if route == "/v1/messages":
                assert data["type"] == "error"
                assert data["error"]["type"] == "rate_limit_error"
            else:
                assert data["error"]["code"] == "rate_limit_exceeded"
    finally:
        s.stop()


def test_token_ids_outside_the_vocabulary_are_a_400_not_a_crash(demo_root, tmp_path):
    s = start_server(fresh_cache_dir(demo_root, tmp_path / "c"), "--upstream", "http://127.0.0.1:9")
    try:
        try:
            r = httpx.post(
                s.url + "/v1/completions",
                json={"model": MODEL, "prompt": [1, 10**9], "max_tokens": 2},
                timeout=60,
            )
        except httpx.HTTPError as e:
            pytest.fail(f"the server died on an out-of-vocabulary token id: {e!r}")
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "prompt"
        assert httpx.get(s.url + "/health", timeout=10).status_code == 200
    finally:
        s.stop()
