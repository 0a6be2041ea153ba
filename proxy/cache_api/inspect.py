"""Seeing why requests missed, and steering what is cached ahead of time.

- `GET /v1/cache/requests`: the last requests, each with its hit, its divergence and a
  reason class, plus the hit-ratio alert.
- `GET /v1/cache/diagnosis`: a window's prompt tokens computed again, ranked by cause,
  each with the setting (or the sentence) that fixes it; `?window=1h`, `model`, `tenant`,
  `session` narrow it.
- `POST /v1/cache/probe`: what a chat body would restore from RAM and SSD, and what it
  would recompute, without running the model.
- `POST /v1/cache/warm`: prefill and store a chat body, generating nothing (warm Claude
  Code's system prompt at login).

Probe and warm take a chat body in either dialect and parse it with the chat routes' own
parsers, so a body renders, and fails, exactly as it would there. The dialect is
`?dialect=openai|anthropic` when given; otherwise Anthropic when the request carries an
`anthropic-version` header or the body has a field only Anthropic's Messages API has
(top-level `system`, `stop_sequences`, `metadata`, `thinking`, or a content block typed
`tool_use`, `tool_result`, `thinking`, `image`/`document` with a `source`); else OpenAI.
Errors come in the chosen dialect's shape, as the chat route would send them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any

from aiohttp import web

from engine_bridge.types import EngineError, GenerationRequest, conversation_id

from ..config.units import parse_duration
from ..dialects import anthropic as anthropic_api
from ..dialects.openai import chat as chat_api
from ..dialects.openai import completions as completions_api
from ..errors import ApiError, Dialect, api_error, error_response
from ..fields import parse_json_object, read_body
from ..generation import Given, apply_model_settings, request_options
from ..state import ENGINE, REQUEST_ID, SETTINGS

DIALECTS = ("openai", "anthropic")
REQUESTS_DEFAULT = 50
REQUESTS_MAX = 500
# Top-level fields and content block types that only Anthropic's Messages API has.
_ANTHROPIC_FIELDS = ("system", "stop_sequences", "metadata", "thinking")
_ANTHROPIC_BLOCKS = {"tool_use", "tool_result", "thinking", "redacted_thinking"}
_SOURCED_BLOCKS = {"image", "document"}


def visible_tenant(request: web.Request) -> str | None:
    """The only tenant whose data the caller may see with [tenants] api_keys; None: all."""
    if not request.app[SETTINGS].tenant_api_keys:
        return None
    return request_options(request)[0]


async def recent_requests(request: web.Request) -> web.Response:
    raw = request.query.get("limit")
    limit = REQUESTS_DEFAULT
    if raw is not None:
        try:
            limit = int(raw)
        except ValueError:
            limit = 0
        if not 1 <= limit <= REQUESTS_MAX:
            raise ApiError(
                400,
                f"limit: expected an integer from 1 to {REQUESTS_MAX}, got {raw!r}",
                param="limit",
            )
    engine = request.app[ENGINE]
    records = engine.recent_requests(limit, visible_tenant(request))
    return web.json_response(
        {"requests": [r.to_json() for r in records], "alert": engine.hit_ratio_alert()}
    )


async def diagnosis(request: web.Request) -> web.Response:
    q = request.query
    window_s = None
    if (raw := q.get("window")) is not None:
        try:
            window_s = parse_duration(raw)
        except ValueError:
            window_s = 0.0
        if window_s <= 0:
            raise ApiError(400, f"window: expected a duration such as 90s, 30m or 1h, "
                           f"got {raw!r}", param="window")  # fmt: skip
    tenant = q.get("tenant")
    visible = visible_tenant(request)
    if visible is not None:
        if tenant not in (None, visible):
            raise ApiError(403, f"tenant: this key may see only tenant {visible!r}",
                           param="tenant")  # fmt: skip
        tenant = visible
    engine = request.app[ENGINE]
    # The fixes read the tiers' stats, which ask the SSD's index: off the event loop.
    body = await asyncio.to_thread(engine.diagnosis, window_s, model=q.get("model"),
                                   tenant=tenant, session=q.get("session"))  # fmt: skip
    return web.json_response(body)


def choose_dialect(request: web.Request, body: dict[str, Any] | None) -> Dialect:
    """The dialect a probe or warm body is read in (see the module doc)."""
    asked = request.query.get("dialect")
    if asked is not None:
        if asked not in DIALECTS:
            raise ApiError(
                400,
                f"dialect: expected one of {list(DIALECTS)}, got {asked!r}",
                param="dialect",
            )
        return asked  # type: ignore[return-value]
    if "anthropic-version" in request.headers:
        return "anthropic"
    if body is None:
        return "openai"
    if any(name in body for name in _ANTHROPIC_FIELDS):
        return "anthropic"
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        for block in content if isinstance(content, list) else ():
            kind = block.get("type") if isinstance(block, dict) else None
            if kind in _ANTHROPIC_BLOCKS or (kind in _SOURCED_BLOCKS and "source" in block):
                return "anthropic"
    return "openai"


def parse_request(
    request: web.Request, body: dict[str, Any], dialect: Dialect
) -> GenerationRequest:
    """The GenerationRequest the dialect's chat route would build from `body`, the
    model's settings filled in (their template kwargs shape the prompt)."""
    if dialect == "anthropic":
        req = anthropic_api.messages_request(body, request)
        given = anthropic_api.given(body)
    elif "messages" not in body and "prompt" in body:
        req, given = completions_api.completion_request(body, request), Given.of(body)
    else:
        req, given = chat_api.chat_request(body, request), Given.of(body)
    apply_model_settings(req, request, given)
    req.request_id = request.get(REQUEST_ID, "")
    if not req.session:
        req.session = conversation_id(req.messages)
    return req


Action = Callable[[web.Request, GenerationRequest], Awaitable[dict[str, Any]]]


def body_route(action: Action) -> Callable[[web.Request], Awaitable[web.Response]]:
    """Read a chat body, parse it in its dialect, run `action`; errors in that dialect."""

    async def handler(request: web.Request) -> web.Response:
        dialect: Dialect = "openai"
        try:
            dialect = choose_dialect(request, None)
            raw = await read_body(request, request.app[SETTINGS].max_body_bytes)
            body = parse_json_object(raw)
            dialect = choose_dialect(request, body)
            return web.json_response(await action(request, parse_request(request, body, dialect)))
        except (ApiError, EngineError) as e:
            err = api_error(e)
            return error_response(err, dialect, err.headers)

    return handler


async def _probe(request: web.Request, req: GenerationRequest) -> dict[str, Any]:
    return asdict(await request.app[ENGINE].probe(req))


async def _warm(request: web.Request, req: GenerationRequest) -> dict[str, Any]:
    return asdict(await request.app[ENGINE].warm(req))


probe = body_route(_probe)
warm = body_route(_warm)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/cache/requests", recent_requests)
    app.router.add_get("/v1/cache/diagnosis", diagnosis)
    app.router.add_post("/v1/cache/probe", probe)
    app.router.add_post("/v1/cache/warm", warm)
