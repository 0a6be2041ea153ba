"""Upstream passthrough against a real mlx_lm.server (standing in for LM Studio), plus small
aiohttp upstreams for what mlx_lm.server cannot show (echoed headers, gated streams)."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import openai
import pytest
from aiohttp import web

from engine_bridge.models.demo import ensure_demo_model
from proxy.config.model import UpstreamConfig
from proxy.upstream.client import UPSTREAM_CONFIG
from proxy.upstream.model_list import merge_model_lists, upstream_models
from proxy.upstream.passthrough import forward, setup_passthrough

CHAT = {
    "messages": [{"role": "user", "content": "hello world"}],
    "max_tokens": 8,
    "temperature": 0.0,
}


# ---------------------------------------------------------------------------------------
# Fixtures: the demo model, a real mlx_lm.server on it, and the proxy under test


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_demo_model("demo-llama", tmp_path_factory.mktemp("demo"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def mlx_upstream(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """A real `mlx_lm.server` process on a free port: the stand-in for LM Studio."""
    home = tmp_path_factory.mktemp("hf")
    (home / "hub").mkdir()  # its /v1/models scans the HF cache and fails if there is none
    port = _free_port()
    log_path = home / "server.log"
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(tiny_model)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--max-tokens", "16"]
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"mlx_lm.server did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def proxy_app(upstream: str, **config: object) -> web.Application:
    app = web.Application()
    setup_passthrough(app, UpstreamConfig(url=upstream, connect_timeout_s=1.0, **config))

    async def chat_read_first(request: web.Request) -> web.StreamResponse:
        # What the integrator does for a model only the upstream has: read, decide, forward.
        body = await request.read()
        assert json.loads(body)["model"]
        return await forward(request, body)

    app.router.add_post("/v1/chat/completions", chat_read_first)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


def closed_port_url() -> str:
    return f"http://127.0.0.1:{_free_port()}"


# ---------------------------------------------------------------------------------------
# Against mlx_lm.server


async def test_chat_completion_through_proxy_matches_direct_upstream(aiohttp_client, mlx_upstream):
    client = await aiohttp_client(proxy_app(mlx_upstream))
    payload = {**CHAT, "model": "default_model"}
    async with aiohttp.ClientSession() as direct:
        async with direct.post(mlx_upstream + "/v1/chat/completions", json=payload) as resp:
            expected = await resp.json(content_type=None)
    resp = await client.post("/v1/chat/completions", json=payload)
    assert resp.status == 200
    assert resp.headers["Content-Type"] == "application/json"
    got = await resp.json(content_type=None)
    assert got["object"] == "chat.completion"
    assert got["choices"][0]["message"] == expected["choices"][0]["message"]
    assert got["choices"][0]["message"]["content"]  # greedy and deterministic, never empty
    # Not the whole usage: mlx_lm.server's own prompt cache makes cached_tokens differ.
    for key in ("prompt_tokens", "completion_tokens"):
        assert got["usage"][key] == expected["usage"][key]


async def test_streaming_chat_through_proxy_with_openai_sdk(aiohttp_client, mlx_upstream):
    client = await aiohttp_client(proxy_app(mlx_upstream))

    async def stream_text(base_url: str) -> tuple[str, list[str | None]]:
        sdk = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
        async with sdk:
            stream = await sdk.chat.completions.create(model="default_model", stream=True, **CHAT)
            text, finishes = "", []
            async for chunk in stream:
                text += chunk.choices[0].delta.content or ""
                finishes.append(chunk.choices[0].finish_reason)
        return text, finishes

    expected = await stream_text(mlx_upstream + "/v1")
    got = await stream_text(str(client.make_url("/v1")))
    assert got == expected
    assert got[0] and got[1][-1] == "length"


async def test_raw_sse_bytes_keep_event_stream_framing(aiohttp_client, mlx_upstream):
    client = await aiohttp_client(proxy_app(mlx_upstream))
    resp = await client.post(
        "/v1/chat/completions", json={**CHAT, "model": "default_model", "stream": True}
    )
    assert resp.status == 200
    assert resp.headers["Content-Type"] == "text/event-stream"
    body = (await resp.read()).decode()
    events = [e for e in body.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert all(json.loads(e[6:])["object"] == "chat.completion.chunk" for e in events[:-1])


async def test_models_list_passes_through(aiohttp_client, mlx_upstream, tiny_model):
    client = await aiohttp_client(proxy_app(mlx_upstream))
    resp = await client.get("/v1/models")
    assert resp.status == 200
    data = await resp.json(content_type=None)
    assert [m["id"] for m in data["data"]] == [str(tiny_model.resolve())]


async def test_upstream_404_keeps_status_body_and_headers(aiohttp_client, mlx_upstream):
    client = await aiohttp_client(proxy_app(mlx_upstream))
    resp = await client.get("/api/v0/no-such-route")
    assert resp.status == 404
    assert await resp.read() == b"Not Found"
    assert resp.headers["Access-Control-Allow-Methods"] == "*"
    assert resp.headers["Content-Type"] == "application/json"


async def test_upstream_models_reads_mlx_server_list(aiohttp_client, mlx_upstream, tiny_model):
    client = await aiohttp_client(proxy_app(mlx_upstream))
    models = await upstream_models(client.app)
    assert models.reachable is True
    assert models.error is None
    assert models.ids == [str(tiny_model.resolve())]
    assert models.raw[0]["object"] == "model"


# ---------------------------------------------------------------------------------------
# Against small aiohttp upstreams


async def echo(request: web.Request) -> web.Response:
    body = await request.read()
    info = {
        "method": request.method,
        "path_qs": request.rel_url.raw_path_qs,
        "headers": [[k, v] for k, v in request.headers.items()],
        "body": body.decode("latin-1"),
    }
    resp = web.json_response(info, headers={"X-Upstream": "echo"})
    resp.headers.add("Set-Cookie", "a=1; Path=/")
    resp.headers.add("Set-Cookie", "b=2; Path=/")
    return resp


@pytest.fixture
async def echo_upstream(aiohttp_server):
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", echo)
    return await aiohttp_server(app)


async def test_query_string_and_custom_headers_survive(aiohttp_client, echo_upstream):
    upstream = str(echo_upstream.make_url("")).rstrip("/")
    client = await aiohttp_client(proxy_app(upstream))
    headers = {
        "X-Custom": "kept",
        "Authorization": "Bearer sk-test",
        "Connection": "keep-alive, X-Per-Hop",
        "X-Per-Hop": "dropped because Connection names it",
        "Proxy-Authorization": "Basic dropped",
        "TE": "trailers",
    }
    resp = await client.get(
        "/api/v0/models?b=2&a=%20x&a=1&flag", headers=headers, skip_auto_headers=["Accept-Encoding"]
    )
    assert resp.status == 200
    info = await resp.json()
    assert info["path_qs"] == "/api/v0/models?b=2&a=%20x&a=1&flag"
    sent = {k.lower(): v for k, v in info["headers"]}
    assert sent["x-custom"] == "kept"
    assert sent["authorization"] == "Bearer sk-test"
    assert sent["host"] == f"{echo_upstream.host}:{echo_upstream.port}"
    for hop in ("x-per-hop", "proxy-authorization", "te"):
        assert hop not in sent
    # The client asked for no encoding, so the upstream must not be offered gzip by us.
    assert "accept-encoding" not in sent
    assert resp.headers["X-Upstream"] == "echo"
    assert resp.headers.getall("Set-Cookie") == ["a=1; Path=/", "b=2; Path=/"]


async def test_post_body_arrives_byte_for_byte_read_here_or_by_caller(
    aiohttp_client, echo_upstream
):
    upstream = str(echo_upstream.make_url("")).rstrip("/")
    client = await aiohttp_client(proxy_app(upstream))
    raw = '{"model": "only-upstream", "x": "é\\u0000"}'.encode()
    for path in ("/v1/embeddings", "/v1/chat/completions"):  # forward reads / caller read
        resp = await client.post(
            path + "?q=1", data=raw, headers={"Content-Type": "application/json"}
        )
        info = await resp.json()
        assert info["method"] == "POST"
        assert info["body"].encode("latin-1") == raw
        sent = {k.lower(): v for k, v in info["headers"]}
        assert sent["content-length"] == str(len(raw))
        assert sent["content-type"] == "application/json"


async def test_compressed_body_passes_undecoded(aiohttp_client, aiohttp_server):
    payload = b'{"data": "' + b"x" * 5000 + b'"}'

    async def gz(request: web.Request) -> web.Response:
        assert request.headers["Accept-Encoding"] == "gzip"
        return web.Response(
            body=gzip.compress(payload),
            headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
        )

    app = web.Application()
    app.router.add_get("/gz", gz)
    server = await aiohttp_server(app)
    client = await aiohttp_client(
        proxy_app(str(server.make_url("")).rstrip("/")), auto_decompress=False
    )
    resp = await client.get("/gz", headers={"Accept-Encoding": "gzip"})
    assert resp.headers["Content-Encoding"] == "gzip"
    raw = await resp.read()
    assert resp.headers["Content-Length"] == str(len(raw))
    assert gzip.decompress(raw) == payload


async def test_redirect_is_passed_to_the_client_not_followed(aiohttp_client, aiohttp_server):
    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPFound("/elsewhere")

    app = web.Application()
    app.router.add_get("/old", redirect)
    server = await aiohttp_server(app)
    client = await aiohttp_client(proxy_app(str(server.make_url("")).rstrip("/")))
    resp = await client.get("/old", allow_redirects=False)
    assert resp.status == 302
    assert resp.headers["Location"] == "/elsewhere"


async def test_sse_chunk_reaches_client_before_upstream_finishes(aiohttp_client, aiohttp_server):
    gate = asyncio.Event()

    async def gated(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: first\n\n")
        # Only the client having seen "first" opens the gate: a buffering proxy deadlocks.
        await asyncio.wait_for(gate.wait(), 10)
        await resp.write(b"data: second\n\n")
        return resp

    app = web.Application()
    app.router.add_get("/sse", gated)
    server = await aiohttp_server(app)
    client = await aiohttp_client(proxy_app(str(server.make_url("")).rstrip("/")))
    resp = await client.get("/sse")
    assert resp.headers["Content-Type"] == "text/event-stream"
    first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
    assert first == b"data: first\n\n"
    gate.set()
    assert await asyncio.wait_for(resp.read(), 5) == b"data: second\n\n"


@pytest.mark.parametrize("handler_cancellation", [False, True])
async def test_client_disconnect_mid_stream_closes_upstream_request(
    aiohttp_client, aiohttp_server, handler_cancellation
):
    upstream_gone = asyncio.Event()

    async def endless(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(600):
                await resp.write(f"data: {i}\n\n".encode())
                await asyncio.sleep(0.02)
        except (ConnectionResetError, asyncio.CancelledError):
            upstream_gone.set()
            raise
        return resp

    app = web.Application()
    app.router.add_get("/endless", endless)
    server = await aiohttp_server(app)
    client = await aiohttp_client(
        proxy_app(str(server.make_url("")).rstrip("/")),
        server_kwargs={"handler_cancellation": handler_cancellation},
    )
    resp = await client.get("/endless")
    assert await resp.content.readuntil(b"\n\n") == b"data: 0\n\n"
    resp.close()  # drop the connection mid-stream
    await asyncio.wait_for(upstream_gone.wait(), 5)


async def test_upstream_not_listening_is_502_naming_the_url(aiohttp_client):
    url = closed_port_url()
    client = await aiohttp_client(proxy_app(url))
    resp = await client.post("/v1/embeddings", json={"input": "x"})
    assert resp.status == 502
    error = (await resp.json())["error"]
    assert error["type"] == "upstream_error"
    assert error["code"] == "upstream_unreachable"
    assert error["message"].startswith(f"upstream LM Studio at {url} is unreachable: ")


async def test_upstream_stopped_after_use_is_502(aiohttp_client, echo_upstream):
    upstream = str(echo_upstream.make_url("")).rstrip("/")
    client = await aiohttp_client(proxy_app(upstream))
    assert (await client.get("/v1/models")).status == 200  # leaves a pooled connection
    await echo_upstream.close()
    resp = await client.get("/v1/models")
    assert resp.status == 502
    assert upstream in (await resp.json())["error"]["message"]


async def test_passthrough_off_is_404(aiohttp_client, echo_upstream):
    upstream = str(echo_upstream.make_url("")).rstrip("/")
    client = await aiohttp_client(proxy_app(upstream, enabled=False))
    resp = await client.get("/api/v0/models")
    assert resp.status == 404
    assert (await resp.json())["error"]["type"] == "not_found"
    models = await upstream_models(client.app)
    assert models.reachable is False


async def test_upstream_models_unreachable_is_reported_and_cached(aiohttp_client):
    url = closed_port_url()
    client = await aiohttp_client(proxy_app(url))
    first = await upstream_models(client.app)
    assert first.reachable is False
    assert first.ids == []
    assert first.error
    # Within the TTL a second caller gets the same answer without another connection.
    assert await upstream_models(client.app) is first
    assert client.app[UPSTREAM_CONFIG].url == url


async def test_upstream_models_non_json_answer_is_reachable_with_error(
    aiohttp_client, aiohttp_server
):
    async def broken(request: web.Request) -> web.Response:
        return web.Response(text="<html>LM Studio</html>")

    app = web.Application()
    app.router.add_get("/v1/models", broken)
    server = await aiohttp_server(app)
    client = await aiohttp_client(proxy_app(str(server.make_url("")).rstrip("/")))
    models = await upstream_models(client.app)
    assert models.reachable is True
    assert models.ids == []
    assert "no model list" in models.error


def test_merge_model_lists_local_first_deduplicated_with_owners():
    local = [{"id": "demo-llama", "object": "model", "created": 0}, {"id": "qwen3-mlx"}]
    upstream = [
        {"id": "qwen3-mlx", "object": "model", "owned_by": "organization_owner"},
        {"id": "gemma-gguf", "object": "model", "owned_by": "organization_owner"},
        {"id": "nomic-embed", "object": "model"},
        {"object": "model"},  # no id: unusable, dropped
    ]
    merged = merge_model_lists(local, upstream)
    assert merged == [
        {"id": "demo-llama", "object": "model", "created": 0, "owned_by": "mlx-prompt-cache"},
        {"id": "qwen3-mlx", "object": "model", "owned_by": "mlx-prompt-cache"},
        {"id": "gemma-gguf", "object": "model", "owned_by": "organization_owner"},
        {"id": "nomic-embed", "object": "model", "owned_by": "lmstudio"},
    ]


async def test_upstream_dying_mid_body_truncates_client_response(aiohttp_client, aiohttp_server):
    # An event stream ends with an error event instead (tests/upstream/test_upstream_faults.py).
    async def dies(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        await resp.write(b"data: partial\n\n")
        await asyncio.sleep(0.05)
        request.transport.close()  # no final chunk: the upstream crashed
        return resp

    app = web.Application()
    app.router.add_get("/dies", dies)
    server = await aiohttp_server(app)
    client = await aiohttp_client(proxy_app(str(server.make_url("")).rstrip("/")))
    resp = await client.get("/dies")
    assert resp.status == 200
    assert await resp.content.readuntil(b"\n\n") == b"data: partial\n\n"
    # A clean end of stream would pass a cut-off answer off as complete.
    with pytest.raises(aiohttp.ClientPayloadError):
        await resp.read()


async def test_head_and_no_content_statuses_pass_without_a_body(aiohttp_client, aiohttp_server):
    async def fixed(request: web.Request) -> web.Response:
        return web.json_response({"data": []})

    async def no_content(request: web.Request) -> web.Response:
        return web.Response(status=204, headers={"X-Deleted": "model-x"})

    app = web.Application()
    app.router.add_get("/v1/fixed", fixed)  # aiohttp answers HEAD for GET routes
    app.router.add_delete("/api/v0/models/x", no_content)
    server = await aiohttp_server(app)
    client = await aiohttp_client(proxy_app(str(server.make_url("")).rstrip("/")))
    head = await client.head("/v1/fixed")
    assert head.status == 200
    assert head.headers["Content-Length"] == str(len(b'{"data": []}'))
    assert await head.read() == b""
    deleted = await client.delete("/api/v0/models/x")
    assert deleted.status == 204
    assert deleted.headers["X-Deleted"] == "model-x"
    assert await deleted.read() == b""
