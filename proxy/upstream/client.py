"""The upstream connection: its config, the one client session every forwarded request
shares, the URL a request goes to, and the 502 or 504 for an upstream that gave no usable
response.

One ``aiohttp.ClientSession`` per process (created in a ``cleanup_ctx``) carries every
forwarded request, so keep-alive connections to LM Studio are pooled.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web
from yarl import URL

from proxy.config.model import UpstreamConfig
from proxy.errors import ApiError, dialect_for, error_response

log = logging.getLogger(__name__)

# aiohttp adds these when absent; a passthrough must send only what the client sent (an
# added Accept-Encoding would get the client a gzip body it never asked for).
_NO_AUTO_HEADERS = ("Accept", "Accept-Encoding", "User-Agent")

UPSTREAM_CONFIG = web.AppKey("upstream_config", UpstreamConfig)
UPSTREAM_SESSION = web.AppKey("upstream_session", aiohttp.ClientSession)


async def upstream_session(app: web.Application) -> AsyncIterator[None]:
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


def upstream_url(config: UpstreamConfig, request: web.Request) -> URL:
    """The upstream URL for a request: same raw path and query string, byte for byte."""
    return URL(config.url.rstrip("/") + request.rel_url.raw_path_qs, encoded=True)


def fault_reason(exc: BaseException) -> str:
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
        message = f"{where} is unreachable: {fault_reason(exc)}"
    log.warning("%s %s: %s (%s)", request.method, request.path, message, type(exc).__name__)
    return error_response(ApiError(status, message, code=code), dialect_for(request.path))


def _one_line(text: str, limit: int = 200) -> str:
    # The parser's message spans lines and points at the bad byte with a lone "^".
    words = " ".join(w for w in text.split() if w != "^")
    return words if len(words) <= limit else words[: limit - 3] + "..."
