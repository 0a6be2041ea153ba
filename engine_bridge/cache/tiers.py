"""The tiers as one cache: RAM over SSD, looked up together, promoted a run at a time.

A request's chain is hashed once (`hashing.Chain`) and every step here works on its hashes.
`lookup` says how far RAM reaches and how far RAM plus SSD reach (SGLang's `MatchResult`
with its `host_hit_length`); `promote` brings the SSD part into RAM, reserving the budget
before it reads and falling back to a shallower checkpoint when an entry turns out corrupt.
Stores write through to SSD, and entries RAM evicts spill there. When the SSD loses what
it held (its folder deleted while serving, or writes failing for a while), what RAM still
holds is written again. Payloads cross to host bytes through a `Codec`, which `kv`
implements, so this package never imports mlx.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from engine_bridge.cache.checkpoint_writes import DeferredWrites, has_snapshots, skip_if_superseded
from engine_bridge.cache.checkpoints import Checkpoint
from engine_bridge.cache.hashing import BlockHash, Chain
from engine_bridge.cache.index import Scope
from engine_bridge.cache.kinds import EntryKind, Reason
from engine_bridge.cache.manager import CacheManager, CacheStats, Entry
from engine_bridge.cache.matching import Match
from engine_bridge.cache.ssd import PutOutcome, PutReason, SSDStats, SSDStore
from engine_bridge.cache.tensors import HostTensor
from engine_bridge.cache.write_policy import SPARSE_PERIODIC_EVERY, WritePolicy

log = logging.getLogger(__name__)

# Entry metadata the tiers add to the codec's own.
_META_REASON = "cache.reason"
_META_TOKENS = "cache.tokens"
# Corrupt entries met during one promotion before it settles for what it has.
_PROMOTION_TRIES = 4
# Block presence is asked of the SSD index this many hashes at a time, then twice as many:
# a cold prompt costs one small query, a long hit a handful.
_PRESENCE_STEP = 64
# Entries the SSD lost are put again this many per request at most (on the MLX thread,
# since turning a payload into host bytes evaluates it), so no request stalls for long.
_REWRITE_STEP = 32
# Periodic checkpoint writes and resume points remembered for `_periodic_due`.
_PERIODIC_MEMO = 1024


class Codec(Protocol):
    """Payloads ⇄ host tensors plus string metadata, for the tiers below RAM."""

    def to_host(self, payload: Any) -> tuple[dict[str, HostTensor], dict[str, str]]: ...

    def from_host(self, tensors: Mapping[str, HostTensor], meta: Mapping[str, str]) -> Any:
        """The payload; raises ValueError for anything it cannot read as one."""
        ...


@dataclass(slots=True)
class Stored:
    """What RAM holds for an entry: the codec's payload and the scope of its SSD copy."""

    payload: Any
    scope: Scope
    on_ssd: bool = False  # on disk, or on its way there
    used: bool = False  # a later request restored from it (second-use writes it then)

    @property
    def nbytes(self) -> int:
        return self.payload.nbytes


@dataclass(slots=True, frozen=True)
class SSDPlan:
    """What the SSD adds: read `blocks` (chain indices, in order), then the checkpoint at
    `checkpoint` if set, to resume at `length`."""

    length: int
    blocks: tuple[int, ...]
    checkpoint: int | None


