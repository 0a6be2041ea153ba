"""LM Studio's native REST shape (/api/v0) for the models served here; the rest passes through."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from engine_bridge.engine import Engine

from . import openai_api
from .fields import parse_json_object, read_body
from .passthrough import UPSTREAM_CONFIG, UPSTREAM_SESSION, forward, upstream_url
from .state import ENGINE, SETTINGS


async def _local_or_forward(request: web.Request, route) -> web.StreamResponse:
    raw = await read_body(request, request.app[SETTINGS].max_body_bytes)
    body = parse_json_object(raw)
    model = body.get("model")
    if isinstance(model, str) and request.app[ENGINE].has_model(model):
        return await route(request, body, lmstudio=True)
    return await forward(request, raw)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _local_or_forward(request, openai_api.chat_completions)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _local_or_forward(request, openai_api.completions)


def local_model_entry(engine: Engine, model_id: str) -> dict[str, Any]:
    info = engine.model_info(model_id)
    entry: dict[str, Any] = {
        "id": model_id,
        "object": "model",
        # LM Studio's own word for a model that takes images.
        "type": "vlm" if info.vision else "llm",
        "publisher": model_id.split("/")[0] if "/" in model_id else "mlx-prompt-cache",
        "compatibility_type": "mlx",
        "state": "loaded" if info.loaded else "not-loaded",
        "owned_by": "mlx-prompt-cache",
    }
    if info.loaded:
        entry["arch"] = info.arch or "unknown"
    if info.context_length is not None:
        entry["max_context_length"] = info.context_length
    return entry


async def models(request: web.Request) -> web.Response:
    """Local models in LM Studio's shape, then the upstream's own /api/v0/models entries."""
    engine = request.app[ENGINE]
    data = [local_model_entry(engine, m) for m in engine.model_ids]
    seen = {d["id"] for d in data}
    config = request.app[UPSTREAM_CONFIG]
    if config.enabled:
        try:
            async with request.app[UPSTREAM_SESSION].get(upstream_url(config, request)) as r:
                if r.status == 200:
                    upstream = orjson.loads(await r.read()).get("data", [])
                    data += [d for d in upstream if isinstance(d, dict) and d.get("id") not in seen]
        except Exception:  # an unreachable upstream leaves just the local list
            pass
    return web.json_response({"object": "list", "data": data})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/api/v0/chat/completions", chat_completions)
    app.router.add_post("/api/v0/completions", completions)
    app.router.add_get("/api/v0/models", models)
