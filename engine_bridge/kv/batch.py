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

    One member decodes in its own cache list, exactly as a lone request; the batch form
    (left-padded mlx-lm batch caches) exists only while two or more share the step. With
    `batched=False` it holds at most one member, for models whose caches have no batch form.
    """

    def __init__(self, batched: bool = True):
        self.batched = batched
        self.cache: list[Any] | None = None
        self.size = 0

    @property
    def merged(self) -> bool:
        return self.size > 1

    def join(self, cache: list[Any]) -> None:
        """Add a prefilled sequence's cache list as the last row."""
        if self.size == 0:
            self.cache, self.size = cache, 1
            return
        assert self.batched, "an unbatched model decodes one sequence at a time"
        assert self.cache is not None
        if self.size == 1:
            self.cache = [
                _merge([mine, theirs]) for mine, theirs in zip(self.cache, cache, strict=True)
            ]
        else:
            for mine, theirs in zip(self.cache, cache, strict=True):
                mine.extend(_merge([theirs]))
        self.size += 1

    def extract(self, row: int) -> list[Any]:
        """Row `row` as an ordinary cache list (a copy while the batch keeps decoding)."""
        assert self.cache is not None and 0 <= row < self.size, f"no row {row} of {self.size}"
        if not self.merged:
            return self.cache
        return [c.extract(row) for c in self.cache]

    def keep(self, rows: list[int]) -> None:
        """Drop every row not in `rows` (ascending); the others keep their order."""
        if len(rows) == self.size:
            return
        if not rows:
            self.cache, self.size = None, 0
            return
        assert self.merged and self.cache is not None
        if len(rows) == 1:
            # Back to one ordinary cache list: no padding, no batch masks.
            self.cache = [c.extract(rows[0]) for c in self.cache]
        else:
            for c in self.cache:
                c.filter(rows)
        self.size = len(rows)

    @property
    def nbytes(self) -> int:
        return live_nbytes(self.cache or [])


def _merge(caches: list[Any]) -> Any:
    """One layer of several sequences as one batch cache of that layer."""
    first = caches[0]
    # KVCache/RotatingKVCache.merge ignore their instance; ArraysCache/CacheList's are
    # classmethods.
    if isinstance(first, CacheList):
        return CacheList.merge(caches)
    return first.merge(caches)


def live_nbytes(cache: Sequence[Any]) -> int:
    """Bytes held by a cache list (single or batched), from shapes: nothing is evaluated."""
    return sum(c.nbytes for c in cache)
