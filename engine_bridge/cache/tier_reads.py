"""A request's reads below RAM, done ahead on I/O threads: the MLX thread does no tier I/O.

A lookup used to ask the SSD's SQLite index, read its entry files and make Redis round
trips on the MLX thread, which steps every model: a store that accepts and never answers
stalled every stream for its timeout. Now, before a request is queued for that thread:

- `TierReads.prefetch` runs an SSD phase (plan against RAM and the SSD's index, read that
  run's files) and then a shared phase (what RAM and the SSD lack, from the store), each
  on its own tier's thread pool, while the request waits in its coroutine: threads stuck
  on a hung disk never keep another request's store phase waiting for a thread.
- A phase has a deadline its thread renews with each operation it starts (an index query,
  an entry, a round trip, with time for the bytes it is about to read): `SSD_STALL_S` for
  the SSD, the configured timeout for the shared store. A phase past it is left behind:
  that tier is a miss for this request only (`Prefetched.late`, counted in `ReadStats`),
  and its thread stops at its next operation and drops what it read.
- Entries are validated exactly as a promotion validates them (the stores' checksums, a
  corrupt file quarantined and a shallower plan read), and a phase's `Prefetched` reaches
  the request only once its thread is done with it: nothing half-filled crosses.
- On the MLX thread a `Prefetched` stands in for the tiers below RAM (`Below`, what
  `TieredCache` plans and promotes through): the lookup plans against RAM as it is by then
  and what was read, and promotion reserves RAM and makes arrays from bytes already read.
- Bytes read ahead and not yet promoted are bounded, all requests together, by the RAM
  tier's budget; a read past it is refused as a full RAM tier refuses one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from engine_bridge.cache.hashing import BlockHash, Chain
from engine_bridge.cache.kinds import EntryKind
from engine_bridge.cache.ram.manager import CacheManager
from engine_bridge.cache.ssd.index import Scope
from engine_bridge.cache.ssd.store import SSDEntry, SSDStore

if TYPE_CHECKING:
    from engine_bridge.cache.shared.tier import SharedTier

log = logging.getLogger(__name__)

# How long an SSD phase may go without finishing an index query or an entry file: far
# above a healthy disk's milliseconds, short of what a client waits for a first token.
SSD_STALL_S = 2.0
# The slowest read rate a phase is granted on top of its stall bound, per byte it reserves:
# a long hit over a slow link is not cut short for its size.
_MIN_RATE = 32 << 20
_WORKERS = 4  # threads per tier: requests reading ahead at once before they queue
# Corrupt entries met during one promotion (or read-ahead) before it settles for what it has.
PROMOTION_TRIES = 4
FEATURES = EntryKind.FEATURES  # an image's encoder output, which a request may read ahead
Reserve = Callable[[int], bool]
Release = Callable[[int], None]
# TieredCache._plan(chain, scope, snapshots, ram_length, reach, below): what to read.
Plan = Callable[..., "SSDReadPlan | None"]


@dataclass(slots=True, frozen=True)
class SSDReadPlan:
    """What the SSD adds: read `blocks` (chain indices, in order), then the checkpoint at
    `checkpoint` if set, to resume at `length`."""

    length: int
    blocks: tuple[int, ...]
    checkpoint: int | None


class Below(Protocol):
    """The tiers under RAM as one lookup and its promotion see them (tiers.py)."""

    has_ssd: bool  # answers for this machine's SSD
    has_shared: bool  # answers for the shared store

    def blocks_present(self, scope: Scope, keys: Sequence[bytes]) -> list[bool]: ...
    def checkpoints_between(self, scope: Scope, lo: int, hi: int) -> list[tuple[int, bytes]]: ...
    def shared_blocks(self, scope: Scope, hashes: Sequence[bytes], in_ram: list[bool]) -> int: ...
    def shared_checkpoint(self, chain: Chain, scope: Scope, lo: int, hi: int) -> int | None: ...
    def fetch_shared(
        self, scope: Scope, kind: EntryKind, keys: list[BlockHash], reserve: Reserve,
        release: Release,
    ) -> dict[bytes, SSDEntry]: ...  # fmt: skip
    def read(
        self, scope: Scope, kind: EntryKind, key: BlockHash, reserve: Reserve, release: Release,
        fetched: dict[bytes, SSDEntry] | None = None,
    ) -> tuple[SSDEntry, bool] | None:  # fmt: skip
        """One entry and whether it came from the shared store; None is a miss.
        `fetched`: what the shared store already gave for this run (not asked again)."""
        ...


class Late(Exception):
    """Raised in a phase its request has left behind: it reads nothing more."""


class Deadline:
    """When a phase counts as late: `stall_s` after its latest operation began, plus time
    for the bytes that operation reserved. Renewed by the phase's thread, read by the
    request waiting for it (a float written whole: no lock)."""

    __slots__ = ("abandoned", "at", "stall_s")

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        self.at = time.monotonic() + stall_s
        self.abandoned = False

    def beat(self) -> None:
        if self.abandoned:
            raise Late
        self.at = time.monotonic() + self.stall_s

    def expect(self, nbytes: int) -> None:
        self.at += nbytes / _MIN_RATE


class LiveBelow:
    """The SSD and the shared store as they are: every answer is I/O. A phase's reads and
    a probe's questions (with its deadline), or a lookup off the MLX thread (without)."""

    def __init__(
        self, ssd: SSDStore | None, shared: SharedTier | None, deadline: Deadline | None = None
    ) -> None:
        self._ssd, self._shared, self._deadline = ssd, shared, deadline
        self.has_ssd, self.has_shared = ssd is not None, shared is not None

    def _beat(self) -> None:
        if self._deadline is not None:
            self._deadline.beat()

    def blocks_present(self, scope: Scope, keys: Sequence[bytes]) -> list[bool]:
        self._beat()
        return self._ssd.contains_many(scope, EntryKind.BLOCK, keys)

    def checkpoints_between(self, scope: Scope, lo: int, hi: int) -> list[tuple[int, bytes]]:
        self._beat()
        return self._ssd.checkpoints_between(scope, lo, hi)

    def shared_blocks(self, scope: Scope, hashes: Sequence[bytes], in_ram: list[bool]) -> int:
        return self._shared.present_blocks(scope, hashes, in_ram, beat=self._beat)

    def shared_checkpoint(self, chain: Chain, scope: Scope, lo: int, hi: int) -> int | None:
        return self._shared.deepest_checkpoint(chain, scope, lo, hi, beat=self._beat)

    def fetch_shared(self, scope, kind, keys, reserve, release) -> dict[bytes, SSDEntry]:
        self._beat()
        return self._shared.fetch(scope, kind, keys, reserve, release, local=self.has_ssd)

    def read(self, scope, kind, key, reserve, release, fetched=None):
        entry, shared = (fetched or {}).get(key), True
        if entry is None and self._ssd is not None:
            self._beat()
            entry, shared = self._ssd.get(scope, kind, key, reserve=reserve, release=release), False
        if entry is None and fetched is None and self._shared is not None:
            self._beat()
            got = self._shared.fetch(scope, kind, [key], reserve, release, local=self.has_ssd)
            entry, shared = got.get(key), True
        return None if entry is None else (entry, shared)


