"""Which entries a tier dropped lately, and why: so a later miss can name its cause.

Keys are chained hashes, so an entry found here under a request's chain was once cached
with exactly that request's prefix: the cache held it, and lost it to eviction or expiry.
Bounded (oldest first out), so it explains recent misses only, at 48 bytes a key or so.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Literal

Cause = Literal["evicted", "expired"]

# About 64k keys: a 4M-token working set of 64-token blocks, a few MB of hashes.
DEFAULT_CAPACITY = 1 << 16


class EvictionRecord:
    """Recently dropped keys of one tier → the cause; thread-safe (the SSD writer and the
    MLX thread both record)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        assert capacity > 0, f"capacity {capacity}"
        self.capacity = capacity
        self._keys: OrderedDict[bytes, Cause] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, keys: Iterable[bytes], cause: Cause = "evicted") -> None:
        with self._lock:
            for key in keys:
                self._keys[key] = cause
                self._keys.move_to_end(key)
            while len(self._keys) > self.capacity:
                self._keys.popitem(last=False)

    def cause(self, key: bytes) -> Cause | None:
        with self._lock:
            return self._keys.get(key)

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)
