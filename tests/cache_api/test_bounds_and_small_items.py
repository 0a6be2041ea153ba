"""Issue 33: the proxy's stores bounded by bytes and shown in /v1/cache/stats; the request
log's message digest without reprs of images; reasoning_tokens counted per token; pump
faults of a WebSocket tunnel collected; loggers named for their modules; the documented
404 under /v1/cache.

In-process apps on a real engine (demo models), a fake LM Studio for the upstream.
"""

from __future__ import annotations

import ast
import asyncio
import json
import logging

import httpx
import orjson
import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer
from prometheus_client.parser import text_string_to_metric_families

from engine_bridge.engine import Engine, EngineSettings
from engine_bridge.ops.request_log import _digest
from engine_bridge.scheduling.forced_output import ENV as FORCE_OUTPUT
from engine_bridge.types import ImageInput, Message, ToolCall
from proxy.app import create_app
from proxy.config.model import UpstreamConfig
from proxy.dialects.response_store import ResponseStore
from proxy.dialects.responses import STORE
from proxy.state import ProxySettings
from proxy.upstream import websocket
from tests.conftest import REPO, fresh_cache_dir
from tests.support.fake_lmstudio import FakeLmStudio

LLAMA, HYBRID = "demo-llama", "demo-hybrid"


def _json(item) -> int:
    return len(orjson.dumps(item))


# ---------------------------------------------------------------------------------------
# The Responses store: bytes, not a count


def test_the_response_store_counts_a_chain_of_turns_items_once_and_evicts_oldest_first():
    image = {"type": "input_image", "image_url": "data:image/png;base64," + "A" * 4000}
    first = ({"role": "user", "content": [image]}, {"type": "message", "content": "seen"})
    second = (*first, {"role": "user", "content": "and now?"}, {"type": "message", "content": "!"})
    one_image = sum(_json(i) for i in second)
    store = ResponseStore(max_bytes=one_image + 100)
    store.put("r1", "t", first)
    store.put("r2", "t", second)  # the chain shares the image: it counts once
    assert (len(store), store.bytes) == (2, one_image)
    # Another conversation with its own copy of the image: the oldest entry goes, but the
    # image it shared stays counted while r2 holds it.
    other = ({"role": "user", "content": [dict(image)]},)
    store.put("r3", "t", other)
    assert store.get("r1", "t") is None and store.was_evicted("r1", "t")
    assert not store.was_evicted("r1", "another tenant")
    assert store.get("r2", "t") is None  # still over: r2 went too
    s = store.stats()
    assert (s.entries, s.bytes, s.max_bytes, s.evicted) == (1, _json(other[0]), one_image + 100, 2)
    # An entry larger than the whole bound is not kept at all.
    store.put("huge", "t", ({"content": "x" * (one_image + 200)},))
    assert (len(store), store.bytes, store.was_evicted("huge", "t")) == (0, 0, True)


@pytest.fixture
async def llama_app(aiohttp_client, demo_root, tmp_path):
    engine = Engine(
        EngineSettings(cache_dir=fresh_cache_dir(demo_root, tmp_path / "c"), model_specs=[LLAMA])
    )
    app = create_app(engine, ProxySettings(), UpstreamConfig(enabled=False))
    app[STORE] = ResponseStore(max_bytes=1000)
    return await aiohttp_client(app)


async def test_an_evicted_previous_response_id_is_a_400_saying_so_and_stats_show_the_bound(
    llama_app,
):
    client = llama_app
    body = {"model": LLAMA, "max_output_tokens": 2, "temperature": 0}
    first = await (await client.post("/v1/responses", json=body | {"input": "a " * 200})).json()
    stats = await (await client.get("/v1/cache/stats")).json()
    stored = _json({"type": "message", "role": "user", "content": "a " * 200})
    stored += sum(_json(o) for o in first["output"])
    assert stats["proxy"] == {
        "responses": {"entries": 1, "bytes": stored, "max_bytes": 1000, "evicted": 0}
    }
    # A second conversation does not fit beside the first: the first is evicted.
    r = await client.post("/v1/responses", json=body | {"input": "b " * 200})
    assert r.status == 200
    r = await client.post("/v1/responses", json=body | {"previous_response_id": first["id"]})
    assert r.status == 400 and r.content_type == "application/json"
    err = (await r.json())["error"]
    assert (err["param"], err["code"]) == ("previous_response_id", "previous_response_not_found")
    assert "was evicted" in err["message"] and "up to 1000 bytes" in err["message"]
    stats = (await (await client.get("/v1/cache/stats")).json())["proxy"]["responses"]
    assert (stats["entries"], stats["evicted"], stats["max_bytes"]) == (1, 1, 1000)
    # The same figures on /metrics.
    text = await (await client.get("/metrics")).text()
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    p = "mlx_prompt_cache_proxy_responses_"
    assert samples[p + "max_bytes"] == 1000 and samples[p + "entries"] == 1
    assert samples[p + "bytes"] == stats["bytes"] and samples[p + "evicted_total"] == 1


