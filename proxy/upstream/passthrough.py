"""Upstream passthrough: what the proxy does not serve goes to LM Studio, streamed as it comes.

This is the HTTP relay, and the entry point for anything passed through: a WebSocket
upgrade goes on to the tunnel (`websocket`). Bodies are passed through byte for byte: no
decompression, no buffering of the response beyond holding an event stream's unfinished
event until its blank line arrives.

When the upstream fails, the client is told which fault it was, in its dialect's shape: a
504 when it does not answer in time, a 502 when it answers with something that is not HTTP
or hangs up, and an in-band error event when an event stream breaks off half way.
"""

from __future__ import annotations

import logging

import aiohttp
from aiohttp import web

from proxy.config.model import UpstreamConfig
from proxy.dialects.sse import SSEWriter
from proxy.errors import ApiError, dialect_for
from proxy.upstream.client import (
    UPSTREAM_CONFIG,
    UPSTREAM_SESSION,
    upstream_failed,
    upstream_session,
    upstream_url,
)
from proxy.upstream.headers import HOP_BY_HOP, REQUEST_ONLY_DROP, filtered, with_token
from proxy.upstream.model_list import MODELS_CACHE, ModelsCache
from proxy.upstream.relay import EventStream, mirror
from proxy.upstream.websocket import forward_websocket, is_websocket

log = logging.getLogger(__name__)


def setup_passthrough(app: web.Application, config: UpstreamConfig) -> None:
    """Store the upstream config and open/close the shared client session with the app."""
    app[UPSTREAM_CONFIG] = config
    app[MODELS_CACHE] = ModelsCache()
    app.cleanup_ctx.append(upstream_session)


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
    if is_websocket(request):
        return await forward_websocket(request, config, session)
    if body is None and request.body_exists:
        body = await request.read()
    headers = with_token(filtered(request.headers, HOP_BY_HOP | REQUEST_ONLY_DROP), config)
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

    return await mirror(request, upstream, lambda r: _relay_body(request, config, upstream, r))


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


def _body_fault(exc: Exception, config: UpstreamConfig) -> str:
    """Why a response body stopped short, for the client and the log."""
    if isinstance(exc, TimeoutError):
        return f"no data for {config.timeout_s:g} s (raise [upstream] timeout_s if it is only slow)"
    if isinstance(exc, aiohttp.ClientPayloadError):
        cause = exc.__cause__
        detail = cause.message if isinstance(cause, aiohttp.http.HttpProcessingError) else exc
        return f"the connection closed before the body was complete ({detail})"
    return str(exc) or type(exc).__name__