@dataclass(slots=True)
class Hit:
    """Where a request can resume, tier by tier. Nothing is pinned or read yet."""

    chain: Chain
    scope: Scope
    needs_checkpoint: bool
    ram: Match  # what RAM restores as it stands
    ssd: SSDPlan | None  # how the SSD extends it, when it does
    # Where the prompt left a sequence RAM holds part way (not merely ran past its end).
    diverged_at: int | None

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
    ) -> None:
        self.ram = ram
        self.ssd = ssd
        self.codec = codec
        # When the SSD is written (write_policy.py); `write_through` is the older switch.
        self.policy = policy or (WritePolicy.THROUGH if write_through else WritePolicy.EVICT)
        self.write_through = self.policy is WritePolicy.THROUGH
        # Write-through checkpoints wait this long for a deeper one to supersede them,
        # except a periodic one every `periodic_write_every` tokens (checkpoint_writes.py).
        self.deferred = DeferredWrites(checkpoint_delay_s)
        self.periodic_write_every = periodic_write_every
        # Scopes of snapshot models (a lookup needed a checkpoint, or one with snapshot
        # state was stored): their blocks are written with the checkpoints that need them.
        self._snapshot_scopes: set[Scope] = set()
        # Keys of the periodic checkpoints written lately (the index has them only once the
        # writer is done, and RAM thins them as soon as a deeper one lands).
        self._periodic_written: OrderedDict[BlockHash, None] = OrderedDict()
        # Where each recent request's prefill resumed, by its chain (`pin`).
        self._resumed_at: OrderedDict[int, tuple[Chain, int]] = OrderedDict()
        # Runs a function on the MLX thread (the engine's scheduler.call): held-back writes
        # that came due while no request runs go out there, since turning their blocks
        # into host bytes evaluates arrays. Unset, they go out with the next request.
        self.call_on_mlx: Callable[[Callable[[], object]], object] | None = None
        self._flush_asked = threading.Event()
        # Entries RAM holds that the SSD lost, to put again (see `_ssd_lost`).
        self._rewrite: deque[tuple[EntryKind, BlockHash]] = deque()
        self._rewrite_lock = threading.Lock()
        if ssd is not None:
            ram.on_evict = self._spill
            ssd.on_lost = self._ssd_lost
            ssd.on_tick = self._tick

    # ---- lookup -------------------------------------------------------------------------

    def lookup(self, chain: Chain, scope: Scope, *, needs_checkpoint: bool) -> Hit:
        """One look through every tier; reads index rows, never entry files."""
        if needs_checkpoint:
            self._snapshot_scopes.add(scope)
        if self._rewrite:
            self._rewrite_some(_REWRITE_STEP)
        self.deferred.flush()
        ram = self.ram.match(chain, needs_checkpoint=needs_checkpoint)
        lcp = self.ram.match(chain, needs_checkpoint=False) if needs_checkpoint else ram
        diverged = lcp.length if lcp.diverged and 0 < lcp.length < len(chain) - 1 else None
        ssd = None
        # RAM reaching the last prompt token leaves the SSD nothing to add.
        if self.ssd is not None and ram.length < len(chain) - 1:
            ssd = self._plan(chain, scope, needs_checkpoint, ram.length, len(chain) - 1)
        return Hit(chain, scope, needs_checkpoint, ram, ssd, diverged)

    def _plan(
        self, chain: Chain, scope: Scope, snapshots: bool, ram_length: int, reach: int
    ) -> SSDPlan | None:
        """The deepest position up to `reach` that RAM and SSD restore together, past RAM's."""
        bs = chain.block_size
        last = len(chain) - 1  # always leave one token to prefill
        # Count full blocks of this chain only: a paged hit that ends mid-block may end in a
        # sibling's block, which is not on the request's chain.
        usable = self._present_blocks(chain, scope, ram_length // bs)
        reach = min(reach, last, usable * bs + bs - 1)  # a checkpoint can sit mid-block
        if snapshots:
            checkpoint = self._find_checkpoint(chain, scope, ram_length, reach)
            if checkpoint is None:
                return None
            target = checkpoint
        else:
            # Paged layers restore from blocks alone; a checkpoint only adds its partial tail.
            base = min(usable * bs, reach)
            checkpoint = self._find_checkpoint(chain, scope, max(ram_length, base), reach)
            target = checkpoint if checkpoint is not None else base
        if target <= ram_length:
            return None
        needed = target // bs if checkpoint is not None else -(-target // bs)
        in_ram = self.ram.has_blocks(chain.hashes[:needed])
        missing = tuple(i for i, present in enumerate(in_ram) if not present)
        return SSDPlan(target, missing, checkpoint)

    def _present_blocks(self, chain: Chain, scope: Scope, start: int) -> int:
        """How many leading blocks of the chain are in RAM or on disk; [0, start) are in RAM.

        Both count: a hot prefix stays in RAM and is never spilled (so it is not on disk
        without write-through), while the tail behind it was evicted and spilled.
        """
        assert self.ssd is not None
        i, step = start, _PRESENCE_STEP
        while i < len(chain.hashes):
            keys = chain.hashes[i : i + step]
            on_disk = self.ssd.contains_many(scope, EntryKind.BLOCK, keys)
            in_ram = self.ram.has_blocks(keys)
            for disk, ram in zip(on_disk, in_ram, strict=True):
                if not (disk or ram):
                    return i
                i += 1
            step *= 2
        return i

    def _find_checkpoint(self, chain: Chain, scope: Scope, lo: int, hi: int) -> int | None:
        """The deepest position in (lo, hi] with a checkpoint on disk for this chain."""
        assert self.ssd is not None
        bs = chain.block_size
        for a in range(hi // bs, -1, -1):
            start = a * bs
            if start + bs - 1 <= lo:
                break
            positions = [p for p in range(min(hi, start + bs - 1), max(lo, start - 1), -1) if p]
            if not positions:
                continue
            keys = [chain.checkpoint_key(p) for p in positions]
            found = self.ssd.contains_many(scope, EntryKind.CHECKPOINT, keys)
            for p, present in zip(positions, found, strict=True):
                if present:
                    return p
        return None

    def lost(
        self, chain: Chain, scope: Scope, block: int, checkpoints: Sequence[int] = ()
    ) -> str | None:
        """Why the entries after a hit are gone when a tier dropped them lately: block
        `block` of `chain` and checkpoints at `checkpoints`. "expired" (the SSD's TTL),
        "evicted_ssd", "evicted_ram", or None (never cached, as far as the records go)."""
        keys = [(EntryKind.BLOCK, chain.hashes[block])] if block < len(chain.hashes) else []
        keys += [(EntryKind.CHECKPOINT, chain.checkpoint_key(p)) for p in checkpoints]
        for kind, key in keys:
            cause = self.ssd.evicted.cause(key) if self.ssd is not None else None
            if cause is not None:
                return "expired" if cause == "expired" else "evicted_ssd"
            cause = self.ram.evicted.cause(key)
            if cause is not None:
                if self.ssd is not None and self.ssd.contains_many(scope, kind, [key])[0]:
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
        """The match to restore from, pinned: the lookup's own when nothing was promoted,
        else a fresh one that reaches into what promotion brought up."""
        if not promoted and hit.ram.length and self.ram.acquire(hit.ram):
            match = hit.ram
        else:
            match = self.ram.match(hit.chain, needs_checkpoint=hit.needs_checkpoint, pin=True)
        self._reused(hit.chain, match)
        self._resumed_at[id(hit.chain)] = (hit.chain, match.length)
        if len(self._resumed_at) > _PERIODIC_MEMO:
            self._resumed_at.popitem(last=False)
        return match

    def _reused(self, chain: Chain, match: Match) -> None:
        """A request restores from these entries: second-use writes them now, and so does
        write-through for a checkpoint it held back (a generation end, or one superseded
        before it was written and live again now; write_policy.py)."""
        entries: list[Entry] = [*match.blocks]
        if match.checkpoint is not None:
            entries.append(match.checkpoint)
        for entry in entries:
            stored = entry.payload
            stored.used = True
            if self.ssd is None or stored.on_ssd or self.policy is WritePolicy.EVICT:
                continue
            if self.ssd.room <= 0:
                break  # the rest goes when RAM evicts it, or on the next reuse
            if entry.kind is EntryKind.CHECKPOINT:
                if self.policy is WritePolicy.THROUGH and self._hold_back(entry):
                    # A checkpoint live again waits for a deeper one like a new one: a
                    # new user message resumes from the previous one's prompt end, and
                    # this turn's own checkpoints supersede it within seconds.
                    self._defer(chain, entry)
                else:
                    self._write_checkpoint(chain, entry, "write_through")
            elif self.policy is WritePolicy.SECOND_USE:
                self._put(entry, "write_through")

    # ---- promotion ----------------------------------------------------------------------

    def promote(self, hit: Hit) -> bool:
        """Bring what `hit` needs from SSD into RAM; True if RAM now reaches deeper.

        A corrupt entry on disk is quarantined and read as a miss: then fall back to the
        next shallower plan rather than to nothing.
        """
        plan = hit.ssd
        if plan is None or self.ssd is None:
            return False
        chain, ram_length = hit.chain, hit.ram_length
        # Pin what RAM holds of the path: under a tight budget it is the least recently used
        # part, and inserting the promoted entries would evict the very prefix they extend.
        held = self.ram.match(chain, needs_checkpoint=False, pin=True)
        try:
            for _ in range(_PROMOTION_TRIES):
                outcome = self._read_into_ram(hit, plan)
                if isinstance(outcome, bool):
                    return outcome
                plan = self._plan(chain, hit.scope, hit.needs_checkpoint, ram_length, outcome)
                if plan is None:
                    return False
            return False
        finally:
            if held.pinned:
                self.ram.release(held)

    def _read_into_ram(self, hit: Hit, plan: SSDPlan) -> bool | int:
        """Promote `plan`; True/False when done, or a lower reach to plan again with."""
        chain, scope, bs = hit.chain, hit.scope, hit.chain.block_size
        reserved: list[int] = []
        read: dict[int, Stored] = {}
        failed_at = None
        try:
            for i in plan.blocks:
                stored = self._read(scope, EntryKind.BLOCK, chain.hashes[i], reserved)
                if stored is None:
                    failed_at = i
                    break
                read[i] = stored[0]
        finally:
            # Hand the reservation back just before inserting, so its bytes are not counted
            # twice; the run goes in as one insert.
            self.ram.unreserve(sum(reserved))
        if read:
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
            stored = self._read(scope, EntryKind.CHECKPOINT, key, reserved)
        finally:
            self.ram.unreserve(sum(reserved))
        if stored is None:
            if hit.needs_checkpoint:
                return plan.checkpoint - 1
            return plan.checkpoint // bs * bs > hit.ram_length  # the blocks alone serve
        self.ram.insert_checkpoint(chain, plan.checkpoint, stored[0], stored[1])
        return True

    def _read(
        self, scope: Scope, kind: EntryKind, key: BlockHash, reserved: list[int]
    ) -> tuple[Stored, Reason] | None:
        """Read one entry under a RAM reservation (kept in `reserved`); None is a miss."""
        assert self.ssd is not None

        def reserve(n: int) -> bool:
            ok = self.ram.reserve(n)
            if ok:
                reserved.append(n)
            return ok

        def release(n: int) -> None:
            self.ram.unreserve(n)
            reserved.remove(n)

        entry = self.ssd.get(scope, kind, key, reserve=reserve, release=release)
        if entry is None:
            return None
        try:
            payload = self.codec.from_host(entry.tensors, entry.meta)
            reason = Reason(entry.meta[_META_REASON]) if kind is EntryKind.CHECKPOINT else None
        except (ValueError, KeyError) as e:
            log.warning("ssd entry %s is unreadable as a payload: %s", key.hex()[:16], e)
            return None
        return Stored(payload, scope, on_ssd=True), reason

    # ---- storing ------------------------------------------------------------------------

    def store_blocks(self, chain: Chain, scope: Scope, payloads: Mapping[int, Any]) -> None:
        """Insert full blocks of `chain` by index into RAM, and write them through; a
        snapshot model's blocks wait for a checkpoint that needs them (write_policy.py)."""
        stored = {i: Stored(p, scope) for i, p in payloads.items()}
        self.ram.insert_blocks(chain, stored)
        if self.policy is WritePolicy.THROUGH and scope not in self._snapshot_scopes:
            for i, s in stored.items():
                self._write(s, EntryKind.BLOCK, chain.hashes[i], chain.block_size, None)

    def store_checkpoint(
        self, chain: Chain, scope: Scope, position: int, payload: Any, reason: Reason
    ) -> None:
        """Insert the state after `position` tokens of `chain`; with write-through, write it
        once it has stayed the deepest on its path a while (write_policy.py)."""
        stored = Stored(payload, scope)
        big = has_snapshots(payload)
        if big:
            self._snapshot_scopes.add(scope)
        self.ram.insert_checkpoint(chain, position, stored, reason)
        if self.policy is not WritePolicy.THROUGH or (reason is Reason.GENERATION_END and big):
            return
        entry = self.ram.entry(EntryKind.CHECKPOINT, chain.checkpoint_key(position))
        if entry is None or entry.payload is not stored or entry.superseded:
            return  # evicted at once (and spilled), already held, or thinned
        sparse = reason is Reason.PERIODIC and self._periodic_due(chain, scope, position)
        if sparse:
            # Written even once superseded: a crash in a long prefill resumes here.
            self._write_checkpoint(chain, entry, "write_through", skip=False)
            self._periodic_written[entry.key] = None
            if len(self._periodic_written) > _PERIODIC_MEMO:
                self._periodic_written.popitem(last=False)
        elif self._hold_back(entry):
            self._defer(chain, entry)
        else:
            self._write_checkpoint(chain, entry, "write_through")

    def _hold_back(self, entry: Checkpoint) -> bool:
        """Whether a write-through checkpoint waits for a deeper one to supersede it: one
        with snapshot state (a paged model's is at most one block's tail, not worth it),
        except the path's first message boundary, where every session of a project
        resumes."""
        return (
            self.deferred.delay_s > 0
            and has_snapshots(entry.payload.payload)
            and not entry.first_boundary
        )

    def _periodic_due(self, chain: Chain, scope: Scope, position: int) -> bool:
        """Whether a periodic checkpoint at `position` goes to disk at once: when the
        next periodic one would lie more than `periodic_write_every` tokens past both the
        point this prefill resumed from and the deepest checkpoint on the path that is on
        disk (or queued for it, not held back). A crash in a long prefill then loses at
        most that much of it, and the short prefills of a session that re-renders its
        turns write none (their resume points reach the disk by the held-back rule)."""
        every = self.periodic_write_every
        if not every:
            return False
        interval = max(1, every // SPARSE_PERIODIC_EVERY)
        lo = max(0, position - every)
        resumed = self._resumed_at.get(id(chain))
        if (
            resumed is not None
            and resumed[0] is chain
            and position + interval - resumed[1] <= every
        ):
            return False
        written = [
            c.position
            for c in self.ram.checkpoints_on(chain, lo, position - 1)
            if c.payload.on_ssd and c.key not in self.deferred
        ]
        if self.ssd is not None:
            # Periodic ones written earlier that thinning has since dropped from RAM.
            points = list(range(position - interval, lo, -interval))
            keys = [chain.checkpoint_key(p) for p in points]
            found = self.ssd.contains_many(scope, EntryKind.CHECKPOINT, keys)
            written += [
                p
                for p, k, present in zip(points, keys, found, strict=True)
                if present or k in self._periodic_written
            ]
        return position + interval - max(written, default=0) > every

    def _defer(self, chain: Chain, entry: Checkpoint) -> None:
        """Hold the write of `entry` back (checkpoint_writes.py); when it goes out, so do
        the blocks on its path that are not on disk yet."""
        if self.ssd is None:
            return
        stored = entry.payload
        tensors, meta = self._host(stored, entry.position, entry.reason)
        stored.on_ssd = True  # on its way: a spill meanwhile must not write it twice

        def put() -> bool:
            if not self._write_path(
                chain.hashes[: entry.position // chain.block_size], stored.scope
            ):
                stored.on_ssd = False  # a spill or a reuse tries again
                return False
            outcome = self.ssd.put(
                stored.scope, EntryKind.CHECKPOINT, entry.key, tensors, meta,
                tokens=entry.position, skip=skip_if_superseded(entry),
            )  # fmt: skip
            stored.on_ssd = outcome in ("queued", "duplicate")
            return outcome == "queued"

        self.deferred.add(entry, put)

    def _write_checkpoint(
        self, chain: Chain | None, entry: Checkpoint, why: PutReason, *, skip: bool = True
    ) -> PutOutcome | None:
        """Write `entry` now, after the blocks on its path that are not on disk yet (from
        `chain`, or walking RAM's parents from its anchor). `skip`: drop it if it is
        superseded before the writer reaches it."""
        stored = entry.payload
        if self.ssd is None or stored.on_ssd:
            return None
        if chain is not None:
            path = chain.hashes[: entry.position // chain.block_size]
        else:
            path = [b.hash for b in self.ram.path_to(entry.anchor)]
        if not self._write_path(path, stored.scope, why):
            return "dropped"  # useless without its blocks: a later spill or reuse retries
        return self._write(
            stored, EntryKind.CHECKPOINT, entry.key, entry.position, entry.reason, why,
            skip=skip_if_superseded(entry) if skip else None,
        )  # fmt: skip

    def _write_path(
        self, hashes: Sequence[BlockHash], scope: Scope, why: PutReason = "write_through"
    ) -> bool:
        """Write the blocks of `hashes` RAM holds and the SSD lacks, shallowest first, ahead
        of a snapshot model's checkpoint (the writer keeps their order, so a crash never
        leaves that checkpoint on disk without them). False if one could not be queued.
        Other models' blocks went through when stored."""
        if scope not in self._snapshot_scopes:
            return True
        for block in self.ram.blocks(hashes):
            if block is None or block.payload.on_ssd:
                continue  # on disk (spilled when RAM evicted it), or never stored
            outcome = self._write(
                block.payload, EntryKind.BLOCK, block.hash, len(block.tokens), None, why
            )
            if outcome not in ("queued", "duplicate"):
                return False
        return True

    def _tick(self) -> None:
        """The SSD writer's tick: have the held-back writes that are due go out on the MLX
        thread (one call at a time), or, with no way there, at the next request."""
        if self.call_on_mlx is None or not self.deferred.due() or self._flush_asked.is_set():
            return
        self._flush_asked.set()

        def flush() -> None:
            self._flush_asked.clear()
            self.deferred.flush()

        try:
            self.call_on_mlx(flush)
        except RuntimeError:  # the MLX thread has stopped: close writes what is left
            self._flush_asked.clear()

    def _spill(self, entry: Entry) -> None:
        """RAM eviction hook: write what is not on disk yet instead of losing it, except
        what no request would restore from (write_policy.py)."""
        used = entry.payload.used
        if entry.kind is EntryKind.CHECKPOINT and (
            entry.superseded
            or (
                entry.reason is Reason.GENERATION_END
                and not used
                and has_snapshots(entry.payload.payload)
            )
        ):
            return
        if self.policy is WritePolicy.SECOND_USE and not used:
            return
        if entry.kind is EntryKind.CHECKPOINT:
            if not self.deferred.release(entry.key):  # a held-back write, due now
                self._write_checkpoint(None, entry, "spill")
            return
        self._put(entry, "spill")

    def _put(self, entry: Entry, why: PutReason) -> PutOutcome | None:
        stored = entry.payload
        assert isinstance(stored, Stored), f"{entry!r} holds a {type(stored).__name__}"
        if entry.kind is EntryKind.BLOCK:
            return self._write(stored, entry.kind, entry.key, len(entry.tokens), None, why)
        return self._write(stored, entry.kind, entry.key, entry.position, entry.reason, why)

    def _write(
        self,
        stored: Stored,
        kind: EntryKind,
        key: BlockHash,
        tokens: int,
        reason: Reason | None,
        why: PutReason = "write_through",
        skip: Callable[[], bool] | None = None,
    ) -> PutOutcome | None:
        if self.ssd is None or stored.on_ssd:
            return None
        tensors, meta = self._host(stored, tokens, reason)
        outcome = self.ssd.put(
            stored.scope, kind, key, tensors, meta, tokens=tokens, reason=why, skip=skip
        )
        stored.on_ssd = outcome in ("queued", "duplicate")
        return outcome

    def _host(
        self, stored: Stored, tokens: int, reason: Reason | None
    ) -> tuple[dict[str, HostTensor], dict[str, str]]:
        tensors, meta = self.codec.to_host(stored.payload)
        meta[_META_TOKENS] = str(tokens)
        if reason is not None:
            meta[_META_REASON] = reason.value
        return tensors, meta

    # ---- what the SSD lost --------------------------------------------------------------

    def _ssd_lost(self, scope: Scope | None) -> int:
        """The SSD lost its copies (of `scope`, or all): what RAM still holds loses its
        'on SSD' mark, so eviction spills it again, and with write-through it is put again
        from the next requests. Runs on the SSD writer thread; returns the entries held."""
        held = [e for e in self.ram.entries() if scope is None or e.payload.scope == scope]
        for entry in held:
            entry.payload.on_ssd = False
        if self.write_through:
            with self._rewrite_lock:
                self._rewrite.extend((e.kind, e.key) for e in held)
        return len(held)

    def _rewrite_some(self, limit: int) -> int:
        """Put up to `limit` entries of the rewrite backlog, as far as the SSD queue has
        room; skips those evicted (spilled then) or still on disk. Returns how many."""
        assert self.ssd is not None
        limit, queued, failed = min(limit, self.ssd.room), 0, None
        while queued < limit:
            with self._rewrite_lock:
                if not self._rewrite:
                    break
                kind, key = self._rewrite.popleft()
            entry = self.ram.entry(kind, key)
            if entry is None or entry.payload.on_ssd:
                continue
            if self.ssd.holds(entry.payload.scope, kind, key):
                entry.payload.on_ssd = True  # its file survived, and the new index has it
                continue
            try:
                outcome = self._put(entry, "write_through")
            except Exception as e:  # e.g. at close, off the MLX thread (see `close`)
                failed = e
                continue
            if outcome == "dropped":  # the queue filled up meanwhile: later
                with self._rewrite_lock:
                    self._rewrite.appendleft((kind, key))
                break
            if outcome == "disabled":  # RAM-only again; a resume re-queues everything
                with self._rewrite_lock:
                    self._rewrite.clear()
                break
            queued += outcome == "queued"
        if failed is not None:
            log.warning("ssd: could not put entries RAM holds to write them again: %r", failed)
        return queued

    # ---- upkeep -------------------------------------------------------------------------

    def stats(self) -> TierStats:
        return TierStats(self.ram.stats(), self.ssd.stats() if self.ssd is not None else None)

    def close(self, timeout_s: float) -> None:
        """Drain queued SSD writes for at most `timeout_s`, and in that time write again
        what RAM holds that the SSD lost (a folder deleted since the last request)."""
        if self.ssd is None:
            return
        end = time.monotonic() + timeout_s
        self.deferred.flush(everything=True)
        self.ssd.check_folder(timeout_s / 2)
        # The MLX thread has stopped by now; payloads RAM holds were evaluated when first
        # written, so turning them into host bytes here evaluates nothing new.
        while self._rewrite and time.monotonic() < end:
            if not self._rewrite_some(self.ssd.room) and not self.ssd.flush(end - time.monotonic()):
                break
        self.ssd.close(max(0.0, end - time.monotonic()))