# ---------------------------------------------------------------------------------------
# The request log's digest of a message


def test_a_message_digest_reads_an_images_bytes_never_its_repr(monkeypatch):
    def no_repr(self) -> str:
        raise AssertionError("the digest spelled out the image")

    monkeypatch.setattr(ImageInput, "__repr__", no_repr)
    big = b"\x89PNG" + bytes(range(256)) * (32 << 10)  # 8 MB
    other = big[:-1] + b"\x00"

    def message(data: bytes, field: str = "messages[0].content[1]") -> Message:
        return Message("user", "look", parts=("look", ImageInput(data, "image/png", field)))

    assert _digest(message(big)) != _digest(message(other))
    # Where the image sat in the body is not its identity (as Message equality says).
    assert _digest(message(big)) == _digest(message(big, "messages[2].content[1]"))
    calls = (ToolCall("Bash", {"command": "ls", "timeout": 5}, "c1"),)
    reordered = (ToolCall("Bash", {"timeout": 5, "command": "ls"}, "c1"),)
    assert _digest(Message("assistant", tool_calls=calls)) == _digest(
        Message("assistant", tool_calls=calls)
    )
    assert _digest(Message("assistant", tool_calls=calls)) != _digest(
        Message("assistant", tool_calls=reordered)
    )


# ---------------------------------------------------------------------------------------
# reasoning_tokens, per token

# demo-hybrid's generation prompt opens <think>; its byte-level vocabulary writes each CJK
# character in 3 tokens and the emoji in 4, each piece decoding to no text of its own.
REASONING = "想一想🙂 好的\n</think>"
FORCED = REASONING + "\n\nDone."


@pytest.fixture
async def hybrid_app(aiohttp_client, demo_root, tmp_path, monkeypatch):
    forced = tmp_path / "forced.json"
    forced.write_text(json.dumps({"outputs": [{"match": "[emoji]", "text": FORCED}]}))
    monkeypatch.setenv(FORCE_OUTPUT, str(forced))
    cache = fresh_cache_dir(demo_root, tmp_path / "c")
    engine = Engine(EngineSettings(cache_dir=cache, model_specs=[HYBRID]))
    client = await aiohttp_client(
        create_app(engine, ProxySettings(), UpstreamConfig(enabled=False))
    )
    return client, load_tokenizer(cache / "models" / HYBRID)


async def test_reasoning_tokens_count_each_token_of_a_character_split_across_tokens(hybrid_app):
    client, tok = hybrid_app
    want = len(tok.encode(REASONING, add_special_tokens=False))
    assert want == 22 and len(tok.encode(FORCED, add_special_tokens=False)) == 26
    body = {"model": HYBRID, "max_tokens": 64, "temperature": 0}
    body["messages"] = [{"role": "user", "content": "[emoji] think"}]
    chat = await (await client.post("/v1/chat/completions", json=body)).json()
    assert chat["choices"][0]["message"]["content"] == "Done."
    assert chat["usage"]["completion_tokens_details"]["reasoning_tokens"] == want
    body = {"model": HYBRID, "max_output_tokens": 64, "input": "[emoji] think", "stream": True}
    r = await client.post("/v1/responses", json=body)
    events = [
        json.loads(line[6:]) for line in (await r.text()).splitlines() if line[:6] == "data: "
    ]
    usage = events[-1]["response"]["usage"]
    assert usage["output_tokens_details"]["reasoning_tokens"] == want
    assert usage["output_tokens"] == 27  # the forced text, then end of sequence


