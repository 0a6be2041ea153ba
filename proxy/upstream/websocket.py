"""The WebSocket tunnel: an upgrade to a path the proxy does not serve (LM Studio's own SDKs
talk to it this way) is carried to the upstream message by message, both ways; each hop
keeps its own handshake, pings and pongs, and a close on one side closes the other with
its code."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from aiohttp import web

from proxy.config.model import UpstreamConfig
from proxy.upstream.client import upstream_failed, upstream_url
from proxy.upstream.headers import HOP_BY_HOP, REQUEST_ONLY_DROP, filtered, with_token

log = logging.getLogger(__name__)


def is_websocket(request: web.Request) -> bool:
    connection = {t.strip().lower() for t in request.headers.get("Connection", "").split(",")}
    return request.headers.get("Upgrade", "").lower() == "websocket" and "upgrade" in connection


# Each hop negotiates its own handshake; only the subprotocol is carried across.
_WS_HANDSHAKE = frozenset(
    {
        "sec-websocket-key",
        "sec-websocket-version",
        "sec-websocket-extensions",
        "sec-websocket-protocol",
    }
)
# Codes an endpoint may send in a close frame (RFC 6455 §7.4); 1005/1006 are only observed.
_WS_SENDABLE = frozenset({1000, 1001, 1002, 1003, 1007, 1008, 1009, 1010, 1011}) | set(
    range(3000, 5000)
)


async def forward_websocket(
    request: web.Request, config: UpstreamConfig, session: aiohttp.ClientSession
) -> web.StreamResponse:
    """Tunnel a WebSocket (LM Studio's own SDKs talk to it this way) message by message."""
    protocols = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",")]
    headers = with_token(
        filtered(request.headers, HOP_BY_HOP | REQUEST_ONLY_DROP | _WS_HANDSHAKE), config
    )
    try:
        upstream = await session.ws_connect(
            upstream_url(config, request),
            headers=headers,
            protocols=[p for p in protocols if p],
            max_msg_size=0,  # the upstream's limits apply, not a second, smaller one here
        )
    except aiohttp.WSServerHandshakeError as exc:
        message = f"upstream {config.url} refused the WebSocket upgrade: {exc.status} {exc.message}"
        error = {"message": message, "type": "upstream_error", "code": exc.status}
        return web.json_response({"error": error}, status=exc.status if exc.status >= 400 else 502)
    except (aiohttp.ClientError, TimeoutError) as exc:
        return upstream_failed(request, config, exc)

    client = web.WebSocketResponse(
        protocols=[upstream.protocol] if upstream.protocol else (), max_msg_size=0
    )
    try:
        await client.prepare(request)
        await _tunnel(client, upstream, f"{request.method} {request.path}")
    finally:
        await upstream.close()
    return client


_WebSocket = web.WebSocketResponse | aiohttp.ClientWebSocketResponse


async def _tunnel(client: _WebSocket, upstream: _WebSocket, where: str) -> None:
    """Pump both ways until one side closes, then close the other with its code."""
    pumps = [
        asyncio.create_task(_pump(client, upstream), name=f"ws pump to upstream: {where}"),
        asyncio.create_task(_pump(upstream, client), name=f"ws pump to client: {where}"),
    ]
    try:
        done, _ = await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
    finally:
        # Also when this handler is cancelled: no pump outlives it, and each one's fault is
        # logged here rather than as "Task exception was never retrieved" at collection.
        for pump in pumps:
            pump.cancel()
        for pump, outcome in zip(
            pumps, await asyncio.gather(*pumps, return_exceptions=True), strict=True
        ):
            if isinstance(outcome, Exception):
                log.warning("%s failed: %r", pump.get_name(), outcome)
    # Whoever closed first, the other side is closed with the same code; a side that
    # vanished without a close frame is "going away" (client) or "internal error".
    closer, other = (client, upstream) if pumps[0] in done else (upstream, client)
    code = closer.close_code
    if code not in _WS_SENDABLE:
        code = 1001 if closer is client else 1011
    await other.close(code=code)


async def _pump(source: _WebSocket, sink: _WebSocket) -> None:
    """Copy messages until ``source`` closes; pings and pongs stay on their own hop."""
    async for msg in source:
        if msg.type == aiohttp.WSMsgType.TEXT:
            await sink.send_str(msg.data)
        elif msg.type == aiohttp.WSMsgType.BINARY:
            await sink.send_bytes(msg.data)
