"""Many sequences' caches as one batch: mlx-lm's batch cache classes behind three verbs.

A sequence prefills alone in an ordinary cache list (so its save points and numerics are
those of a single request), then `join`s the running batch; each decode step runs the
batch as one forward pass; a finished sequence is `extract`ed back into an ordinary cache
list for its end-of-generation save and `drop`ped from the batch.

mlx-lm 0.32.2 merges `KVCache` into `BatchKVCache`, `RotatingKVCache` into
`BatchRotatingKVCache` and `ArraysCache` into a batched `ArraysCache`, each with `extend`,
`filter` and `extract`. It has no batch form of `QuantizedKVCache`, and its rotating batch
cache drops `keep`: a model with either decodes one sequence at a time (`batch_blocker`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    RotatingKVCache,
)

from engine_bridge.kv.caches import _leaves

_BATCHABLE = (KVCache, ArraysCache, RotatingKVCache)


def batch_blocker(cache: Sequence[Any]) -> str | None:
    """Why this model's caches cannot decode as a batch, or None when they can."""
    for _, c in _leaves(cache):
        if type(c) not in _BATCHABLE:
            return f"mlx-lm has no batch form of {type(c).__name__}"
        if isinstance(c, RotatingKVCache) and c.keep:
            return f"mlx-lm's batch rotating cache drops keep={c.keep}"
    return None


class Batch:
    """The live cache of the sequences decoding together, in join order (row i = member i).

    With `batched=False` it holds at most one member and uses its cache list as it is, for
    models whose caches have no batch form.
    """

    def __init__(self, batched: bool = True):
        self.batched = batched
        self.cache: list[Any] | None = None
        self.size = 0

    def join(self, cache: list[Any]) -> None:
        """Add a prefilled sequence's cache list as the last row."""
        if not self.batched:
            assert self.size == 0, "an unbatched model decodes one sequence at a time"
            self.cache, self.size = cache, 1
            return
        merged = [_merge(c) for c in cache]
        if self.cache is None:
            self.cache = merged
        else:
            for mine, theirs in zip(self.cache, merged, strict=True):
                mine.extend(theirs)
        self.size += 1

    def extract(self, row: int) -> list[Any]:
        """Row `row` as an ordinary cache list (copies: the batch keeps decoding)."""
        assert self.cache is not None and 0 <= row < self.size, f"no row {row} of {self.size}"
        if not self.batched:
            return self.cache
        return [c.extract(row) for c in self.cache]

    def keep(self, rows: list[int]) -> None:
        """Drop every row not in `rows` (ascending); the others keep their order."""
        if len(rows) == self.size:
            return
        if not rows:
            self.cache, self.size = None, 0
            return
        assert self.batched, "an unbatched batch holds one row"
        for c in self.cache or ():
            c.filter(rows)
        self.size = len(rows)

    @property
    def nbytes(self) -> int:
        return live_nbytes(self.cache or [])


def _merge(c: Any) -> Any:
    # KVCache/RotatingKVCache.merge ignore their instance; ArraysCache/CacheList's are
    # classmethods. Either way: a batch of one.
    if isinstance(c, CacheList):
        return CacheList.merge([c])
    return c.merge([c])


def live_nbytes(cache: Sequence[Any]) -> int:
    """Bytes held by a cache list (single or batched), from shapes: nothing is evaluated."""
    return sum(c.nbytes for c in cache)
