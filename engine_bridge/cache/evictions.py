"""Which entries a tier dropped lately, and why: so a later miss can name its cause.

Keys are chained hashes, so an entry found here under a request's chain was once cached
with exactly that request's prefix: the cache held it, and lost it to eviction or expiry.
Bounded, so it explains recent misses only.

Kept small and flat, because a busy tier drops keys all day: each key is held as the int of
its first 8 bytes (a false match among 2^64 only mislabels a miss, never serves anything), in
two generations of at most half the capacity each. When the newer one fills, the older one
is dropped whole. So after its first `capacity // 2` drops the record only swings between
half and all of its size (the load soak saw the old exact-LRU record, 32-byte keys in an
OrderedDict, grow RSS by up to 10 MB per tier over 10,000 requests); each key costs about
70 bytes; lookups and adds are O(1); and it always knows the newest `capacity // 2` keys.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Literal

Cause = Literal["evicted", "expired"]
_CAUSES: tuple[Cause, ...] = ("evicted", "expired")

# About 64k keys: a 4M-token working set of 64-token blocks, about 4.5 MB.
DEFAULT_CAPACITY = 1 << 16


def _short(key: bytes) -> int:
    return int.from_bytes(key[:8], "little")


class EvictionRecord:
    """Recently dropped keys of one tier → the cause; thread-safe (the SSD writer and the
    MLX thread both record)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        assert capacity >= 2, f"capacity {capacity}"
        self.capacity = capacity
        self._half = capacity // 2
        self._new: dict[int, int] = {}  # short key -> index into _CAUSES
        self._old: dict[int, int] = {}
        self._lock = threading.Lock()

    def add(self, keys: Iterable[bytes], cause: Cause = "evicted") -> None:
        code = _CAUSES.index(cause)
        with self._lock:
            for key in keys:
                short = _short(key)
                self._old.pop(short, None)
                self._new[short] = code
                if len(self._new) >= self._half:
                    self._old, self._new = self._new, {}

    def cause(self, key: bytes) -> Cause | None:
        short = _short(key)
        with self._lock:
            code = self._new.get(short, self._old.get(short))
        return None if code is None else _CAUSES[code]

    def __len__(self) -> int:
        with self._lock:
            return len(self._new) + len(self._old)