# ---------------------------------------------------------------------------------------
# A WebSocket tunnel's pumps


class _Socket:
    """A tunnel end: `fail` raises from its first receive; otherwise it waits forever."""

    def __init__(self, fail: Exception | None = None):
        self.fail = fail
        self.close_code: int | None = None
        self.closed_with: int | None = None
        self.receiving_ended = False

    def __aiter__(self):
        return self._messages()

    async def _messages(self):
        try:
            if self.fail is not None:
                raise self.fail
            await asyncio.Event().wait()
            yield  # pragma: no cover
        finally:
            self.receiving_ended = True

    async def close(self, code: int) -> None:
        self.closed_with = code


async def test_a_failing_pump_is_logged_and_the_other_is_ended_before_the_tunnel_returns(caplog):
    client, upstream = _Socket(fail=ConnectionResetError("client gone mid-frame")), _Socket()
    with caplog.at_level(logging.WARNING, logger=websocket.log.name):
        await asyncio.wait_for(websocket._tunnel(client, upstream, "GET /llm"), 5)
    assert upstream.receiving_ended, "the upstream's pump still runs after the tunnel ended"
    assert upstream.closed_with == 1001  # the client vanished without a close frame
    (record,) = [r for r in caplog.records if r.name == websocket.log.name]
    assert "ws pump to upstream: GET /llm" in record.message
    assert "client gone mid-frame" in record.message


# ---------------------------------------------------------------------------------------
# Loggers


def test_loggers_in_proxy_and_ops_are_named_for_their_module():
    wrong = []
    for folder in ("proxy", "engine_bridge/ops"):
        for path in sorted((REPO / folder).rglob("*.py")):
            module = ".".join(path.relative_to(REPO).with_suffix("").parts)
            for node in ast.walk(ast.parse(path.read_text())):
                if (
                    isinstance(node, ast.Call)
                    and getattr(node.func, "attr", None) == "getLogger"
                    and node.args
                    and isinstance(node.args[0], ast.Constant)
                    and node.args[0].value not in (module, "aiohttp.access")
                ):
                    wrong.append(f"{path.relative_to(REPO)}: {node.args[0].value}")
    assert not wrong


# ---------------------------------------------------------------------------------------
# 404s under /v1/cache, as /openapi.json documents them


async def test_unknown_or_missing_session_ids_are_the_documented_json_404(
    aiohttp_client, demo_root, tmp_path
):
    import jsonschema_rs

    engine = Engine(
        EngineSettings(cache_dir=fresh_cache_dir(demo_root, tmp_path / "c"), model_specs=[LLAMA])
    )
    with FakeLmStudio([]) as fake:  # an upstream that answers 404 in text/plain
        app = create_app(engine, ProxySettings(), UpstreamConfig(url=fake.url))
        server = (await aiohttp_client(app)).server
        base = str(server.make_url("")).rstrip("/")
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            doc = (await http.get("/openapi.json")).json()
            item = "/v1/cache/sessions/{id}"
            cases = [
                ("DELETE", "/v1/cache/sessions/nope", item, "delete"),
                ("POST", "/v1/cache/sessions/nope/pin", item + "/pin", "post"),
                ("POST", "/v1/cache/sessions/nope/unpin", item + "/unpin", "post"),
                # No id: the routes' patterns do not match, and the passthrough took them.
                ("DELETE", "/v1/cache/sessions/", item, "delete"),
                ("POST", "/v1/cache/sessions//pin", item + "/pin", "post"),
                ("POST", "/v1/cache/sessions//unpin", item + "/unpin", "post"),
            ]
            for method, url, path, op in cases:
                r = await http.request(method, url)
                assert r.status_code == 404, (url, r.text)
                assert r.headers["content-type"].startswith("application/json"), (url, r.text)
                schema = doc["paths"][path][op]["responses"]["404"]["content"]
                root = {**schema["application/json"]["schema"], "components": doc["components"]}
                jsonschema_rs.Draft202012Validator(root).validate(r.json())
        assert not [c.path for c in fake.calls if c.path.startswith("/v1/cache")]
