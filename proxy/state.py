"""Typed application state shared by the route handlers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiohttp import web

from .config.model_settings import ModelSettingsTable

if TYPE_CHECKING:  # the engine loads MLX: the front of a split model (ranks/) never does
    from engine_bridge.engine import Engine

# Set on every request by the request-id middleware.
REQUEST_ID = web.RequestKey("request_id", str)


@dataclass(frozen=True, slots=True)
class AlertRules:
    """[alerts], read: what raises an alert (engine_bridge/ops/alerts.py), how often the
    diagnosis is read for it, and where notices go besides the log."""

    webhook: str | None = None
    window_s: float = 900.0
    interval_s: float = 10.0
    hit_ratio: float = 0.5
    cause_share: float = 0.3
    min_tokens: int = 4096
    repeat_s: float = 900.0


@dataclass(slots=True)
class ProxySettings:
    max_body_bytes: int = 32 << 20
    cache_enabled: bool = True
    tenant_header: str = "x-tenant"
    tenant_api_keys: dict[str, str] = field(default_factory=dict)
    default_tenant: str = "local"
    # [model."<pattern>"]: defaults for what a request leaves unset (proxy/generation.py).
    model_settings: ModelSettingsTable = field(default_factory=ModelSettingsTable)
    # Seconds a stream may stay silent before the dialect sends its keepalive beat; 0: never.
    stream_keepalive_s: float = 10.0
    # [alerts]: when a diagnosis raises an alert, and where it goes (cache_api/alerts.py).
    alerts: AlertRules = field(default_factory=AlertRules)


ENGINE: web.AppKey[Engine] = web.AppKey("engine")
SETTINGS = web.AppKey("settings", ProxySettings)
