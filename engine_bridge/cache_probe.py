"""Probe and warm: what a request would get from each tier, and prefilling it ahead of time.

Both take the request the chat routes build, rendered exactly as a generation renders it
(the engine's job), so the numbers are the ones the real request sees. A probe only hashes
and looks up (`ModelCache.probe`: no promotion, no pin, nothing reordered in the LRU); a
warm-up runs the request through the scheduler as `prefill_only`, so it prefills and saves
like any other. Neither knows the engine: it hands them what they use (`Cached`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from .types import EngineError, GenerationRequest, ProbeResult, WarmResult

if TYPE_CHECKING:
    from .prompt_cache import ModelCache
    from .scheduling.jobs import Job
    from .stream import GenerationStream

OnMlx = Callable[..., Awaitable[Any]]


class Cached(Protocol):
    """The engine calls a warm-up makes (engine.py's Engine is one)."""

    async def start(self, req: GenerationRequest) -> GenerationStream: ...

    async def probe(self, req: GenerationRequest) -> ProbeResult: ...

    async def load(self, model_id: str) -> Any: ...

    def model_cache(self, model_id: str) -> ModelCache | None: ...


async def probe(
    req: GenerationRequest, job: Job, cache: ModelCache | None, on_mlx: OnMlx
) -> ProbeResult:
    """What `job` (`req` rendered) would restore from each tier; `cache` is its model's
    prompt cache, None when it has none or `req` bypasses it."""
    n = len(job.prompt.tokens)
    if cache is None:
        return ProbeResult(req.model, n, 0, 0, 0, n, None)
    hit, local = await on_mlx(cache.probe, job)
    ram = hit.ram_length
    return ProbeResult(
        req.model, n, ram, local - ram, hit.length - local, n - hit.length, hit.diverged_at
    )


async def warm(engine: Cached, req: GenerationRequest, cache_enabled: bool) -> WarmResult:
    if not req.use_cache:
        why = (
            "the prompt cache is off"
            if not cache_enabled
            else ("the request bypasses the cache (x-prompt-cache: bypass)")
        )
        raise EngineError(f"nothing to warm: {why}", status=409)
    start = time.perf_counter()
    # Loaded first, so a model with no prompt cache is refused before any prefill runs.
    await engine.load(req.model)
    if engine.model_cache(req.model) is None:
        raise EngineError(f"model {req.model!r} has no prompt cache to warm", status=409)
    # max_tokens stays the body's: it is checked as the chat route checks it.
    req = replace(req, prefill_only=True)
    stream = await engine.start(req)
    async for _ in stream:
        pass
    # What the cache reaches now, looked up again: stored means stored, not just prefilled.
    after = await engine.probe(replace(req, prefill_only=False))
    reach = after.ram_tokens + after.ssd_tokens + after.shared_tokens
    return WarmResult(
        req.model,
        stream.prompt_tokens,
        stream.cached_tokens,
        max(0, reach - stream.cached_tokens),
        round(time.perf_counter() - start, 4),
    )
