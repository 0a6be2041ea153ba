"""The aiohttp application: routes, error shapes, request ids, lifecycle."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable

from aiohttp import web

from engine_bridge.engine import Engine
from engine_bridge.logctx import request_id

from . import anthropic_api, openai_api
from .errors import ApiError, Dialect, error_response
from .fields import parse_json_object, read_body
from .state import ENGINE, REQUEST_ID, SETTINGS, ProxySettings

log = logging.getLogger("proxy.app")

Route = Callable[[web.Request, dict], Awaitable[web.StreamResponse]]


def dialect_for(path: str) -> Dialect:
    return "anthropic" if path.startswith("/v1/messages") else "openai"


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
    except ApiError as e:
        status = e.status
        log.info("%s %s -> %d: %s", request.method, request.path, e.status, e.message)
        return error_response(e, dialect_for(request.path), {"x-request-id": rid})
    except web.HTTPException as e:
        status = e.status
        raise
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        err = ApiError(
            500, "internal error while serving the request; see the server log", code="internal"
        )
        return error_response(err, dialect_for(request.path), {"x-request-id": rid})
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
        body = parse_json_object(await read_body(request, settings.max_body_bytes))
        model = body.get("model")
        engine = request.app[ENGINE]
        if isinstance(model, str) and model and not engine.has_model(model):
            return await unknown_model(request, body, model)
        return await route(request, body)

    return handler


async def unknown_model(request: web.Request, body: dict, model: str) -> web.StreamResponse:
    engine = request.app[ENGINE]
    local = ", ".join(engine.model_ids) or "none"
    raise ApiError(
        404,
        f"model {model!r} not found: not served locally (local models: {local})",
        param="model",
        code="model_not_found",
    )


async def health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    return web.json_response(
        {
            "status": "ok",
            "models": engine.model_ids,
            "loaded": [m for m in engine.model_ids if engine.loaded(m) is not None],
        }
    )


async def list_models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    data = [
        {"id": m, "object": "model", "created": 0, "owned_by": "mlx-prompt-cache"}
        for m in engine.model_ids
    ]
    return web.json_response({"object": "list", "data": data})


async def cache_stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[ENGINE].stats())


async def not_found(request: web.Request) -> web.Response:
    raise ApiError(404, f"no route for {request.method} {request.path}", code="not_found")


def create_app(engine: Engine, settings: ProxySettings) -> web.Application:
    app = web.Application(middlewares=[request_context], client_max_size=settings.max_body_bytes)
    app[ENGINE] = engine
    app[SETTINGS] = settings

    async def lifecycle(app: web.Application):
        yield
        await engine.close()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/cache/stats", cache_stats)
    app.router.add_post("/v1/chat/completions", json_route(openai_api.chat_completions))
    app.router.add_post("/v1/completions", json_route(openai_api.completions))
    app.router.add_post("/v1/messages", json_route(anthropic_api.messages))
    app.router.add_post("/v1/messages/count_tokens", json_route(anthropic_api.count_tokens))
    app.router.add_route("*", "/{tail:.*}", not_found)
    return app