class _Budget:
    """Bytes read ahead and not promoted yet, all requests together, under a limit."""

    def __init__(self, limit: Callable[[], int]) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self.held = 0
        self.refusals = 0

    def take(self, nbytes: int) -> bool:
        with self._lock:
            if self.held + nbytes > self._limit():
                self.refusals += 1
                return False
            self.held += nbytes
            return True

    def give(self, nbytes: int) -> None:
        with self._lock:
            assert 0 <= nbytes <= self.held, f"giving back {nbytes} of {self.held} bytes"
            self.held -= nbytes


class Prefetched:
    """What one request read ahead below RAM: validated host bytes by key. Filled by one
    phase's thread; then, on the MLX thread, the tiers below RAM for its lookup (`Below`),
    with no I/O. `close` gives its bytes back to the budget."""

    has_ssd, has_shared = True, False

    def __init__(self, budget: _Budget, deadline: Deadline | None = None) -> None:
        self._budget = budget
        self.deadline = deadline
        self._entries: dict[tuple[EntryKind, bytes], tuple[SSDEntry, bool]] = {}
        self._checkpoints: dict[int, bytes] = {}  # position -> key of those read
        self.nbytes = 0  # taken from the budget
        self.late: list[str] = []  # tiers whose phase missed its deadline: "ssd", "shared"
        # How far a phase's plan reached (set on its thread before it reads), and of the
        # late phases, the deepest: what a late tier would have given, as far as it got.
        self.reach = self.late_reach = 0
        self.on_disk: set[bytes] = set()  # keys RAM evicted that the SSD holds (`lost`)

    @property
    def count(self) -> int:
        return len(self._entries)

    # ---- filled by a phase (its thread) ------------------------------------------------

    def reserve(self, nbytes: int) -> bool:
        if not self._budget.take(nbytes):
            return False
        self.nbytes += nbytes
        if self.deadline is not None:
            self.deadline.expect(nbytes)
        return True

    def release(self, nbytes: int) -> None:
        self._budget.give(nbytes)
        self.nbytes -= nbytes

    def has(self, kind: EntryKind, key: bytes) -> bool:
        return (kind, key) in self._entries

    def take(self, kind: EntryKind, key: bytes) -> tuple[SSDEntry, bool] | None:
        """An entry read ahead that no lookup promotes (an image's features), handed over."""
        return self._entries.pop((kind, key), None)

    def add(self, kind: EntryKind, key: bytes, got: tuple[SSDEntry, bool], at: int = 0) -> None:
        self._entries[kind, key] = got
        if kind is EntryKind.CHECKPOINT:
            self._checkpoints[at] = key

    def merge(self, part: Prefetched) -> None:
        """Take over a finished phase's entries and the bytes they hold."""
        self._entries.update(part._entries)
        self._checkpoints.update(part._checkpoints)
        self.on_disk |= part.on_disk
        self.nbytes, part.nbytes = self.nbytes + part.nbytes, 0
        part._entries.clear()

    def close(self) -> None:
        self._entries.clear()
        self._checkpoints.clear()
        nbytes, self.nbytes = self.nbytes, 0
        if nbytes:
            self._budget.give(nbytes)

    # ---- the tiers below RAM, for the lookup on the MLX thread --------------------------

    def blocks_present(self, scope: Scope, keys: Sequence[bytes]) -> list[bool]:
        return [(EntryKind.BLOCK, k) in self._entries for k in keys]

    def checkpoints_between(self, scope: Scope, lo: int, hi: int) -> list[tuple[int, bytes]]:
        return sorted(((p, k) for p, k in self._checkpoints.items() if lo < p <= hi), reverse=True)

    def shared_blocks(self, scope, hashes, in_ram) -> int:
        return 0  # what the store gave is in `_entries`, answered as local

    def shared_checkpoint(self, chain, scope, lo, hi) -> int | None:
        return None

    def fetch_shared(self, scope, kind, keys, reserve, release) -> dict[bytes, SSDEntry]:
        return {}

    def read(self, scope, kind, key, reserve, release, fetched=None):
        got = self._entries.pop((kind, key), None)
        if got is None or not reserve(sum(t.nbytes for t in got[0].tensors.values())):
            return None
        return got


