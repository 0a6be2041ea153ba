"""Checkpoint writes held back until they have stayed the deepest on their path a while.

A session supersedes its own checkpoints turn after turn (supersede.py); written at once,
each would cost a whole snapshot of the model's state on disk (66 MB on a 30-layer Gated
DeltaNet model) only to be useless a turn later. So a write-through checkpoint waits here,
already in host bytes (converted on the MLX thread that stored it), for `delay_s` after
the request that stored it finished (its generation end): if a deeper one supersedes it
meanwhile it is dropped unwritten, otherwise it is queued. Due writes go out on the MLX
thread (the put writes the blocks on the checkpoint's path too, and turning them into
host bytes evaluates arrays): at the next request, or when the SSD writer's tick asks for
it there; everything left goes out at close. A kill -9 loses at most the checkpoints of
the last `delay_s` (a restart then resumes from an older one).

What waits is bounded, in count and in host bytes (`max_held`, `max_bytes`): past either,
the superseded ones are dropped and then the oldest go out now. Writing one early is only
what its due time would have done, less the chance that a deeper one supersedes it first
(one checkpoint's worth of SSD wear); holding without bound would hold the host bytes of
every session's snapshot for `delay_s`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine_bridge.cache.hashing import BlockHash
from engine_bridge.cache.ram.checkpoints import Checkpoint

# About 15 snapshots of a 30-layer Gated DeltaNet model (66 MB each), or 64 small ones.
MAX_HELD = 64
MAX_HELD_BYTES = 1 << 30


@dataclass(slots=True)
class Deferred:
    due: float
    entry: Checkpoint
    put: Callable[[], bool]  # queue the write; True if it went on the SSD queue
    nbytes: int = 0  # the host bytes `put` holds


@dataclass(slots=True, frozen=True)
class DeferredStats:
    """What /v1/cache/stats shows under "writes"."""

    held: int  # checkpoint writes waiting now
    held_bytes: int
    max_held: int
    max_held_bytes: int
    dropped: int  # superseded while waiting: never written
    early: int  # written before their time because the bound was reached


class DeferredWrites:
    """Pending checkpoint writes by key; thread-safe (the MLX and the writer thread flush)."""

    def __init__(
        self,
        delay_s: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        max_held: int = MAX_HELD,
        max_bytes: int = MAX_HELD_BYTES,
    ) -> None:
        assert max_held >= 0 and max_bytes >= 0, (max_held, max_bytes)
        self.delay_s = delay_s
        self.max_held = max_held
        self.max_bytes = max_bytes
        self._clock = clock
        self._lock = threading.Lock()
        self._items: dict[BlockHash, Deferred] = {}
        self._bytes = 0
        self.dropped = 0  # superseded while waiting: never written
        self.early = 0  # written before their time: the bound was reached

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: BlockHash) -> bool:
        return key in self._items

    def due(self) -> bool:
        """Whether a held write is due (or superseded, to drop)."""
        now = self._clock()
        with self._lock:
            return any(d.due <= now or d.entry.superseded for d in self._items.values())

    @property
    def nbytes(self) -> int:
        return self._bytes

    def stats(self) -> DeferredStats:
        with self._lock:
            held, held_bytes = len(self._items), self._bytes
        return DeferredStats(
            held, held_bytes, self.max_held, self.max_bytes, self.dropped, self.early
        )

    def add(self, entry: Checkpoint, put: Callable[[], bool], nbytes: int = 0) -> int:
        """Hold the write of `entry` (`nbytes` of host bytes); past the bound, drop the
        superseded ones and queue the oldest now. Returns how many that queued early."""
        with self._lock:
            self._pop(entry.key)
            self._items[entry.key] = Deferred(self._clock() + self.delay_s, entry, put, nbytes)
            self._bytes += nbytes
            over = self._over_bound()
        queued = 0
        for d in over:
            if d.entry.superseded:
                self._drop(d)
            else:
                self.early += 1
                queued += d.put()
        return queued

    def _over_bound(self) -> list[Deferred]:
        """Take out what exceeds the bound: superseded ones first, then the soonest due.
        Called with the lock held."""
        out: list[Deferred] = []
        items = self._items
        while items and (len(items) > self.max_held or self._bytes > self.max_bytes):
            victim = next((d for d in items.values() if d.entry.superseded), None)
            if victim is None:
                victim = min(items.values(), key=lambda d: d.due)
            out.append(self._pop(victim.entry.key))
        return out

    def _pop(self, key: BlockHash) -> Deferred | None:
        d = self._items.pop(key, None)
        if d is not None:
            self._bytes -= d.nbytes
        return d

    def _drop(self, d: Deferred) -> None:
        d.entry.payload.on_ssd = False  # type: ignore[attr-defined]  # a reuse writes it
        self.dropped += 1

    def flush(self, *, everything: bool = False) -> int:
        """Queue the writes that are due (or all of them); drop the superseded ones.
        Returns how many were queued."""
        if not self._items:
            return 0
        now = self._clock()
        with self._lock:
            ready = [
                d for d in self._items.values() if everything or d.due <= now or d.entry.superseded
            ]
            for d in ready:
                self._pop(d.entry.key)
        queued = 0
        for d in ready:
            if d.entry.superseded:
                self._drop(d)
                continue
            queued += d.put()
        return queued

    def entries(self) -> list[Checkpoint]:
        """The checkpoints whose writes are held now (a snapshot)."""
        with self._lock:
            return [d.entry for d in self._items.values()]

    def postpone(self, entries: list[Checkpoint]) -> None:
        """Start the wait of these held writes again from now."""
        due = self._clock() + self.delay_s
        with self._lock:
            for entry in entries:
                d = self._items.get(entry.key)
                if d is not None:
                    d.due = max(d.due, due)

    def release(self, key: BlockHash) -> bool:
        """Queue the held write of `key` now (RAM is evicting it, so holding on any longer
        would leave it nowhere a lookup finds it). Whether it went on the SSD queue."""
        with self._lock:
            d = self._pop(key)
        if d is None or d.entry.superseded:
            return False
        return d.put()


def skip_if_superseded(entry: Checkpoint) -> Callable[[], bool]:
    """For the SSD writer: drop a checkpoint superseded while it waited in the queue (then
    it is not on disk, and a request that reuses it writes it after all)."""

    def skip() -> bool:
        if entry.superseded:
            entry.payload.on_ssd = False
            return True
        return False

    return skip


def has_snapshots(payload: Any) -> bool:
    """Whether a checkpoint holds snapshot layers' state (tens of MB on a hybrid model),
    not only a paged model's partial tail block."""
    return bool(getattr(payload, "snapshots", ()))
