"""Probe and warm: what a request would get from each tier, and prefilling it ahead of time.

Both take the request the chat routes build, and render it exactly as a generation would
(`Engine.prepare`), so the numbers are the ones the real request sees. A probe only hashes
and looks up (no promotion, no pin, nothing reordered in the LRU); a warm-up runs the
request through the scheduler as `prefill_only`, so it prefills and saves like any other.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from .cache.tiers import Hit
from .types import EngineError, GenerationRequest

if TYPE_CHECKING:
    from .engine import Engine
    from .prompt_cache import ModelCache
    from .scheduling.jobs import Job


@dataclass(frozen=True, slots=True)
class ProbeResult:
    model: str
    prompt_tokens: int
    ram_tokens: int  # restored from RAM
    ssd_tokens: int  # read from this machine's SSD, past what RAM has
    shared_tokens: int  # read from the shared store ([cache.shared]), past RAM and SSD
    recompute_tokens: int  # prefilled by the model (always at least one)
    diverged_at: int | None  # where the prompt leaves a sequence RAM holds


@dataclass(frozen=True, slots=True)
class WarmResult:
    model: str
    prompt_tokens: int
    cached_tokens: int  # already cached before the warm-up
    stored_tokens: int  # newly prefilled and now cached
    elapsed_s: float


async def probe(engine: Engine, req: GenerationRequest) -> ProbeResult:
    _, job = await engine.prepare(req)
    n = len(job.prompt.tokens)
    cache = engine.model_cache(req.model) if req.use_cache else None
    if cache is None:
        return ProbeResult(req.model, n, 0, 0, 0, n, None)
    hit, local = await engine.scheduler.run(_lookup, cache, job)
    ram = hit.ram_length
    return ProbeResult(
        req.model, n, ram, local - ram, hit.length - local, n - hit.length, hit.diverged_at
    )


def _lookup(cache: ModelCache, job: Job) -> tuple[Hit, int]:
    # On the MLX thread, like a request's own lookup: it may write back entries the SSD lost.
    session = cache.session(job)
    tiers = cache.tiers
    hit = tiers.lookup(session.chain, session.scope, needs_checkpoint=cache.needs_checkpoint)
    return hit, tiers.local_length(hit)


async def warm(engine: Engine, req: GenerationRequest) -> WarmResult:
    if not req.use_cache:
        why = (
            "the prompt cache is off"
            if not engine.settings.cache_enabled
            else ("the request bypasses the cache (x-prompt-cache: bypass)")
        )
        raise EngineError(f"nothing to warm: {why}", status=409)
    start = time.perf_counter()
    # max_tokens stays the body's: it is checked as the chat route checks it.
    req = replace(req, prefill_only=True)
    stream = await engine.start(req)
    async for _ in stream:
        pass
    if engine.model_cache(req.model) is None:
        raise EngineError(f"model {req.model!r} has no prompt cache to warm", status=409)
    # What the cache reaches now, looked up again: stored means stored, not just prefilled.
    after = await probe(engine, replace(req, prefill_only=False))
    reach = after.ram_tokens + after.ssd_tokens + after.shared_tokens
    return WarmResult(
        req.model,
        stream.prompt_tokens,
        stream.cached_tokens,
        max(0, reach - stream.cached_tokens),
        round(time.perf_counter() - start, 4),
    )
