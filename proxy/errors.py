"""Client-facing errors, rendered in the shape of the API dialect that was called."""

from __future__ import annotations

import math
from typing import Literal

import orjson
from aiohttp import web

from engine_bridge.types import EngineError, GenerationFailed

Dialect = Literal["openai", "anthropic"]

_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}
_OPENAI_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    # What api.openai.com sends for a request-rate limit (code "rate_limit_exceeded").
    429: "requests",
    500: "server_error",
    502: "upstream_error",
    503: "server_error",
    504: "upstream_timeout",
}


def dialect_for(path: str) -> Dialect:
    """The dialect a route speaks, so its errors (and a failed stream's end) are in its shape."""
    return "anthropic" if path.startswith("/v1/messages") else "openai"


class ApiError(Exception):
    """A request the proxy refuses; `param` names the field at fault when there is one."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        # Sent with the error response (Retry-After on a 429).
        self.headers = headers or {}


def api_error(exc: Exception) -> ApiError:
    """The one mapping from anything a route raised to what the client is told."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, EngineError):
        if exc.status != 429:
            return ApiError(exc.status, exc.message, param=exc.field)
        # Retry-After is whole seconds; 0 would invite a retry storm against a full queue.
        wait = max(1, math.ceil(exc.retry_after_s or 1))
        return ApiError(
            429, exc.message, code="rate_limit_exceeded", headers={"Retry-After": str(wait)}
        )
    if isinstance(exc, GenerationFailed):
        return ApiError(500, f"{exc}; see the server log", code="generation_failed")
    return ApiError(
        500, "internal error while serving the request; see the server log", code="internal"
    )


def error_body(err: ApiError, dialect: Dialect) -> dict:
    if dialect == "anthropic":
        return {
            "type": "error",
            "error": {
                "type": _ANTHROPIC_TYPES.get(err.status, "invalid_request_error"),
                "message": err.message,
            },
        }
    return {
        "error": {
            "message": err.message,
            "type": _OPENAI_TYPES.get(err.status, "invalid_request_error"),
            "param": err.param,
            "code": err.code,
        }
    }


def error_response(
    err: ApiError, dialect: Dialect, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        status=err.status,
        body=orjson.dumps(error_body(err, dialect)),
        content_type="application/json",
        headers=headers,
    )
