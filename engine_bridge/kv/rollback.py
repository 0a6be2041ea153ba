"""Going back to a shorter accepted prefix after a speculative verify pass.

A verify pass feeds the last token and k drafts through the model at once; only the tokens
the model agreed with stay. Each mlx-lm cache class goes back its own way:

- `KVCache` and `QuantizedKVCache` trim: their offset moves back, and the next update
  overwrites what lay beyond it.
- `RotatingKVCache` trims while it has not wrapped (mlx-lm's own `is_trimmable`: fewer
  tokens than its window). Once the window has wrapped, a multi-token update rewrites the
  buffer in temporal order and forgets what fell out of the window: the state from before
  the pass is put back, and the accepted tokens are fed again.
- `ArraysCache` (the recurrent and conv state of Mamba and Gated DeltaNet layers) holds no
  positions at all: the state from before the pass is put back, and the accepted tokens
  fed again.

Putting a state back is free: mlx arrays are values, and these layers rebind their state
to new arrays on every update (`cache[i] = ...`, concatenation), never write into the old
ones, so holding the references from before the pass keeps it. Replaying costs a forward
pass over the accepted tokens. The alternative, recording the recurrent state at every
position of the pass, needs a change to each model's recurrence; a replay is one short
pass only after a rejection, and prompt-lookup rejections are rare once the drafter backs
off (speculation/control.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache

from .caches import _leaves

_TRIMMED = (KVCache, QuantizedKVCache)


def can_rewind(cache: Sequence[Any]) -> bool:
    """Whether every layer of `cache` has a way back (else the sequence decodes plainly)."""
    return all(
        type(c) in (*_TRIMMED, RotatingKVCache)
        or (type(c) is ArraysCache and c.left_padding is None and c.lengths is None)
        for _, c in _leaves(cache)
    )


class Rewind:
    """A cache list's state before a verify pass, to go back to part of what it fed."""

    def __init__(self, cache: Sequence[Any]):
        self._leaves = [c for _, c in _leaves(cache)]
        self._kept: list[tuple[Any, dict[str, Any]]] = []
        self._offsets: list[tuple[Any, int]] = []
        for c in self._leaves:
            if type(c) in _TRIMMED:
                self._offsets.append((c, c.offset))
            elif type(c) is RotatingKVCache:
                self._kept.append((c, {"keys": c.keys, "values": c.values,
                                       "offset": c.offset, "_idx": c._idx}))  # fmt: skip
            elif type(c) is ArraysCache:
                assert c.left_padding is None and c.lengths is None, "a batched ArraysCache"
                self._kept.append((c, {"cache": list(c.cache)}))
            else:
                raise TypeError(f"no rollback for {type(c).__name__}")

    @property
    def trims_only(self) -> bool:
        """Whether every layer trims (no recurrent state): a rejection costs no replay."""
        return not any(type(c) is ArraysCache for c, _ in self._kept)

    def to(self, fed: int, keep: int) -> bool:
        """Keep the first `keep` of the `fed` tokens the pass fed. True when the caller must
        feed those `keep` tokens again: a state was put back to before the pass."""
        assert 0 < keep <= fed, (keep, fed)
        if keep == fed:
            return False
        if all(type(c) in _TRIMMED or c.is_trimmable() for c in self._leaves):
            for c in self._leaves:
                c.trim(fed - keep)
            return False
        for c, before in self._offsets:
            if type(c) in _TRIMMED:
                c.trim(c.offset - before)
        for c, state in self._kept:
            for name, value in state.items():
                setattr(c, name, value)
        return True
