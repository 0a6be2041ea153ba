"""Upstream passthrough: what the proxy does not serve goes to LM Studio, streamed as it comes.

One ``aiohttp.ClientSession`` per process (created in a ``cleanup_ctx``) carries every
forwarded request, so keep-alive connections to LM Studio are pooled. Bodies are passed
through byte for byte: no decompression, no buffering of the response beyond holding an
event stream's unfinished event until its blank line arrives.

When the upstream fails, the client is told which fault it was, in its dialect's shape: a
504 when it does not answer in time, a 502 when it answers with something that is not HTTP
or hangs up, and an in-band error event when an event stream breaks off half way.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from proxy.config.model import UpstreamConfig
from proxy.dialects.sse import SSEWriter
from proxy.errors import ApiError, dialect_for, error_response
from proxy.upstream.relay import EventStream

log = logging.getLogger(__name__)

# RFC 9110 §7.6.1 connection-specific headers, plus the de-facto Proxy-Connection.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
# Host names the upstream, Content-Length is recomputed from the body actually sent, and
# Expect: 100-continue was already answered to the client when its body was read.
_REQUEST_ONLY_DROP = frozenset({"host", "content-length", "expect"})
# aiohttp adds these when absent; a passthrough must send only what the client sent (an
# added Accept-Encoding would get the client a gzip body it never asked for).
_NO_AUTO_HEADERS = ("Accept", "Accept-Encoding", "User-Agent")

MODELS_TTL_S = 2.0
MODELS_TIMEOUT_S = 3.0
LOCAL_OWNER = "mlx-prompt-cache"
UPSTREAM_OWNER = "lmstudio"


@dataclass(slots=True)
class UpstreamModels:
    """What ``GET {upstream}/v1/models`` said; ``reachable`` is False when nothing answered."""

    reachable: bool
    ids: list[str] = field(default_factory=list)
    error: str | None = None
    raw: list[dict[str, Any]] = field(default_factory=list)

    @property
    def listed(self) -> bool:
        """Whether the upstream answered with a model list (so ``ids`` is what it has)."""
        return self.reachable and self.error is None


@dataclass(slots=True)
class _ModelsCache:
    # One answer, replaced every MODELS_TTL_S: bounded by construction (by what the
    # upstream lists), so not in /v1/cache/stats' `proxy` section. The lock makes
    # concurrent /v1/models and chat routing share one upstream fetch.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    value: UpstreamModels | None = None
    fetched_at: float = 0.0


UPSTREAM_CONFIG = web.AppKey("upstream_config", UpstreamConfig)
UPSTREAM_SESSION = web.AppKey("upstream_session", aiohttp.ClientSession)
_MODELS_CACHE = web.AppKey("upstream_models_cache", _ModelsCache)


def setup_passthrough(app: web.Application, config: UpstreamConfig) -> None:
    """Store the upstream config and open/close the shared client session with the app."""
    app[UPSTREAM_CONFIG] = config
    app[_MODELS_CACHE] = _ModelsCache()
    app.cleanup_ctx.append(_upstream_session)


async def _upstream_session(app: web.Application) -> AsyncIterator[None]:
    config = app[UPSTREAM_CONFIG]
    # sock_read bounds silence between chunks, not the whole response, so a generation
    # that streams for ten minutes is fine while a hung upstream is not.
    timeout = aiohttp.ClientTimeout(
        total=None, sock_connect=config.connect_timeout_s, sock_read=config.timeout_s
    )
    session = aiohttp.ClientSession(
        timeout=timeout,
        auto_decompress=False,
        # Cookies belong to the clients, not to the proxy: never keep them between requests.
        cookie_jar=aiohttp.DummyCookieJar(),
        skip_auto_headers=_NO_AUTO_HEADERS,
    )
    app[UPSTREAM_SESSION] = session
    try:
        yield
    finally:
        await session.close()


def _reason(exc: BaseException) -> str:
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return "timed out connecting"
    if isinstance(exc, TimeoutError):
        return "timed out waiting for a response"
    return str(exc) or type(exc).__name__


def upstream_failed(request: web.Request, config: UpstreamConfig, exc: Exception) -> web.Response:
    """The 502 or 504 for an upstream that gave no usable response, naming what went wrong.

    A timeout is a 504 like nginx's (connecting or waiting for the status line alike) and
    names the setting to raise; anything else is a 502.
    """
    where = f"upstream LM Studio at {config.url}"
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        status, code = 504, "upstream_timeout"
        message = (
            f"{where} did not accept a connection within {config.connect_timeout_s:g} s; "
            "raise [upstream] connect_timeout_s if it is only slow to start"
        )
    elif isinstance(exc, TimeoutError):
        status, code = 504, "upstream_timeout"
        message = (
            f"{where} sent no response within {config.timeout_s:g} s; raise [upstream] "
            "timeout_s if it is only slow (a long prompt, a model still loading)"
        )
    elif isinstance(exc, aiohttp.ServerDisconnectedError):
        status, code = 502, "upstream_closed"
        message = f"{where} closed the connection without answering"
    elif isinstance(exc, aiohttp.ClientResponseError):
        # aiohttp's parser reports a bad status line or header as a 400 of its own making.
        status, code = 502, "upstream_invalid_response"
        message = f"{where} sent an invalid HTTP response: {_one_line(exc.message)}"
    else:
        status, code = 502, "upstream_unreachable"
        message = f"{where} is unreachable: {_reason(exc)}"
    log.warning("%s %s: %s (%s)", request.method, request.path, message, type(exc).__name__)
    return error_response(ApiError(status, message, code=code), dialect_for(request.path))


def _one_line(text: str, limit: int = 200) -> str:
    # The parser's message spans lines and points at the bad byte with a lone "^".
    words = " ".join(w for w in text.split() if w != "^")
    return words if len(words) <= limit else words[: limit - 3] + "..."


def _body_fault(exc: Exception, config: UpstreamConfig) -> str:
    """Why a response body stopped short, for the client and the log."""
    if isinstance(exc, TimeoutError):
        return f"no data for {config.timeout_s:g} s (raise [upstream] timeout_s if it is only slow)"
    if isinstance(exc, aiohttp.ClientPayloadError):
        cause = exc.__cause__
        detail = cause.message if isinstance(cause, aiohttp.http.HttpProcessingError) else exc
        return f"the connection closed before the body was complete ({detail})"
    return str(exc) or type(exc).__name__


def _filtered(headers: CIMultiDictProxy[str], drop: Iterable[str]) -> CIMultiDict[str]:
    # Headers named in Connection are hop-by-hop for this hop only (RFC 9110 §7.6.1).
    dropped = set(drop)
    for value in headers.getall("Connection", []):
        dropped.update(t.strip().lower() for t in value.split(","))
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        low = name.lower()
        if low in dropped or low.startswith("proxy-"):
            continue
        out.add(name, value)
    return out


def with_token(headers: CIMultiDict[str], config: UpstreamConfig) -> CIMultiDict[str]:
    """With `[upstream] api_token` set, LM Studio's token replaces whatever key the client
    sent (that one is for this proxy, or a placeholder)."""
    if config.api_token is not None:
        headers["Authorization"] = f"Bearer {config.api_token}"
    return headers


def upstream_url(config: UpstreamConfig, request: web.Request) -> URL:
    """The upstream URL for a request: same raw path and query string, byte for byte."""
    return URL(config.url.rstrip("/") + request.rel_url.raw_path_qs, encoded=True)


async def forward(request: web.Request, body: bytes | None = None) -> web.StreamResponse:
    """Send the request to the upstream and stream its answer back unchanged.

    ``body`` is for callers that already read the request (to look at the model); without
    it the body is read here, bounded by the app's ``client_max_size``.
    """
    config = request.config_dict[UPSTREAM_CONFIG]
    if not config.enabled:
        message = f"no route for {request.method} {request.path} (upstream passthrough is off)"
        error = {"message": message, "type": "not_found", "code": 404}
        return web.json_response({"error": error}, status=404)
    session = request.config_dict[UPSTREAM_SESSION]
    if _is_websocket(request):
        return await _forward_websocket(request, config, session)
    if body is None and request.body_exists:
        body = await request.read()
    headers = with_token(_filtered(request.headers, HOP_BY_HOP | _REQUEST_ONLY_DROP), config)
    try:
        upstream = await session.request(
            request.method,
            upstream_url(config, request),
            headers=headers,
            data=body,
            allow_redirects=False,  # a redirect is the client's to follow, not ours
        )
    except (aiohttp.ClientError, TimeoutError) as exc:
        return upstream_failed(request, config, exc)

    # close() drops the connection (the upstream sees the client's disconnect and stops
    # generating); release() returns a fully read one to the pool.
    drained = False
    try:
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        # Content-Length and Content-Encoding stay: the bytes are passed through untouched.
        response.headers.extend(_filtered(upstream.headers, HOP_BY_HOP))
        await response.prepare(request)
        drained = await _relay_body(request, config, upstream, response)
        return response
    finally:
        if drained:
            upstream.release()
        else:
            upstream.close()


async def _relay_body(
    request: web.Request,
    config: UpstreamConfig,
    upstream: aiohttp.ClientResponse,
    response: web.StreamResponse,
) -> bool:
    """Copy the body to the client; True when the upstream's body was read to its end."""
    responses = request.path == _RESPONSES_ROUTE
    events = EventStream(responses=responses) if _is_event_stream(upstream) else None
    received = 0
    try:
        async for chunk in upstream.content.iter_any():
            received += len(chunk)
            out = events.feed(chunk) if events is not None else chunk
            if out and not await _send(request, response, out):
                return False
        if events is None or events.finished or not _must_finish(request, upstream):
            if events is not None and events.held:
                await _send(request, response, bytes(events.held))
            return True
        # A body that ends when the connection closes looks complete however early the
        # close came; for the dialects' streams the missing final event tells them apart.
        fault = "the connection closed before the stream's final event"
    except (aiohttp.ClientError, TimeoutError) as exc:
        fault = _body_fault(exc, config)
    where = f"upstream LM Studio at {config.url}"
    if events is None:
        # Too late for a 502, and a plain body has no in-band error: cut the client's
        # connection so it sees a truncated response instead of a clean end.
        log.warning(
            "%s %s: %s failed after %d bytes of the body: %s; cutting the client's connection",
            request.method,
            request.path,
            where,
            received,
            fault,
        )
        if request.transport is not None:
            request.transport.close()
        return False
    message = f"{where} dropped the stream after {received} bytes: {fault}"
    log.warning("%s %s: %s", request.method, request.path, message)
    # The unfinished event in events.held is dropped: sent with a blank line after it, its
    # cut-off JSON would make the client's SDK fail on a parse error instead of this message.
    if not events.at_boundary and not await _send(request, response, b"\n\n"):
        return False
    err = ApiError(502, message, code="upstream_stream_dropped")
    sse = SSEWriter(request, response=response)
    if responses:
        await sse.fail_response(err, events.response_id, events.next_sequence)
    else:
        await sse.fail(err, dialect_for(request.path))
    return False


