"""Probe and warm: what a request would get from each tier, and prefilling it ahead of time.

Both take the request the chat routes build, rendered exactly as a generation renders it
(the engine's job), so the numbers are the ones the real request sees. A probe only hashes
and looks up (`ModelCache.probe`: no promotion, no pin, nothing reordered in the LRU); a
warm-up runs the request through the scheduler as `prefill_only`, so it prefills and saves
like any other. Neither knows the engine: it hands them what they use (`Cached`).

The tiers below RAM are asked as a request's read-ahead asks them (cache/tier_reads.py):
on their I/O threads, each under its deadline, before the MLX thread looks up RAM and what
they answered (`Survey`). A probe reads index rows and presence only, never an entry.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from .cache.hashing import Chain
from .cache.ssd.index import Scope
from .cache.tier_reads import LiveBelow
from .types import EngineError, GenerationRequest, ProbeResult, WarmResult

if TYPE_CHECKING:
    from .cache.shared.tier import SharedTier
    from .cache.ssd.store import SSDStore
    from .cache.tiers import TieredCache
    from .prompt_cache import ModelCache
    from .scheduling.jobs import Job
    from .stream import GenerationStream

OnMlx = Callable[..., Awaitable[Any]]


class Cached(Protocol):
    """The engine calls a warm-up makes (engine.py's Engine is one)."""

    async def start(self, req: GenerationRequest) -> GenerationStream: ...

    async def probe(self, req: GenerationRequest) -> ProbeResult: ...

    async def load(self, model_id: str) -> Any: ...

    def has_cache(self, model_id: str) -> bool: ...


async def probe(
    req: GenerationRequest, job: Job, cache: ModelCache | None, on_mlx: OnMlx
) -> ProbeResult:
    """What `job` (`req` rendered) would restore from each tier; `cache` is its model's
    prompt cache, None when it has none or `req` bypasses it."""
    n = len(job.prompt.tokens)
    if cache is None:
        return ProbeResult(req.model, n, 0, 0, 0, n, None)
    session = cache.session(job)  # the prompt hashed once, here, as a request's is
    below = await survey(cache.tiers, session.chain, session.scope, cache.needs_checkpoint)
    hit, local = await on_mlx(cache.probe, job, below, session)
    ram = hit.ram_length
    return ProbeResult(
        req.model, n, ram, local - ram, hit.length - local, n - hit.length, hit.diverged_at
    )


class Survey:
    """The tiers below RAM as a probe's lookup sees them (a `Below`, tier_reads.py): asked
    in phases on their I/O threads, each phase's answers kept, then answered from memory
    on the MLX thread. What no phase was asked, or a late one did not answer, is a miss."""

    def __init__(self, has_ssd: bool, has_shared: bool, live: LiveBelow | None = None) -> None:
        self.has_ssd, self.has_shared = has_ssd, has_shared
        self._live = live  # a phase's: the tiers it asks itself (the others from memory)
        self.blocks: set[bytes] = set()  # on the SSD
        self.checkpoints: set[tuple[int, bytes]] = set()  # (position, key) on the SSD
        self.stored: set[bytes] = set()  # blocks in the shared store
        self.stored_at: set[int] = set()  # positions of the chain's checkpoints there
        self.late: list[str] = []  # tiers whose phase missed its deadline

    def merge(self, part: Survey) -> None:
        self.blocks |= part.blocks
        self.checkpoints |= part.checkpoints
        self.stored |= part.stored
        self.stored_at |= part.stored_at

    def _asks(self, tier: str) -> bool:
        live = self._live
        return live is not None and (live.has_ssd if tier == "ssd" else live.has_shared)

    def blocks_present(self, scope: Scope, keys: Sequence[bytes]) -> list[bool]:
        if not self._asks("ssd"):
            return [k in self.blocks for k in keys]
        found = self._live.blocks_present(scope, keys)
        self.blocks.update(k for k, here in zip(keys, found, strict=True) if here)
        return found

    def checkpoints_between(self, scope: Scope, lo: int, hi: int) -> list[tuple[int, bytes]]:
        if not self._asks("ssd"):
            return sorted((r for r in self.checkpoints if lo < r[0] <= hi), reverse=True)
        rows = self._live.checkpoints_between(scope, lo, hi)
        self.checkpoints.update(rows)
        return rows

    def shared_blocks(self, scope: Scope, hashes: Sequence[bytes], in_ram: list[bool]) -> int:
        if not self._asks("shared"):
            n = 0
            while n < len(hashes) and (in_ram[n] or hashes[n] in self.stored):
                n += 1
            return n
        n = self._live.shared_blocks(scope, hashes, in_ram)
        self.stored.update(h for h, here in zip(hashes[:n], in_ram[:n], strict=True) if not here)
        return n

    def shared_checkpoint(self, chain: Chain, scope: Scope, lo: int, hi: int) -> int | None:
        if not self._asks("shared"):
            return max((p for p in self.stored_at if lo < p <= hi), default=None)
        found = self._live.shared_checkpoint(chain, scope, lo, hi)
        if found is not None:
            self.stored_at.add(found)
        return found

    def fetch_shared(self, scope, kind, keys, reserve, release) -> dict:
        return {}  # a probe reads no entry

    def read(self, scope, kind, key, reserve, release, fetched=None) -> None:
        return None


async def survey(tiers: TieredCache, chain: Chain, scope: Scope, snapshots: bool) -> Survey:
    """What `chain`'s lookup asks below RAM, asked as a request's read-ahead asks it: the
    SSD's index on its I/O threads, then the shared store (and the SSD again, unless its
    phase was late or failed) on the store's, each phase under its tier's deadline; the
    phase runs the lookup itself (RAM answers on any thread)."""
    ssd, shared = tiers.ssd, tiers.shared
    below = Survey(ssd is not None, shared is not None)
    args = (tiers, below, chain, scope, snapshots)
    ssd_ok = ssd is not None and await _ask("ssd", *args, ssd, None)
    if shared is not None:
        await _ask("shared", *args, ssd if ssd_ok else None, shared)
    return below


async def _ask(
    tier: str, tiers: TieredCache, below: Survey, chain: Chain, scope: Scope, snapshots: bool,
    ssd: SSDStore | None, shared: SharedTier | None,
) -> bool:  # fmt: skip
    """One phase on `tier`'s pool, asking `ssd` and `shared` itself: True once its answers
    are in `below`."""
    deadline = tiers.reads.deadline(tier)
    part = Survey(below.has_ssd, below.has_shared, LiveBelow(ssd, shared, deadline))
    look = functools.partial(tiers.lookup, chain, scope, needs_checkpoint=snapshots, below=part)
    outcome = await tiers.reads.within(tier, deadline, look)
    if outcome == "done":
        below.merge(part)
    elif outcome == "late":
        below.late.append(tier)
    return outcome == "done"


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
    if not engine.has_cache(req.model):
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