@dataclass(slots=True, frozen=True)
class ReadStats:
    """What /v1/cache/stats shows under "reads": lookups' reads below RAM, done ahead."""

    prefetches: int  # requests that read ahead
    entries_read: int  # entries read ahead
    bytes_read: int
    held_bytes: int  # read ahead and not promoted (or dropped) yet, all requests
    late_ssd: int  # SSD phases past their deadline: a miss on the SSD for that request
    late_shared: int  # the same for the shared store
    budget_refusals: int  # reads refused: what is held ahead reached the RAM tier's budget
    errors: int  # phases that failed (logged): a miss on that tier


class TierReads:
    """The I/O threads that read below RAM ahead of admission, for one TieredCache."""

    def __init__(
        self, ram: CacheManager, ssd: SSDStore | None, shared: SharedTier | None, plan: Plan,
        *, ssd_stall_s: float = SSD_STALL_S,
    ) -> None:  # fmt: skip
        self.ram, self.ssd, self.shared = ram, ssd, shared
        self._plan = plan  # the lookup's own planning, through the phase's Below
        self.ssd_stall_s = ssd_stall_s
        self.shared_stall_s = shared.store.config.timeout_s if shared is not None else 0.0
        self._budget = _Budget(lambda: ram.budget_bytes)
        pool = concurrent.futures.ThreadPoolExecutor
        self._pools = {
            "ssd": pool(_WORKERS, "tier-ssd") if ssd is not None else None,
            "shared": pool(_WORKERS, "tier-shared") if shared is not None else None,
        }
        self._lock = threading.Lock()
        self._n = dict.fromkeys(("prefetches", "entries", "bytes", "ssd", "shared", "errors"), 0)

    async def prefetch(
        self, chain: Chain, scope: Scope, snapshots: bool, starts: Sequence[int] = (),
        features: Sequence[bytes] = (),
    ) -> Prefetched | None:  # fmt: skip
        """Read what `chain`'s lookup needs below RAM; None with no tier below RAM.
        `starts`: the checkpoint positions whose loss `TieredCache.lost` may explain.
        `features`: digests of the request's images whose features it may need, read in
        the same phases (`Prefetched.take` hands them over)."""
        if self.ssd is None and self.shared is None:
            return None
        pre = Prefetched(self._budget)
        args = (chain, scope, snapshots)
        try:
            ssd_ok = self.ssd is not None
            if ssd_ok:
                ssd_ok = await self._phase("ssd", pre, self._local, *args, starts, features)
            if self.shared is not None:
                await self._phase("shared", pre, self._remote, *args, ssd_ok, features)
        except BaseException:
            pre.close()
            raise
        with self._lock:
            self._n["prefetches"] += 1
            self._n["entries"] += pre.count
            self._n["bytes"] += pre.nbytes
        return pre

    def deadline(self, tier: str) -> Deadline:
        """A fresh deadline for a phase on `tier` ("ssd" or "shared")."""
        return Deadline(self.ssd_stall_s if tier == "ssd" else self.shared_stall_s)

    async def within(
        self, tier: str, deadline: Deadline, fn: Callable[..., object], *args,
        drop: Callable[[], object] = lambda: None,
    ) -> str:  # fmt: skip
        """Run `fn(*args)` on `tier`'s pool while the request waits here, until `deadline`
        (which `fn` renews): "done"; "late" (counted; its thread stops at its next
        operation, and `drop()` runs once it is done); or "failed" (logged)."""
        future = self._pools[tier].submit(fn, *args)
        waiting = asyncio.wrap_future(future)
        try:
            while not waiting.done() and deadline.at > time.monotonic():
                await asyncio.wait((waiting,), timeout=deadline.at - time.monotonic())
        finally:
            if not waiting.done():  # late, or the request went away
                deadline.abandoned = True
                waiting.cancel()  # a phase still queued never runs
                future.add_done_callback(lambda _: drop())
        if waiting.cancelled():
            self._late(tier, deadline)
            return "late"
        if waiting.exception() is not None:
            log.error("reading ahead from the %s failed", tier, exc_info=waiting.exception())
            self._count("errors")
            return "failed"
        return "done"

    async def _phase(self, tier: str, pre: Prefetched, fn: Callable[..., None], *args) -> bool:
        """Run `fn(part, pre, *args)` on `tier`'s pool and merge its part into `pre`; False
        once it is late (then its part closes itself when its thread is done) or failed."""
        part = Prefetched(self._budget, self.deadline(tier))
        outcome = await self.within(tier, part.deadline, fn, part, pre, *args, drop=part.close)
        if outcome == "done":
            pre.merge(part)
            return True
        if outcome == "late":
            pre.late.append(tier)
            pre.late_reach = max(pre.late_reach, part.reach)
        else:
            part.close()
        return False

    def _late(self, tier: str, deadline: Deadline) -> None:
        with self._lock:
            self._n[tier] += 1
            n = self._n[tier]
        # The first and every 100th: an outage makes every request late.
        log.log(
            logging.WARNING if n == 1 or n % 100 == 0 else logging.DEBUG,
            "reading ahead from the %s took over %.1fs: that request goes on without it "
            "(%d such so far)",
            "SSD" if tier == "ssd" else "shared store", deadline.stall_s, n,
        )  # fmt: skip

    def _count(self, name: str) -> None:
        with self._lock:
            self._n[name] += 1

    def _local(self, part: Prefetched, pre: Prefetched, chain, scope, snapshots, starts, features):
        """The SSD phase: RAM and the SSD's index planned, that run's files read, then the
        `features`; and which entries RAM evicted lately are on disk (`lost` asks)."""
        below = LiveBelow(self.ssd, None, part.deadline)
        self._gather(chain, scope, snapshots, below, part, None)
        for key in features:
            if got := below.read(scope, FEATURES, key, part.reserve, part.release):
                part.add(FEATURES, key, got)
        evicted = self.ram.evicted.cause
        checkpoints = [chain.checkpoint_key(p) for p in starts if 0 < p <= len(chain)]
        for kind, keys in (
            (EntryKind.BLOCK, [h for h in chain.hashes if evicted(h)]),
            (EntryKind.CHECKPOINT, [k for k in checkpoints if evicted(k)]),
        ):
            if keys:
                part.deadline.beat()
                on = self.ssd.contains_many(scope, kind, keys)
                part.on_disk.update(k for k, here in zip(keys, on, strict=True) if here)

    def _remote(self, part: Prefetched, pre: Prefetched, chain, scope, snapshots, ssd_ok, features):
        """The shared phase: what RAM and the SSD lack, from the store; entries of the SSD
        that its phase did not need, from the SSD, unless that phase was late."""
        below = LiveBelow(self.ssd if ssd_ok else None, self.shared, part.deadline)
        self._gather(chain, scope, snapshots, below, part, pre)
        if keys := [k for k in dict.fromkeys(features) if not pre.has(FEATURES, k)]:
            got = below.fetch_shared(scope, FEATURES, keys, part.reserve, part.release)
            for key, entry in got.items():
                part.add(FEATURES, key, (entry, True))

    def _gather(
        self,
        chain: Chain,
        scope: Scope,
        snapshots: bool,
        below: Below,
        into: Prefetched,
        have: Prefetched | None,
    ) -> None:
        """Read into `into`, not RAM, what promotion would read through `below`, but what
        `have` holds. A corrupt entry is met as promotion (tiers.py `_read_into_ram`) meets
        it: the store quarantines it and a shallower plan is read. The codec checks the
        bytes when promotion makes them a payload, on the MLX thread."""

        def held(kind: EntryKind, key: bytes) -> bool:
            return into.has(kind, key) or (have is not None and have.has(kind, key))

        ram_length = self.ram.match(chain, needs_checkpoint=snapshots).length
        bs, reach, block = chain.block_size, len(chain) - 1, EntryKind.BLOCK
        if ram_length >= reach:
            return  # RAM leaves the tiers below nothing to add (as the lookup finds)
        for _ in range(PROMOTION_TRIES):
            plan = self._plan(chain, scope, snapshots, ram_length, reach, below)
            if plan is None:
                return
            into.reach = max(into.reach, plan.length)
            keys = [chain.hashes[i] for i in plan.blocks if not held(block, chain.hashes[i])]
            fetched = {}
            if below.has_shared and keys:
                fetched = below.fetch_shared(scope, block, keys, into.reserve, into.release)
            failed_at = None
            for i in plan.blocks:
                key = chain.hashes[i]
                if held(block, key):
                    continue
                got = below.read(scope, block, key, into.reserve, into.release, fetched)
                if got is None:
                    failed_at = i
                    break
                into.add(block, key, got)
            if failed_at is not None:
                if not snapshots:
                    return  # the blocks before it serve a paged model
                reach = failed_at * bs + bs - 1  # a checkpoint no deeper than that block
                continue
            if plan.checkpoint is None:
                return
            key = chain.checkpoint_key(plan.checkpoint)
            if held(EntryKind.CHECKPOINT, key):
                return
            got = below.read(scope, EntryKind.CHECKPOINT, key, into.reserve, into.release)
            if got is not None:
                into.add(EntryKind.CHECKPOINT, key, got, plan.checkpoint)
                return
            if not snapshots:
                return  # the blocks alone serve
            reach = plan.checkpoint - 1

    def stats(self) -> ReadStats:
        with self._lock:
            n = dict(self._n)
        b = self._budget
        return ReadStats(
            n["prefetches"], n["entries"], n["bytes"], b.held, n["ssd"], n["shared"],
            b.refusals, n["errors"],
        )  # fmt: skip

    def close(self) -> None:
        for pool in self._pools.values():
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