async def _send(request: web.Request, response: web.StreamResponse, data: bytes) -> bool:
    try:
        await response.write(data)
    except ConnectionResetError:
        log.info("client left during %s %s; closing upstream", request.method, request.path)
        return False
    return True


def _is_event_stream(upstream: aiohttp.ClientResponse) -> bool:
    return upstream.content_type == "text/event-stream"


# Routes whose streams end with a final event of their dialect's own (see EventStream).
_RESPONSES_ROUTE = "/v1/responses"
_FINAL_EVENT_ROUTES = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/messages", _RESPONSES_ROUTE}
)


def _must_finish(request: web.Request, upstream: aiohttp.ClientResponse) -> bool:
    """Whether an end of body without the dialect's final event means the stream broke off.

    Only a body that ends when the connection closes (mlx_lm.server's HTTP/1.0 streams) can
    end early without aiohttp noticing; a chunked or sized body that stops short raises.
    """
    if (
        request.method != "POST"
        or upstream.status != 200
        or request.path not in _FINAL_EVENT_ROUTES
    ):
        return False
    sized = "Content-Length" in upstream.headers
    return not sized and "chunked" not in upstream.headers.get("Transfer-Encoding", "").lower()


def _is_websocket(request: web.Request) -> bool:
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


async def _forward_websocket(
    request: web.Request, config: UpstreamConfig, session: aiohttp.ClientSession
) -> web.StreamResponse:
    """Tunnel a WebSocket (LM Studio's own SDKs talk to it this way) message by message."""
    protocols = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",")]
    headers = with_token(
        _filtered(request.headers, HOP_BY_HOP | _REQUEST_ONLY_DROP | _WS_HANDSHAKE), config
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


async def upstream_models(app: web.Application) -> UpstreamModels:
    """The upstream's model list, cached for ~2 s so routing a chat request stays cheap.

    A failure is cached too: a stopped LM Studio costs one connection attempt per TTL.
    """
    config = app[UPSTREAM_CONFIG]
    cache = app[_MODELS_CACHE]
    if not config.enabled:
        return UpstreamModels(reachable=False, error="upstream passthrough is off")
    async with cache.lock:
        now = time.monotonic()
        if cache.value is not None and now - cache.fetched_at < MODELS_TTL_S:
            return cache.value
        cache.value = await _fetch_models(app[UPSTREAM_SESSION], config)
        cache.fetched_at = time.monotonic()
        return cache.value


async def _fetch_models(session: aiohttp.ClientSession, config: UpstreamConfig) -> UpstreamModels:
    url = config.url.rstrip("/") + "/v1/models"
    timeout = aiohttp.ClientTimeout(total=MODELS_TIMEOUT_S, sock_connect=config.connect_timeout_s)
    try:
        headers = with_token(CIMultiDict({"Accept": "application/json"}), config)
        async with session.get(url, timeout=timeout, headers=headers) as resp:
            status = resp.status
            try:
                raw = await resp.read()
            except (aiohttp.ClientError, TimeoutError) as exc:
                # It answered, so it is up: only its list is broken (mlx_lm.server sends
                # 200 and then fails when the Hugging Face cache folder is missing).
                error = f"GET {url} answered HTTP {status}, then failed: {_reason(exc)}"
                return UpstreamModels(reachable=True, error=error)
    except (aiohttp.ClientError, TimeoutError) as exc:
        return UpstreamModels(reachable=False, error=_reason(exc))
    if status != 200:
        return UpstreamModels(reachable=True, error=f"GET {url} answered HTTP {status}")
    try:
        data = json.loads(raw)
        entries = [e for e in data["data"] if isinstance(e, dict) and isinstance(e.get("id"), str)]
    except (ValueError, KeyError, TypeError) as exc:
        return UpstreamModels(reachable=True, error=f"GET {url} returned no model list: {exc}")
    return UpstreamModels(reachable=True, ids=[e["id"] for e in entries], raw=entries)


def merge_model_lists(
    local: list[dict[str, Any]], upstream: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """One OpenAI model list: local models first, then the upstream's, one entry per id."""
    merged: list[dict[str, Any]] = []
    seen: set[str] = set()
    for entries, owner in ((local, LOCAL_OWNER), (upstream, UPSTREAM_OWNER)):
        for entry in entries:
            model_id = entry.get("id")
            if not isinstance(model_id, str) or model_id in seen:
                continue
            seen.add(model_id)
            out = {**entry, "object": "model"}
            if owner == LOCAL_OWNER or not out.get("owned_by"):
                out["owned_by"] = owner
            merged.append(out)
    return merged
