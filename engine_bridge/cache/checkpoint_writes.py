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
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine_bridge.cache.checkpoints import Checkpoint
from engine_bridge.cache.hashing import BlockHash


@dataclass(slots=True)
class Deferred:
    due: float
    entry: Checkpoint
    put: Callable[[], bool]  # queue the write; True if it went on the SSD queue


class DeferredWrites:
    """Pending checkpoint writes by key; thread-safe (the MLX and the writer thread flush)."""

    def __init__(self, delay_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.delay_s = delay_s
        self._clock = clock
        self._lock = threading.Lock()
        self._items: dict[BlockHash, Deferred] = {}
        self.dropped = 0  # superseded while waiting: never written

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: BlockHash) -> bool:
        return key in self._items

    def due(self) -> bool:
        """Whether a held write is due (or superseded, to drop)."""
        now = self._clock()
        with self._lock:
            return any(d.due <= now or d.entry.superseded for d in self._items.values())

    def add(self, entry: Checkpoint, put: Callable[[], bool]) -> None:
        with self._lock:
            self._items[entry.key] = Deferred(self._clock() + self.delay_s, entry, put)

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
                del self._items[d.entry.key]
        queued = 0
        for d in ready:
            if d.entry.superseded:
                d.entry.payload.on_ssd = False  # type: ignore[attr-defined]  # a reuse writes it
                self.dropped += 1
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
            d = self._items.pop(key, None)
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
