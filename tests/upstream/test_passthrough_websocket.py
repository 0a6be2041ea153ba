"""WebSocket upgrades through the passthrough: tunnelled both ways, closes and refusals kept."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from tests.upstream.test_passthrough import closed_port_url, proxy_app


@pytest.fixture
async def ws_upstream(aiohttp_server):
    """An upstream WebSocket endpoint that echoes, and closes with 4001 when asked to."""
    closed_by_client = asyncio.Event()

    async def ws(request: web.Request) -> web.WebSocketResponse:
        sock = web.WebSocketResponse(protocols=["lmstudio-v1"])
        await sock.prepare(request)
        await sock.send_str(f"hello {request.headers.get('X-Custom')} {request.query_string}")
        async for msg in sock:
            if msg.type == aiohttp.WSMsgType.TEXT and msg.data == "bye":
                await sock.close(code=4001, message=b"asked to")
            elif msg.type == aiohttp.WSMsgType.TEXT:
                await sock.send_str("echo:" + msg.data)
            elif msg.type == aiohttp.WSMsgType.BINARY:
                await sock.send_bytes(msg.data[::-1])
        if sock.close_code != 4001:
            closed_by_client.set()
        return sock

    app = web.Application()
    app.router.add_get("/llm", ws)
    server = await aiohttp_server(app)
    return str(server.make_url("")).rstrip("/"), closed_by_client


async def test_websocket_is_tunnelled_both_ways(aiohttp_client, ws_upstream):
    upstream, _ = ws_upstream
    client = await aiohttp_client(proxy_app(upstream))
    async with client.ws_connect(
        "/llm?x=1", protocols=["lmstudio-v1"], headers={"X-Custom": "kept"}
    ) as ws:
        assert ws.protocol == "lmstudio-v1"
        assert await ws.receive_str(timeout=5) == "hello kept x=1"
        await ws.send_str("ping")
        assert await ws.receive_str(timeout=5) == "echo:ping"
        await ws.send_bytes(b"\x00\x01\x02")
        assert await ws.receive_bytes(timeout=5) == b"\x02\x01\x00"
        await ws.send_str("bye")
        msg = await ws.receive(timeout=5)
        assert msg.type == aiohttp.WSMsgType.CLOSE
        assert msg.data == 4001  # the upstream's close code reaches the client


async def test_websocket_client_close_closes_upstream(aiohttp_client, ws_upstream):
    upstream, closed_by_client = ws_upstream
    client = await aiohttp_client(proxy_app(upstream))
    ws = await client.ws_connect("/llm")
    assert (await ws.receive_str(timeout=5)).startswith("hello")
    await ws.close()
    await asyncio.wait_for(closed_by_client.wait(), 5)


async def test_websocket_upstream_down_is_502(aiohttp_client):
    url = closed_port_url()
    client = await aiohttp_client(proxy_app(url))
    with pytest.raises(aiohttp.WSServerHandshakeError) as err:
        await client.ws_connect("/llm")
    assert err.value.status == 502


async def test_websocket_refused_by_upstream_keeps_its_status(aiohttp_client, ws_upstream):
    upstream, _ = ws_upstream
    client = await aiohttp_client(proxy_app(upstream))
    with pytest.raises(aiohttp.WSServerHandshakeError) as err:
        await client.ws_connect("/no-such-socket")
    assert err.value.status == 404
