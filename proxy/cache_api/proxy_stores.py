"""The proxy's own stores, the `proxy` section of /v1/cache/stats and its /metrics series.

Only the Responses store grows with what clients send; the proxy's other memories are
bounded by construction, each says why where it is kept (the upstream's model list: one
answer, `upstream.model_list.ModelsCache`; tenant labels: `metrics.TenantLabels`' cap).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from aiohttp import web

from ..dialects.responses import STORE


def proxy_stats(app: web.Application) -> dict[str, Any]:
    """Each store's entries, bytes, bound and evictions, by store."""
    out: dict[str, Any] = {}
    if (store := app.get(STORE)) is not None:
        out["responses"] = asdict(store.stats())
    return out
