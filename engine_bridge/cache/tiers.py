"""The tiers as one cache: RAM over SSD, looked up together, promoted a run at a time.

A request's chain is hashed once (`hashing.Chain`) and every step here works on its hashes.
`lookup` says how far RAM reaches and how far RAM plus SSD reach (SGLang's `MatchResult`
with its `host_hit_length`), and only reads: the probe route asks it too, and a request's
own writes before it (`catch_up`) run apart. RAM is matched once per lookup; promotion and
pinning reuse that match. `promote` brings the SSD part into RAM, reserving the budget
before it reads and falling back to a shallower checkpoint when an entry turns out corrupt.
The tiers below RAM are asked through a `Below` (tier_reads.py): for a request, the bytes
read for it on I/O threads before it was queued, for the probe what its phases asked there
(cache_probe.Survey), so lookups and promotion on the MLX thread do no I/O; off it, the
SSD and the store themselves (`live`).
What is stored goes to SSD as `[cache.ssd] write_policy` says, and what RAM evicts spills
there (tier_writes.py). Under the SSD, an optional shared store (Redis/Valkey, several
machines) is asked for what RAM and the SSD lack, and written by its own policy
(shared/tier.py). Payloads cross to host bytes through a `Codec`, which `kv`
implements, so this package never imports mlx.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine_bridge.cache.checkpoint_writes import DeferredWrites
from engine_bridge.cache.hashing import BlockHash, Chain
from engine_bridge.cache.kinds import CheckpointReason, EntryKind
from engine_bridge.cache.ram.manager import CacheManager, CacheStats
from engine_bridge.cache.ram.matching import Match
from engine_bridge.cache.ssd.index import Scope
from engine_bridge.cache.ssd.store import SSDStats, SSDStore
from engine_bridge.cache.tier_reads import (
    PROMOTION_TRIES,
    Below,
    LiveBelow,
    ReadStats,
    SSDReadPlan,
    TierReads,
)
from engine_bridge.cache.tier_writes import META_REASON, Codec, Stored, TierWrites, WriteStats
from engine_bridge.cache.write_policy import WritePolicy

if TYPE_CHECKING:
    from engine_bridge.cache.shared.store import SharedStats
    from engine_bridge.cache.shared.tier import SharedTier

__all__ = ["Codec", "Hit", "SSDReadPlan", "Stored", "TierStats", "TieredCache"]

log = logging.getLogger(__name__)
BLOCK = EntryKind.BLOCK

# Block presence is asked of the SSD index this many hashes at a time, then twice as many:
# a cold prompt costs one small query, a long hit a handful.
_PRESENCE_STEP = 64
# Entries the SSD lost are put again this many per request at most (on the MLX thread,
# since turning a payload into host bytes evaluates it), so no request stalls for long.
_REWRITE_STEP = 32


@dataclass(slots=True)
class Hit:
    """Where a request can resume, tier by tier. Nothing is pinned or read yet."""

    chain: Chain
    scope: Scope
    needs_checkpoint: bool
    ram: Match  # what RAM restores as it stands
    # The paged longest common prefix with RAM (`ram` itself for a paged model), from the
    # same walk: where a divergence is, and what promotion pins while it inserts.
    prefix: Match
    ssd: SSDReadPlan | None  # how the SSD extends it, when it does
    # Where the prompt left a sequence RAM holds part way (not merely ran past its end).
    diverged_at: int | None
    from_shared: bool = False  # promotion read entries from the shared store
    below: Below | None = None  # what was asked below RAM (promotion reads through it)

    @property
    def ram_length(self) -> int:
        return self.ram.length

    @property
    def length(self) -> int:
        """How far RAM plus SSD reach."""
        return self.ssd.length if self.ssd is not None else self.ram.length


@dataclass(slots=True, frozen=True)
class TierStats:
    ram: CacheStats
    ssd: SSDStats | None
    shared: SharedStats | None = None
    writes: WriteStats | None = None  # None without an SSD
    reads: ReadStats | None = None  # None without an SSD or a shared store


class TieredCache:
    """RAM, then SSD when there is one; shared by every model and tenant of the process."""

    def __init__(
        self,
        ram: CacheManager,
        ssd: SSDStore | None,
        codec: Codec,
        *,
        write_through: bool = True,
        policy: WritePolicy | None = None,
        checkpoint_delay_s: float = 0.0,
        periodic_write_every: int | None = None,
        shared: SharedTier | None = None,
    ) -> None:
        self.ram = ram
        self.ssd = ssd
        self.codec = codec
        # When the SSD is written (write_policy.py); `write_through` is the older switch.
        policy = policy or (WritePolicy.THROUGH if write_through else WritePolicy.EVICT)
        self.writes = TierWrites(ram, ssd, codec, policy, checkpoint_delay_s, periodic_write_every)
        # The Redis/Valkey tier under the SSD ([cache.shared]); it writes by its own policy.
        self.shared = shared
        if shared is not None:
            shared.bind(self.writes.host_bytes, ssd)
        # Below RAM as it is (lookups off the MLX thread), and the I/O threads a request
        # (and a probe) reads ahead on before it is queued (tier_reads.py).
        self.live = LiveBelow(ssd, shared)
        self.reads = TierReads(ram, ssd, shared, self._plan)

    @property
    def policy(self) -> WritePolicy:
        return self.writes.policy

    @property
    def deferred(self) -> DeferredWrites:
        """Checkpoint writes held back for a deeper one (checkpoint_writes.py)."""
        return self.writes.deferred

    @property
    def call_on_mlx(self) -> Callable[[Callable[[], object]], object] | None:
        return self.writes.call_on_mlx

    @call_on_mlx.setter
    def call_on_mlx(self, call: Callable[[Callable[[], object]], object] | None) -> None:
        """How held-back writes that come due between requests reach the MLX thread (the
        engine's scheduler.call)."""
        self.writes.call_on_mlx = call

    # ---- lookup -------------------------------------------------------------------------

    def catch_up(self, scope: Scope, *, needs_checkpoint: bool) -> None:
        """The writes a request makes just before its lookup, on the MLX thread (turning
        payloads into host bytes evaluates them): a snapshot model's scope is noted (its
        blocks then wait for their checkpoints), a few entries the SSD lost are put again,
        and held-back checkpoint writes that came due go out. The probe never calls it."""
        self.writes.catch_up(scope, snapshots=needs_checkpoint, rewrites=_REWRITE_STEP)

    def lookup(
        self, chain: Chain, scope: Scope, *, needs_checkpoint: bool, below: Below | None = None
    ) -> Hit:
        """One look through every tier; reads index rows, never entry files, and writes
        nothing (no put, no flush, no LRU refresh): a probe may call it freely. `below`:
        what a request read ahead (then no I/O here), else the tiers themselves."""
        below = self.live if below is None else below
        ram, prefix = self.ram.matches(chain, needs_checkpoint=needs_checkpoint)
        last = len(chain) - 1
        diverged = prefix.length if prefix.diverged and 0 < prefix.length < last else None
        ssd = None
        # RAM reaching the last prompt token leaves the SSD nothing to add.
        if (below.has_ssd or below.has_shared) and ram.length < last:
            ssd = self._plan(chain, scope, needs_checkpoint, ram.length, last, below)
        return Hit(chain, scope, needs_checkpoint, ram, prefix, ssd, diverged, below=below)

    def local_length(self, hit: Hit) -> int:
        """How far RAM and this machine's SSD reach without the shared store: where a
        probe's SSD tokens end and its shared ones begin."""
        if self.shared is None or hit.ssd is None:
            return hit.length
        chain, scope, last = hit.chain, hit.scope, len(hit.chain) - 1
        snapshots, below = hit.needs_checkpoint, self._below(hit)
        plan = self._plan(chain, scope, snapshots, hit.ram_length, last, below, shared=False)
        return plan.length if plan is not None else hit.ram_length

    def _plan(
        self,
        chain: Chain,
        scope: Scope,
        snapshots: bool,
        ram_length: int,
        reach: int,
        below: Below,
        shared: bool = True,
    ) -> SSDReadPlan | None:
        """The deepest position up to `reach` that RAM and SSD (and the shared store, unless
        `shared` is False) restore together, past RAM's."""
        bs = chain.block_size
        last = len(chain) - 1  # always leave one token to prefill
        # Count full blocks of this chain only: a paged hit that ends mid-block may end in a
        # sibling's block, which is not on the request's chain.
        usable = self._present_blocks(chain, scope, ram_length // bs, below, shared)
        reach = min(reach, last, usable * bs + bs - 1)  # a checkpoint can sit mid-block
        if snapshots:
            checkpoint = self._find_checkpoint(chain, scope, ram_length, reach, below, shared)
            if checkpoint is None:
                return None
            target = checkpoint
        else:
            # Paged layers restore from blocks alone; a checkpoint only adds its partial tail.
            base = min(usable * bs, reach)
            lo = max(ram_length, base)
            checkpoint = self._find_checkpoint(chain, scope, lo, reach, below, shared)
            target = checkpoint if checkpoint is not None else base
        if target <= ram_length:
            return None
        needed = target // bs if checkpoint is not None else -(-target // bs)
        in_ram = self.ram.has_blocks(chain.hashes[:needed])
        missing = tuple(i for i, present in enumerate(in_ram) if not present)
        return SSDReadPlan(target, missing, checkpoint)

    def _present_blocks(
        self, chain: Chain, scope: Scope, start: int, below: Below, shared: bool = True
    ) -> int:
        """How many leading blocks of the chain are in RAM or on disk; [0, start) are in RAM.

        Both count: a hot prefix stays in RAM and is never spilled (so it is not on disk
        without write-through), while the tail behind it was evicted and spilled.
        """
        i, step, gap = start, _PRESENCE_STEP, not below.has_ssd
        while not gap and i < len(chain.hashes):
            keys = chain.hashes[i : i + step]
            on_disk = below.blocks_present(scope, keys)
            in_ram = self.ram.has_blocks(keys)
            for disk, ram in zip(on_disk, in_ram, strict=True):
                if not (disk or ram):
                    gap = True
                    break
                i += 1
            step *= 2
        if shared and below.has_shared and i < len(chain.hashes):
            rest = chain.hashes[i:]  # what RAM and the SSD lack: the shared store
            i += below.shared_blocks(scope, rest, self.ram.has_blocks(rest))
        return i

    def _find_checkpoint(
        self, chain: Chain, scope: Scope, lo: int, hi: int, below: Below, shared: bool = True
    ) -> int | None:
        """The deepest position in (lo, hi] with a checkpoint below RAM for this chain."""
        found = self._find_on_ssd(chain, scope, lo, hi, below) if below.has_ssd else None
        if shared and below.has_shared:
            deeper = below.shared_checkpoint(chain, scope, found or lo, hi)
            found = deeper if deeper is not None else found
        return found

    def _find_on_ssd(
        self, chain: Chain, scope: Scope, lo: int, hi: int, below: Below
    ) -> int | None:
        """The deepest checkpoint of `chain` on disk in (lo, hi]. The index is asked once
        for the checkpoints it holds in that range (any chain's: few, next to the
        distance), not about every position a checkpoint could sit at."""
        keys: dict[int, bytes] = {}  # this chain's key at each position the index names
        for position, key in below.checkpoints_between(scope, lo, hi):
            if position not in keys:
                keys[position] = chain.checkpoint_key(position)
            if key == keys[position]:
                return position
        return None

    def lost(
        self,
        chain: Chain,
        scope: Scope,
        block: int,
        checkpoints: Sequence[int] = (),
        on_disk: Collection[bytes] | None = None,
    ) -> str | None:
        """Why the entries after a hit are gone when a tier dropped them lately: block
        `block` of `chain` and checkpoints at `checkpoints`. "expired" (the SSD's TTL),
        "evicted_ssd", "evicted_ram", or None (never cached, as far as the records go).
        `on_disk`: which keys RAM evicted the SSD held, as read ahead (else the index)."""
        keys = [(EntryKind.BLOCK, chain.hashes[block])] if block < len(chain.hashes) else []
        keys += [(EntryKind.CHECKPOINT, chain.checkpoint_key(p)) for p in checkpoints]
        for kind, key in keys:
            cause = self.ssd.evicted.cause(key) if self.ssd is not None else None
            if cause is not None:
                return "expired" if cause == "expired" else "evicted_ssd"
            cause = self.ram.evicted.cause(key)
            if cause is not None:
                if self.ssd is not None and (
                    key in on_disk
                    if on_disk is not None
                    else self.ssd.contains_many(scope, kind, [key])[0]
                ):
                    continue  # spilled: still on disk, so not what cut this hit short
                return "expired" if cause == "expired" else "evicted_ram"
        return None

    def note_expired(self, keys: Sequence[BlockHash]) -> None:
        """Entries an idle session's expiry ([cache] session_ttl) drops from both tiers:
        recorded, so the session's next request names its miss "expired"."""
        self.ram.evicted.add(keys, "expired")
        if self.ssd is not None:
            self.ssd.evicted.add(keys, "expired")

    def pin(self, hit: Hit, *, promoted: bool) -> Match:
        """The match to restore from, pinned: the lookup's own when nothing was promoted
        and its entries are all still in RAM (`acquire` checks), else a fresh one, which
        reaches into what promotion brought up (RAM changed: the one second match). A
        miss (length 0) is not pinned. If the writes a reuse makes raise, it lets go of
        the pin before the error leaves: RAM never evicts a pinned entry."""
        if not promoted and hit.ram.length == 0 and hit.ssd is None:
            match = hit.ram  # a miss nothing tried to promote into: RAM is as looked up
        elif not promoted and hit.ram.length and self.ram.acquire(hit.ram):
            match = hit.ram
        else:
            match = self.ram.match(hit.chain, needs_checkpoint=hit.needs_checkpoint, pin=True)
        try:
            self.writes.reused(hit.chain, match)
            if self.shared is not None:
                self.shared.reused(hit.chain, match)
            self.writes.resumed(hit.chain, match.length)
        except BaseException:
            if match.pinned:
                self.ram.release(match)
            raise
        return match

    # ---- promotion ----------------------------------------------------------------------

    def promote(self, hit: Hit) -> bool:
        """Bring what `hit` needs from SSD into RAM; True if RAM now reaches deeper.

        A corrupt entry on disk is quarantined and read as a miss: then fall back to the
        next shallower plan rather than to nothing.
        """
        plan = hit.ssd
        if plan is None:
            return False
        chain, ram_length = hit.chain, hit.ram_length
        # Pin what RAM holds of the path: under a tight budget it is the least recently used
        # part, and inserting the promoted entries would evict the very prefix they extend.
        # The lookup's own prefix match, unless one of its entries left RAM since (acquire
        # checks each is still the one RAM holds): then match again, once.
        held = hit.prefix
        if held.length and not self.ram.acquire(held):
            held = self.ram.match(chain, needs_checkpoint=False, pin=True)
        try:
            for _ in range(PROMOTION_TRIES):
                outcome = self._read_into_ram(hit, plan)
                if isinstance(outcome, bool):
                    return outcome
                snapshots, below = hit.needs_checkpoint, self._below(hit)
                plan = self._plan(chain, hit.scope, snapshots, ram_length, outcome, below)
                if plan is None:
                    return False
            return False
        finally:
            if held.pinned:
                self.ram.release(held)

    def _below(self, hit: Hit) -> Below:
        return self.live if hit.below is None else hit.below

    def _read_into_ram(self, hit: Hit, plan: SSDReadPlan) -> bool | int:
        """Promote `plan`; True/False when done, or a lower reach to plan again with."""
        chain, scope, bs = hit.chain, hit.scope, hit.chain.block_size
        below = self._below(hit)
        reserved: list[int] = []
        read: dict[int, Stored] = {}
        failed_at = None
        try:
            # The blocks of the run the SSD lacks, from the store in one round trip.
            keys, fetched = [chain.hashes[i] for i in plan.blocks], {}
            if below.has_shared and keys:
                fetched = below.fetch_shared(scope, BLOCK, keys, *self._reservation(reserved))
            for i, key in zip(plan.blocks, keys, strict=True):
                stored = self._read(below, scope, BLOCK, key, reserved, fetched)
                if stored is None:
                    failed_at = i
                    break
                read[i] = stored[0]
        finally:
            # Hand the reservation back just before inserting, so its bytes are not counted
            # twice; the run goes in as one insert.
            self.ram.unreserve(sum(reserved))
        if read:
            hit.from_shared |= any(s.on_shared for s in read.values())
            self.ram.insert_blocks(chain, read)
        if failed_at is not None:
            # Blocks [0, failed_at) are in RAM now: a paged model uses them as they are, a
            # snapshot model needs a checkpoint no deeper than block failed_at.
            if hit.needs_checkpoint:
                return failed_at * bs + bs - 1
            return failed_at * bs > hit.ram_length
        if plan.checkpoint is None:
            return True
        reserved.clear()
        key = chain.checkpoint_key(plan.checkpoint)
        try:
            stored = self._read(below, scope, EntryKind.CHECKPOINT, key, reserved)
        finally:
            self.ram.unreserve(sum(reserved))
        if stored is None:
            if hit.needs_checkpoint:
                return plan.checkpoint - 1
            return plan.checkpoint // bs * bs > hit.ram_length  # the blocks alone serve
        hit.from_shared |= stored[0].on_shared
        self.ram.insert_checkpoint(chain, plan.checkpoint, stored[0], stored[1])
        return True

    def _read(
        self,
        below: Below,
        scope: Scope,
        kind: EntryKind,
        key: BlockHash,
        reserved: list[int],
        fetched: dict[bytes, Any] | None = None,
    ) -> tuple[Stored, CheckpointReason] | None:
        """Read one entry under a RAM reservation (kept in `reserved`) and make it a
        payload; None is a miss. `fetched`: what the store gave for this run already."""
        got = below.read(scope, kind, key, *self._reservation(reserved), fetched)
        if got is None:
            return None
        entry, shared = got
        try:
            payload = self.codec.from_host(entry.tensors, entry.meta)
            reason = (
                CheckpointReason(entry.meta[META_REASON]) if kind is EntryKind.CHECKPOINT else None
            )
        except (ValueError, KeyError) as e:
            log.warning("cache entry %s is unreadable as a payload: %s", key.hex()[:16], e)
            return None
        return Stored(payload, scope, on_ssd=not shared, on_shared=shared), reason

    def _reservation(
        self, reserved: list[int]
    ) -> tuple[Callable[[int], bool], Callable[[int], None]]:
        """reserve/release callbacks that keep what they hold in `reserved`."""

        def reserve(n: int) -> bool:
            ok = self.ram.reserve(n)
            if ok:
                reserved.append(n)
            return ok

        def release(n: int) -> None:
            self.ram.unreserve(n)
            reserved.remove(n)

        return reserve, release

    # ---- storing ------------------------------------------------------------------------

    def store_blocks(self, chain: Chain, scope: Scope, payloads: Mapping[int, Any]) -> None:
        """Insert full blocks of `chain` by index into RAM, and write them when their policy
        says (tier_writes.py)."""
        self.writes.store_blocks(chain, scope, payloads)
        if self.shared is not None:
            blocks = self.ram.blocks([chain.hashes[i] for i in payloads])
            stored = {i: b.payload for i, b in zip(payloads, blocks, strict=True) if b}
            self.shared.stored_blocks(chain, stored)

    def store_checkpoint(
        self, chain: Chain, scope: Scope, position: int, payload: Any, reason: CheckpointReason,
        supersedes: bool = True,
    ) -> None:  # fmt: skip
        """Insert the state after `position` tokens of `chain`, and write it when its policy
        says (tier_writes.py)."""
        self.writes.store_checkpoint(chain, scope, position, payload, reason, supersedes)
        if self.shared is not None:
            kept = self.ram.entry(EntryKind.CHECKPOINT, chain.checkpoint_key(position))
            mine = kept is not None and kept.payload.payload is payload
            self.shared.stored_checkpoint(chain, kept if mine else None, reason)

    # ---- upkeep -------------------------------------------------------------------------

    def stats(self) -> TierStats:
        return TierStats(
            self.ram.stats(),
            self.ssd.stats() if self.ssd is not None else None,
            self.shared.stats() if self.shared is not None else None,
            self.writes.stats() if self.ssd is not None else None,
            self.reads.stats() if self.ssd is not None or self.shared is not None else None,
        )

    def close(self, timeout_s: float) -> None:
        """Write what is held back and drain the SSD's queue, for at most `timeout_s`;
        queued shared-store writes get a third of that first."""
        self.reads.close()
        if self.shared is not None:
            self.shared.close(timeout_s / 3)
        self.writes.close(timeout_s)
