"""The aiohttp application: routes, error shapes, request ids, lifecycle."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable

from aiohttp import web

from engine_bridge.engine import Engine
from engine_bridge.logctx import request_id
from engine_bridge.types import EngineError

from .cache_api import admin as cache_admin
from .cache_api import alerts, dashboard, metrics
from .cache_api import inspect as cache_inspect
from .cache_api.proxy_stores import proxy_stats
from .config.model import UpstreamConfig
from .dialects import (
    anthropic as anthropic_api,
)
from .dialects import (
    lmstudio as lmstudio_api,
)
from .dialects import (
    responses as responses_api,
)
from .dialects.openai import chat as chat_api
from .dialects.openai import completions as completions_api
from .dialects.sse import STREAM
from .errors import ApiError, api_error, dialect_for, error_response
from .fields import parse_json_object, read_body
from .generation import shown_settings
from .openapi import document as openapi
from .security import PASSTHROUGH_ROUTE, BrowserPolicy, browser_safety, setup_browser_safety
from .state import ENGINE, REQUEST_ID, SETTINGS, ProxySettings
from .upstream.client import UPSTREAM_CONFIG
from .upstream.model_list import LOCAL_OWNER, merge_model_lists, upstream_models
from .upstream.passthrough import forward, setup_passthrough

log = logging.getLogger("proxy.app")

Route = Callable[[web.Request, dict], Awaitable[web.StreamResponse]]
# Every path under it is served here or nowhere: never passed through to the upstream.
CACHE_ROUTES = "/v1/cache"


@web.middleware
async def request_context(request: web.Request, handler):
    """Give every request an id (the client's x-request-id if it sent one) and a log line."""
    rid = request.headers.get("x-request-id") or uuid.uuid4().hex[:16]
    request[REQUEST_ID] = rid
    token = request_id.set(rid)
    started = time.perf_counter()
    status = 500
    try:
        response = await handler(request)
        status = response.status
        response.headers.setdefault("x-request-id", rid)
        return response
    except (web.HTTPNotFound, web.HTTPMethodNotAllowed) as e:
        # No route matched (a path the catch-all's pattern cannot match, such as one holding
        # a newline): the documented JSON error, in the dialect's shape, not aiohttp's text.
        err = ApiError(e.status, f"no route for {request.method} {request.path!r}")
        status = err.status
        allow = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else {}
        return error_response(err, dialect_for(request.path), {**allow, "x-request-id": rid})
    except web.HTTPException as e:
        status = e.status
        raise
    except Exception as e:
        err = api_error(e)
        status = err.status
        if isinstance(e, ApiError | EngineError):
            log.info("%s %s -> %d: %s", request.method, request.path, err.status, err.message)
        else:
            log.exception("%s %s failed", request.method, request.path)
        dialect = dialect_for(request.path)
        stream = request.get(STREAM)
        if stream is not None:
            # The 200 and part of the body are out: end the stream in-band instead.
            await stream.fail(err, dialect)
            return stream.response
        return error_response(err, dialect, {**err.headers, "x-request-id": rid})
    finally:
        log.info(
            "%s %s %d %.0fms",
            request.method,
            request.path,
            status,
            (time.perf_counter() - started) * 1000,
        )
        request_id.reset(token)


def json_route(route: Route) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """Read and validate the JSON body, then hand it to the dialect's route."""

    async def handler(request: web.Request) -> web.StreamResponse:
        settings = request.app[SETTINGS]
        raw = await read_body(request, settings.max_body_bytes)
        body = parse_json_object(raw)
        model = body.get("model")
        engine = request.app[ENGINE]
        if isinstance(model, str) and model and not engine.has_model(model):
            return await unknown_model(request, raw, model)
        return await route(request, body)

    return handler


async def unknown_model(request: web.Request, body: bytes, model: str) -> web.StreamResponse:
    """A model that is not ours goes to LM Studio, unless LM Studio says it has no such model.

    An upstream that answers but cannot list its models (mlx_lm.server fails /v1/models
    without a Hugging Face cache folder) is the one to judge the request. One that does not
    answer at all gets the 404 below, which names the model, ours and the unreachable URL.
    """
    engine = request.app[ENGINE]
    local = ", ".join(engine.model_ids) or "none"
    config = request.app[UPSTREAM_CONFIG]
    if not config.enabled:
        where = "the upstream is disabled"
    else:
        upstream = await upstream_models(request.app)
        if upstream.reachable and not upstream.listed:
            log.info("model %r is not local; forwarding since %s", model, upstream.error)
            return await forward(request, body)
        if model in upstream.ids:
            return await forward(request, body)
        where = (
            f"not listed by the upstream at {config.url}"
            if upstream.reachable
            else f"the upstream at {config.url} was unreachable ({upstream.error})"
        )
    raise ApiError(
        404,
        f"model {model!r} not found: not served locally (local models: {local}), and {where}",
        param="model",
        code="model_not_found",
    )


async def health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    body = {
        "status": "ok",
        "models": engine.model_ids,
        "loaded": [m for m in engine.model_ids if engine.model_info(m).loaded],
    }
    if (ranks := engine.ranks()) is not None:
        body["ranks"] = ranks
    if (halted := engine.halted()) is not None:  # a split model that lost a rank
        return web.json_response(body | {"status": "down", "reason": halted}, status=503)
    return web.json_response(body)


async def list_models(request: web.Request) -> web.Response:
    """Local models first, then the upstream's, de-duplicated and marked by owner.

    A local model's `settings` are what a request that sets none gets: its
    [model."<pattern>"] settings, the engine's template defaults under their kwargs."""
    local = [
        {
            "id": m,
            "object": "model",
            "created": 0,
            "owned_by": LOCAL_OWNER,
            "settings": shown_settings(request.app, m),
        }
        for m in request.app[ENGINE].model_ids
    ]
    upstream = []
    if request.app[UPSTREAM_CONFIG].enabled:
        upstream = (await upstream_models(request.app)).raw
    return web.json_response({"object": "list", "data": merge_model_lists(local, upstream)})


async def cache_stats(request: web.Request) -> web.Response:
    # Off the event loop, as /metrics reads them: the SSD index's counts wait for its lock,
    # which the SSD writer thread holds while it writes, and every other route would wait.
    engine = request.app[ENGINE]
    if engine.ranks() is not None and engine.halted() is None:
        await engine.rank_stats()  # what each rank holds now, into the stats below
    stats = await asyncio.to_thread(engine.stats)
    # The proxy's own stores, read on the loop that changes them.
    body = {**stats, "alerts": alerts.active(request.app), "proxy": proxy_stats(request.app)}
    return web.json_response(body)


async def passthrough(request: web.Request) -> web.StreamResponse:
    if request.path == CACHE_ROUTES or request.path.startswith(CACHE_ROUTES + "/"):
        # Ours, not LM Studio's: a session route without an id (/v1/cache/sessions/, what
        # DELETE /v1/cache/sessions/.. resolves to) gets the documented 404, not the
        # upstream's own text/plain one.
        raise ApiError(
            404,
            f"no route for {request.method} {request.path}: the /v1/cache routes are this "
            "server's own, GET /openapi.json lists them (a session route names a session id)",
        )
    if not request.app[UPSTREAM_CONFIG].enabled:
        raise ApiError(404, f"no route for {request.method} {request.path} (upstream disabled)")
    return await forward(request)


def create_app(
    engine: Engine,
    settings: ProxySettings,
    upstream: UpstreamConfig | None = None,
    policy: BrowserPolicy | None = None,
) -> web.Application:
    # browser_safety runs inside request_context, so its refusals get the dialect's shape.
    app = web.Application(
        # count_errors is outermost: it sees the status of every answer, refusals included.
        middlewares=[metrics.count_errors, request_context, browser_safety],
        client_max_size=settings.max_body_bytes,
    )
    app[ENGINE] = engine
    app[SETTINGS] = settings
    setup_passthrough(app, upstream or UpstreamConfig())
    setup_browser_safety(app, policy or BrowserPolicy())
    metrics.setup_metrics(app)
    alerts.setup_alerts(app)

    async def lifecycle(app: web.Application):
        janitor = asyncio.create_task(engine.janitor())
        yield
        janitor.cancel()
        await engine.close()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/cache/stats", cache_stats)
    app.router.add_post("/v1/chat/completions", json_route(chat_api.chat_completions))
    app.router.add_post("/v1/completions", json_route(completions_api.completions))
    app.router.add_post("/v1/messages", json_route(anthropic_api.messages))
    app.router.add_post("/v1/messages/count_tokens", json_route(anthropic_api.count_tokens))
    responses_api.add_routes(app, json_route)
    lmstudio_api.add_routes(app)
    cache_admin.add_routes(app)
    app.router.add_get("/openapi.json", openapi.serve)
    cache_inspect.add_routes(app)
    dashboard.add_routes(app)
    app.router.add_get("/metrics", metrics.serve)
    # Everything else is LM Studio's: embeddings, /api/v0, /api/v1, ...
    app.router.add_route("*", "/{tail:.*}", passthrough, name=PASSTHROUGH_ROUTE)
    return app
