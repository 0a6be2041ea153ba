"""The upstream's model list, fetched and cached for ~2 s so routing a request stays cheap,
and merged with the local models into one OpenAI list."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from proxy.config.model import UpstreamConfig
from proxy.upstream.client import UPSTREAM_CONFIG, UPSTREAM_SESSION, fault_reason
from proxy.upstream.headers import with_token

MODELS_TTL_S = 2.0
MODELS_TIMEOUT_S = 3.0
LOCAL_OWNER = "mlx-prompt-cache"
UPSTREAM_OWNER = "lmstudio"


@dataclass(slots=True)
class UpstreamModels:
    """What ``GET {upstream}/v1/models`` said; ``reachable`` is False when nothing answered."""

    reachable: bool
    ids: list[str] = field(default_factory=list)
    error: str | None = None
    raw: list[dict[str, Any]] = field(default_factory=list)

    @property
    def listed(self) -> bool:
        """Whether the upstream answered with a model list (so ``ids`` is what it has)."""
        return self.reachable and self.error is None


@dataclass(slots=True)
class ModelsCache:
    # One answer, replaced every MODELS_TTL_S: bounded by construction (by what the
    # upstream lists), so not in /v1/cache/stats' `proxy` section. The lock makes
    # concurrent /v1/models and chat routing share one upstream fetch.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    value: UpstreamModels | None = None
    fetched_at: float = 0.0


MODELS_CACHE = web.AppKey("upstream_models_cache", ModelsCache)


async def upstream_models(app: web.Application) -> UpstreamModels:
    """The upstream's model list, cached for ~2 s so routing a chat request stays cheap.

    A failure is cached too: a stopped LM Studio costs one connection attempt per TTL.
    """
    config = app[UPSTREAM_CONFIG]
    cache = app[MODELS_CACHE]
    if not config.enabled:
        return UpstreamModels(reachable=False, error="upstream passthrough is off")
    async with cache.lock:
        now = time.monotonic()
        if cache.value is not None and now - cache.fetched_at < MODELS_TTL_S:
            return cache.value
        cache.value = await _fetch_models(app[UPSTREAM_SESSION], config)
        cache.fetched_at = time.monotonic()
        return cache.value


async def _fetch_models(session: aiohttp.ClientSession, config: UpstreamConfig) -> UpstreamModels:
    url = config.url.rstrip("/") + "/v1/models"
    timeout = aiohttp.ClientTimeout(total=MODELS_TIMEOUT_S, sock_connect=config.connect_timeout_s)
    try:
        headers = with_token(CIMultiDict({"Accept": "application/json"}), config)
        async with session.get(url, timeout=timeout, headers=headers) as resp:
            status = resp.status
            try:
                raw = await resp.read()
            except (aiohttp.ClientError, TimeoutError) as exc:
                # It answered, so it is up: only its list is broken (mlx_lm.server sends
                # 200 and then fails when the Hugging Face cache folder is missing).
                error = f"GET {url} answered HTTP {status}, then failed: {fault_reason(exc)}"
                return UpstreamModels(reachable=True, error=error)
    except (aiohttp.ClientError, TimeoutError) as exc:
        return UpstreamModels(reachable=False, error=fault_reason(exc))
    if status != 200:
        return UpstreamModels(reachable=True, error=f"GET {url} answered HTTP {status}")
    try:
        data = json.loads(raw)
        entries = [e for e in data["data"] if isinstance(e, dict) and isinstance(e.get("id"), str)]
    except (ValueError, KeyError, TypeError) as exc:
        return UpstreamModels(reachable=True, error=f"GET {url} returned no model list: {exc}")
    return UpstreamModels(reachable=True, ids=[e["id"] for e in entries], raw=entries)


def merge_model_lists(
    local: list[dict[str, Any]], upstream: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """One OpenAI model list: local models first, then the upstream's, one entry per id."""
    merged: list[dict[str, Any]] = []
    seen: set[str] = set()
    for entries, owner in ((local, LOCAL_OWNER), (upstream, UPSTREAM_OWNER)):
        for entry in entries:
            model_id = entry.get("id")
            if not isinstance(model_id, str) or model_id in seen:
                continue
            seen.add(model_id)
            out = {**entry, "object": "model"}
            if owner == LOCAL_OWNER or not out.get("owned_by"):
                out["owned_by"] = owner
            merged.append(out)
    return merged
