"""Typed application state shared by the route handlers."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web

from engine_bridge.engine import Engine

# Key in the per-request dict, set by the request-id middleware.
REQUEST_ID = "request_id"


@dataclass(slots=True)
class ProxySettings:
    max_body_bytes: int = 32 << 20
    cache_enabled: bool = True
    tenant_header: str = "x-tenant"
    tenant_api_keys: dict[str, str] = field(default_factory=dict)
    default_tenant: str = "local"


ENGINE = web.AppKey("engine", Engine)
SETTINGS = web.AppKey("settings", ProxySettings)
