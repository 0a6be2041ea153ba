"""How the tiers write to SSD: when (write_policy.py), which entries go together, and what
is written again after the SSD lost it.

A paged model's blocks go through as they are stored. A snapshot (hybrid) model's blocks
wait for a checkpoint that needs them and go just before it, in the writer's order, so the
disk never holds such a checkpoint without its blocks after a crash; its checkpoints are
held back (checkpoint_writes.py) until they have stayed the deepest on their path a while,
and those a deeper one supersedes (supersede.py) are never written. What RAM evicts spills
here. When the SSD loses what it held (its folder deleted while serving, or writes failing
for a while), what RAM still holds is put again, a few entries per request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from engine_bridge.cache.checkpoint_writes import (
    DeferredStats,
    DeferredWrites,
    has_snapshots,
    skip_if_superseded,
)
from engine_bridge.cache.hashing import BlockHash, Chain
from engine_bridge.cache.kinds import CheckpointReason, EntryKind, PutReason
from engine_bridge.cache.ram.checkpoints import Checkpoint
from engine_bridge.cache.ram.manager import CacheManager, Entry
from engine_bridge.cache.ram.matching import Match
from engine_bridge.cache.resume_points import ResumePoints, ResumePointStats
from engine_bridge.cache.ssd.index import Scope
from engine_bridge.cache.ssd.store import PutOutcome, SSDStore
from engine_bridge.cache.tensors import HostTensor
from engine_bridge.cache.write_policy import SPARSE_PERIODIC_EVERY, WritePolicy

log = logging.getLogger(__name__)

# Entry metadata the tiers add to the codec's own.
META_REASON = "cache.reason"
META_TOKENS = "cache.tokens"
# Periodic checkpoint writes and resume points remembered for `_periodic_due`.
_PERIODIC_MEMO = 1024
# Puts of one lost entry that may fail (turning it into host bytes, queueing it) before it
# is given up and counted: a fault of one entry must not hold the rest back for ever.
REWRITE_TRIES = 3


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
    on_shared: bool = False  # in the shared store, or on its way there
    used: bool = False  # a later request restored from it (second-use writes it then)

    @property
    def nbytes(self) -> int:
        return self.payload.nbytes


@dataclass(slots=True, frozen=True)
class WriteStats:
    """What /v1/cache/stats shows under "writes": held-back checkpoints and lost entries."""

    deferred: DeferredStats
    rewrites_pending: int  # entries the SSD lost that RAM holds, waiting to be put again
    rewrite_failures: int  # of those, given up after REWRITE_TRIES failed puts
    # Where recent prefills resumed (resume_points.py); the default serves tests that
    # build these stats field by field.
    resume_points: ResumePointStats = ResumePointStats()


class TierWrites:
    """The SSD side of `tiers.TieredCache`: stores, spills, held-back and lost writes."""

    def __init__(
        self,
        ram: CacheManager,
        ssd: SSDStore | None,
        codec: Codec,
        policy: WritePolicy,
        checkpoint_delay_s: float,
        periodic_write_every: int | None,
    ) -> None:
        self.ram = ram
        self.ssd = ssd
        self.codec = codec
        self.policy = policy
        # Write-through checkpoints wait this long for a deeper one to supersede them,
        # except a periodic one a crash would otherwise lose too much of (`_periodic_due`).
        self.deferred = DeferredWrites(checkpoint_delay_s)
        self.periodic_write_every = periodic_write_every
        # Scopes of snapshot models (a lookup needed a checkpoint, or one with snapshot
        # state was stored): their blocks are written with the checkpoints that need them.
        self.snapshot_scopes: set[Scope] = set()
        # Keys of the periodic checkpoints written lately (the index has them only once the
        # writer is done, and RAM thins them as soon as a deeper one lands).
        self._periodic_written: OrderedDict[BlockHash, None] = OrderedDict()
        # Where each recent request's prefill resumed, by its chain (`resumed`).
        self.resume_points = ResumePoints(_PERIODIC_MEMO)
        # Runs a function on the MLX thread (the engine's scheduler.call): held-back writes
        # that came due while no request runs go out there, since turning their blocks
        # into host bytes evaluates arrays. Unset, they go out with the next request.
        self.call_on_mlx: Callable[[Callable[[], object]], object] | None = None
        self._flush_asked = threading.Event()
        # Entries RAM holds that the SSD lost, to put again (see `_ssd_lost`), each with
        # the puts of it that failed so far.
        self._rewrite: deque[tuple[EntryKind, BlockHash, int]] = deque()
        self._rewrite_lock = threading.Lock()
        self.rewrite_failures = 0
        if ssd is not None:
            ram.on_evict = self.spill
            ssd.on_lost = self._ssd_lost
            ssd.on_tick = self.tick

    @property
    def rewrites_pending(self) -> bool:
        return bool(self._rewrite)

    def stats(self) -> WriteStats:
        return WriteStats(
            self.deferred.stats(),
            len(self._rewrite),
            self.rewrite_failures,
            self.resume_points.stats(),
        )

    def catch_up(self, scope: Scope, *, snapshots: bool, rewrites: int) -> None:
        """What a request does before its lookup, on the MLX thread: note a snapshot model's
        scope, put up to `rewrites` entries the SSD lost again, and queue the held-back
        checkpoint writes that are due. Lookups themselves never write."""
        if snapshots:
            self.snapshot_scopes.add(scope)
        if self._rewrite and self.ssd is not None:
            self.rewrite_some(rewrites)
        self.deferred.flush()

    def reused(self, chain: Chain, match: Match) -> None:
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
                    self._write_checkpoint(chain, entry, PutReason.WRITE_THROUGH)
            elif self.policy is WritePolicy.SECOND_USE:
                self._put(entry, PutReason.WRITE_THROUGH)

    def resumed(self, chain: Chain, length: int) -> None:
        """A request on `chain` resumes at `length` (for `_periodic_due`, which only
        periodic writes ask)."""
        if self.periodic_write_every:
            self.resume_points.note(chain, length)

    def store_blocks(self, chain: Chain, scope: Scope, payloads: Mapping[int, Any]) -> None:
        """Insert full blocks of `chain` by index into RAM, and write them through; a
        snapshot model's blocks wait for a checkpoint that needs them (write_policy.py)."""
        stored = {i: Stored(p, scope) for i, p in payloads.items()}
        self.ram.insert_blocks(chain, stored)
        if self.policy is WritePolicy.THROUGH and scope not in self.snapshot_scopes:
            for i, s in stored.items():
                self._write(s, EntryKind.BLOCK, chain.hashes[i], chain.block_size, None)

    def store_checkpoint(
        self, chain: Chain, scope: Scope, position: int, payload: Any, reason: CheckpointReason,
        supersedes: bool = True,
    ) -> None:  # fmt: skip
        """Insert the state after `position` tokens of `chain`; with write-through, write it
        once it has stayed the deepest on its path a while (write_policy.py)."""
        stored = Stored(payload, scope)
        big = has_snapshots(payload)
        if big:
            self.snapshot_scopes.add(scope)
        self.ram.insert_checkpoint(chain, position, stored, reason, supersedes)
        if reason is CheckpointReason.GENERATION_END and len(self.deferred):
            # The request is done: its held-back checkpoints wait from now, so a long
            # generation does not use up the time the client's next turn needs to arrive.
            mine = [
                c
                for c in self.deferred.entries()
                if c.position <= len(chain) and chain.checkpoint_key(c.position) == c.key
            ]
            self.deferred.postpone(mine)
        if self.policy is not WritePolicy.THROUGH or (
            reason is CheckpointReason.GENERATION_END and big
        ):
            return
        entry = self.ram.entry(EntryKind.CHECKPOINT, chain.checkpoint_key(position))
        if entry is None or entry.payload is not stored or entry.superseded:
            return  # evicted at once (and spilled), already held, or thinned
        sparse = reason is CheckpointReason.PERIODIC and self._periodic_due(chain, position)
        if sparse:
            # Written even once superseded: a crash in a long prefill resumes here.
            self._write_checkpoint(chain, entry, PutReason.WRITE_THROUGH, skip=False)
            self._periodic_written[entry.key] = None
            if len(self._periodic_written) > _PERIODIC_MEMO:
                self._periodic_written.popitem(last=False)
        elif self._hold_back(entry):
            self._defer(chain, entry)
        else:
            self._write_checkpoint(chain, entry, PutReason.WRITE_THROUGH)

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

    def _periodic_due(self, chain: Chain, position: int) -> bool:
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
        resumed = self.resume_points.get(chain)
        if resumed is not None and position + interval - resumed <= every:
            return False
        written = [
            c.position
            for c in self.ram.checkpoints_on(chain, lo, position - 1)
            if c.payload.on_ssd and c.key not in self.deferred
        ]
        # Periodic ones written earlier that thinning has since dropped from RAM, as this
        # process remembers them: no index query on the MLX thread. One on disk from before
        # a restart is where the prefill resumed (`resume_points`) unless the SSD missed
        # its read-ahead deadline; one put again then, the writer skips (the index has it).
        points = range(position - interval, lo, -interval)
        written += [p for p in points if chain.checkpoint_key(p) in self._periodic_written]
        return position + interval - max(written, default=0) > every

    def _defer(self, chain: Chain, entry: Checkpoint) -> None:
        """Hold the write of `entry` back (checkpoint_writes.py); when it goes out, so do
        the blocks on its path that are not on disk yet."""
        if self.ssd is None:
            return
        stored = entry.payload
        tensors, meta = self.host_bytes(stored, entry.position, entry.reason)
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

        self.deferred.add(entry, put, sum(t.nbytes for t in tensors.values()))

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
        self, hashes: Sequence[BlockHash], scope: Scope, why: PutReason = PutReason.WRITE_THROUGH
    ) -> bool:
        """Write the blocks of `hashes` RAM holds and the SSD lacks, shallowest first, ahead
        of a snapshot model's checkpoint (the writer keeps their order, so a crash never
        leaves that checkpoint on disk without them). False if one could not be queued.
        Other models' blocks went through when stored."""
        if scope not in self.snapshot_scopes:
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

    def tick(self) -> None:
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

    def spill(self, entry: Entry) -> None:
        """RAM eviction hook: write what is not on disk yet instead of losing it, except
        what no request would restore from (write_policy.py)."""
        used = entry.payload.used
        if entry.kind is EntryKind.CHECKPOINT and (
            entry.superseded
            or (
                entry.reason is CheckpointReason.GENERATION_END
                and not used
                and has_snapshots(entry.payload.payload)
            )
        ):
            return
        if self.policy is WritePolicy.SECOND_USE and not used:
            return
        if entry.kind is EntryKind.CHECKPOINT:
            if not self.deferred.release(entry.key):  # a held-back write, due now
                self._write_checkpoint(None, entry, PutReason.SPILL)
            return
        self._put(entry, PutReason.SPILL)

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
        reason: CheckpointReason | None,
        why: PutReason = PutReason.WRITE_THROUGH,
        skip: Callable[[], bool] | None = None,
    ) -> PutOutcome | None:
        if self.ssd is None or stored.on_ssd:
            return None
        tensors, meta = self.host_bytes(stored, tokens, reason)
        outcome = self.ssd.put(
            stored.scope, kind, key, tensors, meta, tokens=tokens, reason=why, skip=skip
        )
        stored.on_ssd = outcome in ("queued", "duplicate")
        return outcome

    def host_bytes(
        self, stored: Stored, tokens: int, reason: CheckpointReason | None
    ) -> tuple[dict[str, HostTensor], dict[str, str]]:
        """An entry's host tensors and metadata, the tiers' keys added (the shared tier
        writes with it too). Evaluates the payload: on the MLX thread."""
        tensors, meta = self.codec.to_host(stored.payload)
        meta[META_TOKENS] = str(tokens)
        if reason is not None:
            meta[META_REASON] = reason.value
        return tensors, meta

    # ---- what the SSD lost ------------------------------------------------------------

    def _ssd_lost(self, scope: Scope | None) -> int:
        """The SSD lost its copies (of `scope`, or all): what RAM still holds and the disk
        lacks loses its 'on SSD' mark, so eviction spills it again, and with write-through
        it is put again from the next requests. Runs on the SSD writer thread, so this is
        where the disk is asked what survived (a file the new index adopted): the puts on
        the MLX thread (`rewrite_some`) ask no index. Returns the entries held."""
        held = [e for e in self.ram.entries() if scope is None or e.payload.scope == scope]
        lost = []
        for entry in held:
            entry.payload.on_ssd = self.ssd.holds(entry.payload.scope, entry.kind, entry.key)
            if not entry.payload.on_ssd:
                lost.append(entry)
        if self.policy is WritePolicy.THROUGH:
            with self._rewrite_lock:
                self._rewrite.extend((e.kind, e.key, 0) for e in lost)
        return len(held)

    def rewrite_some(self, limit: int) -> int:
        """Put up to `limit` entries of the rewrite backlog, as far as the SSD queue has
        room; skips those evicted (spilled then) or on disk again. Returns how many. On the
        MLX thread it asks the SSD nothing (`_ssd_lost` asked what survived).

        A put that raises ends the call, and its entry goes to the back of the backlog, so
        a fault that hits every put cannot drain it in one call, and one that hits a single
        entry does not stop the others; an entry whose put failed REWRITE_TRIES times is
        given up (and counted): RAM still holds it, and its eviction spills it."""
        assert self.ssd is not None
        limit, queued = min(limit, self.ssd.room), 0
        while queued < limit:
            with self._rewrite_lock:
                if not self._rewrite:
                    break
                kind, key, tries = self._rewrite.popleft()
            entry = self.ram.entry(kind, key)
            if entry is None or entry.payload.on_ssd:
                continue
            try:
                outcome = self._put(entry, PutReason.WRITE_THROUGH)
            except Exception as e:  # e.g. at close, off the MLX thread (see `close`)
                self._rewrite_failed(kind, key, tries + 1, e)
                break
            if outcome == "dropped":  # the queue filled up meanwhile: later
                with self._rewrite_lock:
                    self._rewrite.appendleft((kind, key, tries))
                break
            if outcome == "disabled":  # RAM-only again; a resume re-queues everything
                with self._rewrite_lock:
                    self._rewrite.clear()
                break
            queued += outcome == "queued"
        return queued

    def _rewrite_failed(
        self, kind: EntryKind, key: BlockHash, tries: int, error: Exception
    ) -> None:
        if tries < REWRITE_TRIES:
            with self._rewrite_lock:
                self._rewrite.append((kind, key, tries))
            log.debug(
                "ssd: putting a lost %s again failed (try %d): %r", kind.name.lower(), tries, error
            )
            return
        self.rewrite_failures += 1
        n = self.rewrite_failures
        # A fault of every put gives up every entry: the first and every 100th say so.
        log.log(
            logging.WARNING if n == 1 or n % 100 == 0 else logging.DEBUG,
            "ssd: gave up writing a lost %s again after %d failed puts (RAM still holds it; "
            "%d given up so far): %r",
            kind.name.lower(), tries, n, error,
        )  # fmt: skip

    # ---- close --------------------------------------------------------------------------

    def close(self, timeout_s: float) -> None:
        """Write the held-back checkpoints, and drain queued SSD writes for at most
        `timeout_s`, in that time writing again what RAM holds that the SSD lost (a folder
        deleted since the last request)."""
        if self.ssd is None:
            return
        end = time.monotonic() + timeout_s
        self.deferred.flush(everything=True)
        self.ssd.check_folder(timeout_s / 2)
        # The MLX thread has stopped by now; payloads RAM holds were evaluated when first
        # written, so turning them into host bytes here evaluates nothing new.
        while self._rewrite and time.monotonic() < end:
            if not self.rewrite_some(self.ssd.room) and not self.ssd.flush(end - time.monotonic()):
                break
        self.ssd.close(max(0.0, end - time.monotonic()))
