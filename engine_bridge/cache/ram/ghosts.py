"""The RAM tier's ghost lists: what it evicted lately, and whether each had been read.

A key that comes back into RAM (computed again, or read back from a tier below) while its
ghost is here was evicted too soon: a larger budget would have kept it. Whether it had
been read before it went says which policy would have, and the bytes evicted after it
went say how much larger (its stack distance, as Mattson's miss-ratio curves count it: a
recency order that keeps one more byte per byte of budget would have kept it exactly when
the budget exceeds it by that much). A ghost of an entry read again
(frequent) asks to protect such entries longer, one of an entry never read (recent) asks
for plain recency, as ARC adapts its lists. As in ARC, an entry back from its ghost has
been seen twice: it comes back counted as read (manager.py), so if it goes and comes back
again, that ghost is a frequent one. The autotuner reads the counts (autotune.py).

Kept like the eviction record (evictions.py): the short int of each key, in two
generations of at most half the capacity each.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

DEFAULT_CAPACITY = 1 << 15


@dataclass(slots=True)
class GhostHits:
    """Ghosts that came back since the last read: entries and bytes, by kind."""

    recent: int = 0
    recent_bytes: int = 0
    frequent: int = 0
    frequent_bytes: int = 0
    # The most bytes evicted after any of them went, its own included: a budget larger by
    # this would have kept every one (under plain recency).
    depth: int = 0

    @property
    def bytes(self) -> int:
        return self.recent_bytes + self.frequent_bytes


class Ghosts:
    """Not thread-safe: the RAM tier calls it under its lock."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self._half = max(capacity // 2, 1)
        # short key -> (was read, bytes, evicted bytes in all once it went)
        self._new: dict[int, tuple[bool, int, int]] = {}
        self._old: dict[int, tuple[bool, int, int]] = {}
        self._evicted = 0  # bytes evicted in all, the clock each ghost's depth is read on
        self._hits = GhostHits()

    def add(self, entries: Iterable[Any]) -> None:
        """Entries just evicted (each with `key`, `reads` and `nbytes`)."""
        for e in entries:
            short = int.from_bytes(e.key[:8], "little")
            self._old.pop(short, None)
            self._evicted += e.nbytes
            self._new[short] = (e.reads > 0, e.nbytes, self._evicted)
            if len(self._new) >= self._half:
                self._old, self._new = self._new, {}

    def came_back(self, key: bytes) -> bool:
        """`key` is in RAM again: count its ghost, if it has one; whether it had."""
        short = int.from_bytes(key[:8], "little")
        ghost = self._new.pop(short, None) or self._old.pop(short, None)
        if ghost is None:
            return False
        read, nbytes, at = ghost
        self._hits.depth = max(self._hits.depth, self._evicted - at + nbytes)
        if read:
            self._hits.frequent += 1
            self._hits.frequent_bytes += nbytes
        else:
            self._hits.recent += 1
            self._hits.recent_bytes += nbytes
        return True

    @property
    def waiting_bytes(self) -> int:
        """Bytes of the ghosts that came back since the last take."""
        return self._hits.bytes

    def take(self) -> GhostHits:
        """The hits since the last take."""
        hits, self._hits = self._hits, GhostHits()
        return hits
