"""LM Studio's native REST shape (/api/v0) for the models served here; the rest passes through."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict

from ..fields import parse_json_object, read_body
from ..generation import shown_settings
from ..state import ENGINE, SETTINGS
from ..upstream.client import UPSTREAM_CONFIG, UPSTREAM_SESSION, fault_reason, upstream_url
from ..upstream.headers import with_token
from ..upstream.model_list import MODELS_TIMEOUT_S
from ..upstream.passthrough import forward
from .openai import chat as chat_api
from .openai import completions as completions_api

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Listing:
    # The upstream failure warned about last: clients poll the model list, so the same
    # failure again is a debug line, and a new one (or the first after a success) a warning.
    warned: str | None = None


_LISTING = web.AppKey("lmstudio_listing", _Listing)


async def _local_or_forward(request: web.Request, route) -> web.StreamResponse:
    raw = await read_body(request, request.app[SETTINGS].max_body_bytes)
    body = parse_json_object(raw)
    model = body.get("model")
    if isinstance(model, str) and request.app[ENGINE].has_model(model):
        return await route(request, body, lmstudio=True)
    return await forward(request, raw)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _local_or_forward(request, chat_api.chat_completions)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _local_or_forward(request, completions_api.completions)


def local_model_entry(app: web.Application, model_id: str) -> dict[str, Any]:
    info = app[ENGINE].model_info(model_id)
    entry: dict[str, Any] = {
        "id": model_id,
        "object": "model",
        # LM Studio's own word for a model that takes images.
        "type": "vlm" if info.vision else "llm",
        "publisher": model_id.split("/")[0] if "/" in model_id else "mlx-prompt-cache",
        "compatibility_type": "mlx",
        "state": "loaded" if info.loaded else "not-loaded",
        "owned_by": "mlx-prompt-cache",
        # Not in LM Studio's own entries: what a request that sets none gets (as /v1/models).
        "settings": shown_settings(app, model_id),
    }
    if info.loaded:
        entry["arch"] = info.arch or "unknown"
    if info.context_length is not None:
        entry["max_context_length"] = info.context_length
    return entry


async def models(request: web.Request) -> web.Response:
    """Local models in LM Studio's shape, then the upstream's own /api/v0/models entries."""
    engine = request.app[ENGINE]
    data = [local_model_entry(request.app, m) for m in engine.model_ids]
    seen = {d["id"] for d in data}
    if request.app[UPSTREAM_CONFIG].enabled:
        upstream = await _upstream_entries(request)
        data += [d for d in upstream if d.get("id") not in seen]
    return web.json_response({"object": "list", "data": data})


async def _upstream_entries(request: web.Request) -> list[dict[str, Any]]:
    """The upstream's own /api/v0/models entries; none, and a warning, when it cannot say."""
    config = request.app[UPSTREAM_CONFIG]
    url = upstream_url(config, request)
    timeout = aiohttp.ClientTimeout(total=MODELS_TIMEOUT_S, sock_connect=config.connect_timeout_s)
    try:
        headers = with_token(CIMultiDict(), config)
        async with request.app[UPSTREAM_SESSION].get(url, timeout=timeout, headers=headers) as r:
            status, raw = r.status, await r.read()
    except (aiohttp.ClientError, TimeoutError) as e:
        return _not_listed(request.app, f"GET {url} failed: {fault_reason(e)}")
    if status != 200:
        return _not_listed(request.app, f"GET {url} answered HTTP {status}")
    try:
        listed = [d for d in orjson.loads(raw)["data"] if isinstance(d, dict)]
    except (orjson.JSONDecodeError, KeyError, TypeError) as e:
        return _not_listed(request.app, f"GET {url} returned no model list: {e!r}")
    request.app[_LISTING].warned = None
    return listed


def _not_listed(app: web.Application, why: str) -> list[dict[str, Any]]:
    listing = app[_LISTING]
    level = logging.DEBUG if listing.warned == why else logging.WARNING
    listing.warned = why
    log.log(level, "/api/v0/models lists the local models only: %s", why)
    return []


def add_routes(app: web.Application) -> None:
    app[_LISTING] = _Listing()
    app.router.add_post("/api/v0/chat/completions", chat_completions)
    app.router.add_post("/api/v0/completions", completions)
    app.router.add_get("/api/v0/models", models)
