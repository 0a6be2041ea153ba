"""Sessions and clearing: GET /v1/cache/sessions, DELETE /v1/cache/sessions/{id}, its
/pin and /unpin, and DELETE /v1/cache (OpenAI error shape, like every /v1/cache route).

With `[tenants] api_keys`, a caller sees and changes only its own tenant's sessions: an id
of another tenant is a 404, as if it did not exist. Without keys the server is one user's,
and `?tenant=` only narrows what is shown or cleared.
"""

from __future__ import annotations

from dataclasses import asdict

from aiohttp import web

from ..errors import ApiError
from ..generation import request_options
from ..state import ENGINE, SETTINGS

SESSION_PATH = "/v1/cache/sessions"


def caller_tenant(request: web.Request) -> str | None:
    """Whose sessions this request may see: its own tenant when API keys are on, else any
    (narrowed by `?tenant=`)."""
    wanted = request.query.get("tenant")
    if request.app[SETTINGS].tenant_api_keys:
        tenant, _ = request_options(request)
        if wanted is not None and wanted != tenant:
            raise ApiError(
                403,
                f"tenant: this API key's tenant is {tenant!r}; it may not see or change "
                f"tenant {wanted!r}",
                param="tenant",
                code="tenant_not_allowed",
            )
        return tenant
    return wanted or None


def _session_id(request: web.Request) -> str:
    sid = request.match_info["id"]
    if not sid:
        raise ApiError(400, "id: the session id is empty", param="id")
    return sid


async def list_sessions(request: web.Request) -> web.Response:
    views = await request.app[ENGINE].list_sessions(caller_tenant(request))
    return web.json_response({"sessions": [asdict(v) for v in views]})


async def delete_session(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    done = await engine.delete_session(_session_id(request), caller_tenant(request))
    return web.json_response({"id": done.id, "deleted": True, "freed_bytes": done.freed_bytes})


async def pin_session(request: web.Request) -> web.Response:
    sid = _session_id(request)
    pinned = await request.app[ENGINE].pin_session(sid, caller_tenant(request), True)
    return web.json_response({"id": sid, "pinned": pinned})


async def unpin_session(request: web.Request) -> web.Response:
    sid = _session_id(request)
    pinned = await request.app[ENGINE].pin_session(sid, caller_tenant(request), False)
    return web.json_response({"id": sid, "pinned": pinned})


async def clear_cache(request: web.Request) -> web.Response:
    model = request.query.get("model")
    if model is not None and not model:
        raise ApiError(400, "model: empty; name a served model or leave it out", param="model")
    freed = await request.app[ENGINE].clear(model, caller_tenant(request))
    return web.json_response({"deleted_entries": freed.entries, "freed_bytes": freed.bytes})


def add_routes(app: web.Application) -> None:
    """Register before the passthrough catch-all. Ids may hold any character but '/'...
    and '/' too: the pattern takes the rest of the path."""
    app.router.add_get(SESSION_PATH, list_sessions)
    app.router.add_post(SESSION_PATH + "/{id:.+}/pin", pin_session)
    app.router.add_post(SESSION_PATH + "/{id:.+}/unpin", unpin_session)
    app.router.add_delete(SESSION_PATH + "/{id:.+}", delete_session)
    app.router.add_delete("/v1/cache", clear_cache)
