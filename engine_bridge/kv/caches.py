"""mlx-lm cache objects ⇄ block and checkpoint payloads.

The only file that knows mlx-lm's cache classes and their `state`: a new mlx-lm version is a
change here and nowhere else. Everything stored is an independent, evaluated copy: the live
cache keeps being written in place (`KVCache.update_and_fetch` slice-assigns into a buffer
padded to 256 steps), and a stored slice must neither see those writes nor pin that buffer.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import Enum, StrEnum
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from engine_bridge.kv.payloads import (
    ArraysState,
    BlockPayload,
    CheckpointPayload,
    DenseKV,
    PagedKV,
    QuantKV,
    RotatingState,
    Snapshot,
    arrays_of,
)


class UnsupportedCacheError(TypeError):
    """The model uses an mlx-lm cache class this module cannot page or snapshot."""


# --- layout -------------------------------------------------------------------------------


class Kind(Enum):
    PAGED = "paged"
    SNAPSHOT = "snapshot"


# RotatingKVCache is always a snapshot, never paged while it has not wrapped. Its windows
# (128 to 1024 tokens in shipped models) are far shorter than the agent prompts this proxy
# exists for, so a paged phase would serve only the first few blocks, and it would make the
# layout depend on the position instead of only on the model. A snapshot is exact at every
# position and bounded by the window (see `_rotating_state`).
_KINDS: dict[type, Kind] = {
    KVCache: Kind.PAGED,
    QuantizedKVCache: Kind.PAGED,
    ArraysCache: Kind.SNAPSHOT,
    RotatingKVCache: Kind.SNAPSHOT,
}


class CacheKind(StrEnum):
    """What a model's cache is made of, as users see it (`mlx-prompt-cache models`)."""

    PLAIN = "plain"  # all K/V: any prefix restores
    HYBRID = "hybrid"  # SSM or linear-attention state: restores at checkpoints only
    SLIDING = "sliding"  # rotating-window layers: restores at checkpoints only
    UNKNOWN = "unknown"  # not loaded yet and not told by its config, or not cacheable


@dataclass(frozen=True, slots=True)
class Slot:
    """One leaf cache: `path` is (layer,) or (layer, sub, ...) inside a CacheList."""

    path: tuple[int, ...]
    kind: Kind
    cache_type: str


@dataclass(frozen=True, slots=True)
class Layout:
    slots: tuple[Slot, ...]

    @property
    def paged(self) -> tuple[Slot, ...]:
        return tuple(s for s in self.slots if s.kind is Kind.PAGED)

    @property
    def snapshots(self) -> tuple[Slot, ...]:
        return tuple(s for s in self.slots if s.kind is Kind.SNAPSHOT)

    @property
    def has_snapshots(self) -> bool:
        return any(s.kind is Kind.SNAPSHOT for s in self.slots)

    @property
    def cache_kind(self) -> CacheKind:
        types = {s.cache_type for s in self.snapshots}
        if ArraysCache.__name__ in types:
            return CacheKind.HYBRID
        if RotatingKVCache.__name__ in types:
            return CacheKind.SLIDING
        return CacheKind.PLAIN


def _leaves(
    cache: Sequence[Any], prefix: tuple[int, ...] = ()
) -> Iterator[tuple[tuple[int, ...], Any]]:
    for i, c in enumerate(cache):
        if isinstance(c, CacheList):
            yield from _leaves(c.caches, (*prefix, i))
        else:
            yield (*prefix, i), c


def _kind(c: Any) -> Kind:
    # Exact type: a subclass may change what `state` means.
    kind = _KINDS.get(type(c))
    if kind is None:
        raise UnsupportedCacheError(f"no paged or snapshot form for {type(c).__name__}")
    return kind


def layout(cache: Sequence[Any]) -> Layout:
    """Per leaf cache (CacheLists flattened), whether it is paged or a snapshot."""
    return Layout(tuple(Slot(p, _kind(c), type(c).__name__) for p, c in _leaves(cache)))


def _paged_leaves(cache: Sequence[Any]) -> list[Any]:
    return [c for _, c in _leaves(cache) if _kind(c) is Kind.PAGED]


def _snapshot_leaves(cache: Sequence[Any]) -> list[Any]:
    return [c for _, c in _leaves(cache) if _kind(c) is Kind.SNAPSHOT]


# --- extraction ---------------------------------------------------------------------------


def _copy(x: mx.array) -> mx.array:
    # mx.array(x) always allocates: mx.contiguous(x) would share the buffer of an already
    # contiguous slice (e.g. one head, or a conv state cut from a longer activation) and pin
    # all of it.
    return mx.array(x)


def _slice_kv(c: Any, start: int, end: int) -> PagedKV:
    def cut(x: mx.array) -> mx.array:
        return _copy(x[..., start:end, :])

    if isinstance(c, QuantizedKVCache):
        return QuantKV(
            tuple(cut(x) for x in c.keys), tuple(cut(x) for x in c.values), c.group_size, c.bits
        )
    return DenseKV(cut(c.keys), cut(c.values))


def extract_blocks(
    cache: Sequence[Any], start_block: int, end_block: int, block_size: int = 64
) -> list[BlockPayload]:
    """Paged layers' K/V for each full block in [start_block, end_block), as evaluated copies."""
    assert 0 <= start_block <= end_block, f"bad block range [{start_block}, {end_block})"
    paged = _paged_leaves(cache)
    end = end_block * block_size
    for c in paged:
        assert c.offset >= end, f"{type(c).__name__} holds {c.offset} tokens, blocks need {end}"
    blocks = []
    for b in range(start_block, end_block):
        s = b * block_size
        kv = tuple(_slice_kv(c, s, s + block_size) for c in paged)
        mx.eval(arrays_of(kv))
        blocks.append(BlockPayload(s, block_size, kv))
    return blocks


def _rotating_state(c: RotatingKVCache) -> RotatingState:
    keys, values, idx = c.keys, c.values, c._idx
    width = c.max_size - c.keep
    if c.offset >= c.max_size and idx == keys.shape[2] > c.max_size:
        # A multi-token update leaves max_size + S - 1 tokens in temporal order. The next
        # update of either kind keeps only the first `keep` and the last `max_size - keep`
        # of them, then proceeds as from a full buffer with _idx == max_size: store just that.
        def window(x: mx.array) -> mx.array:
            return mx.concatenate([x[..., : c.keep, :], x[..., idx - width :, :]], axis=2)

        keys, values, idx = window(keys), window(values), c.max_size
    return RotatingState(_copy(keys), _copy(values), c.offset, idx, c.keep, c.max_size)


def _snapshot(c: Any) -> Snapshot:
    if isinstance(c, RotatingKVCache):
        return _rotating_state(c)
    assert c.left_padding is None and c.lengths is None, (
        f"batched ArraysCache (left_padding={c.left_padding}, lengths={c.lengths})"
    )
    return ArraysState(tuple(None if a is None else _copy(a) for a in c.cache))


def extract_checkpoint(
    cache: Sequence[Any], position: int, block_size: int = 64
) -> CheckpointPayload:
    """Evaluated copies of the state at `position`, which must be where the cache stands."""
    assert position > 0, f"checkpoint at position {position}"
    leaves = [c for _, c in _leaves(cache)]
    for c in leaves:
        offset = getattr(c, "offset", position)
        assert offset == position, f"{type(c).__name__} is at {offset}, not {position}"
    tail_start = position - position % block_size
    tail = ()
    if tail_start < position:
        tail = tuple(_slice_kv(c, tail_start, position) for c in _paged_leaves(cache))
    snapshots = tuple(_snapshot(c) for c in _snapshot_leaves(cache))
    mx.eval(arrays_of([*tail, *snapshots]))
    return CheckpointPayload(position, block_size, tail, snapshots)


# --- restore ------------------------------------------------------------------------------


def _fresh(x: mx.array) -> mx.array:
    # A new array node over the same buffer: the live cache slice-assigns into what it holds,
    # which rewrites that node, so it must never hold the stored payload's own node.
    return mx.contiguous(x)


def _dense(p: PagedKV) -> tuple[mx.array, mx.array]:
    if isinstance(p, DenseKV):
        return p.keys, p.values

    def deq(q: tuple[mx.array, mx.array, mx.array]) -> mx.array:
        return mx.dequantize(*q, group_size=p.group_size, bits=p.bits)

    return deq(p.keys), deq(p.values)


def _quant(p: PagedKV, group_size: int, bits: int) -> tuple[tuple[mx.array, ...], ...]:
    if isinstance(p, QuantKV):
        assert (p.group_size, p.bits) == (group_size, bits), (
            f"stored q{p.bits}g{p.group_size}, cache wants q{bits}g{group_size}"
        )
        return p.keys, p.values
    return tuple(mx.quantize(x, group_size=group_size, bits=bits) for x in (p.keys, p.values))


def _join(parts: Sequence[mx.array], length: int) -> mx.array:
    return mx.concatenate(list(parts), axis=2)[..., :length, :]


def _restore_paged(c: Any, pieces: Sequence[PagedKV], length: int) -> None:
    if isinstance(c, QuantizedKVCache):
        qs = [_quant(p, c.group_size, c.bits) for p in pieces]
        c.keys = tuple(_join([q[0][i] for q in qs], length) for i in range(3))
        c.values = tuple(_join([q[1][i] for q in qs], length) for i in range(3))
    else:
        kvs = [_dense(p) for p in pieces]
        c.keys = _join([k for k, _ in kvs], length)
        c.values = _join([v for _, v in kvs], length)
    c.offset = length


def _restore_snapshot(c: Any, s: Snapshot, position: int) -> None:
    match c, s:
        case RotatingKVCache(), RotatingState():
            assert (c.max_size, c.keep) == (s.max_size, s.keep), (
                f"window {c.max_size}/keep {c.keep} vs stored {s.max_size}/{s.keep}"
            )
            assert s.offset == position, f"rotating state at {s.offset}, not {position}"
            c.keys, c.values = _fresh(s.keys), _fresh(s.values)
            c.offset, c._idx = s.offset, s.idx
        case ArraysCache(), ArraysState():
            assert len(c.cache) == len(s.arrays), f"{len(c.cache)} arrays vs {len(s.arrays)}"
            c.cache = [None if a is None else _fresh(a) for a in s.arrays]
        case _:
            raise AssertionError(f"{type(c).__name__} cannot take {type(s).__name__}")


def restore(
    model: Any,
    blocks: Sequence[BlockPayload],
    length: int,
    checkpoint: CheckpointPayload | None = None,
    *,
    cache: list[Any] | None = None,
) -> list[Any]:
    """A fresh cache list in the state of one that has prefilled exactly `length` tokens.

    Paged layers come from `blocks` (then the checkpoint's tail), snapshot layers from the
    checkpoint, which must sit at `length` (or, for a model without snapshot layers, no more
    than one partial block past it). `cache` is an empty cache list to fill
    (default `make_prompt_cache(model)`); its paged classes decide the stored form: a
    KVCache dequantizes quantized blocks, a QuantizedKVCache quantizes dense ones.
    """
    cache = make_prompt_cache(model) if cache is None else cache
    lay = layout(cache)
    assert all(c.empty() for _, c in _leaves(cache)), "restore needs an empty cache list"
    if checkpoint is not None:
        # Without snapshot layers a checkpoint's tail is plain K/V, so any prefix of it serves.
        lo = checkpoint.position if lay.has_snapshots else checkpoint.tail_start
        assert lo <= length <= checkpoint.position, (
            f"checkpoint at {checkpoint.position}, restoring {length}"
        )
        bs = checkpoint.block_size
        full = checkpoint.tail_start // bs
    else:
        assert not lay.has_snapshots, f"{len(lay.snapshots)} snapshot layers need a checkpoint"
        bs = blocks[0].tokens if blocks else 0
        full = -(-length // bs) if bs else 0
    assert len(blocks) >= full, f"{len(blocks)} blocks, {full} needed for {length} tokens"
    blocks = blocks[:full]
    for i, b in enumerate(blocks):
        assert (b.start, b.tokens) == (i * bs, bs), f"block {i} is {b.start}+{b.tokens}, bs {bs}"
    if length == 0:
        return cache

    paged = _paged_leaves(cache)
    tail = checkpoint.tail if checkpoint is not None else ()
    for b in blocks:
        assert len(b.kv) == len(paged), f"block has {len(b.kv)} layers, cache {len(paged)}"
    assert len(tail) in (0, len(paged)), f"tail has {len(tail)} layers, cache {len(paged)}"
    for j, c in enumerate(paged):
        pieces = [b.kv[j] for b in blocks] + ([tail[j]] if tail else [])
        assert sum(p.tokens for p in pieces) >= length, f"layer {j}: pieces too short"
        _restore_paged(c, pieces, length)
    if checkpoint is not None:
        snaps = _snapshot_leaves(cache)
        assert len(snaps) == len(checkpoint.snapshots), (
            f"{len(snaps)} snapshot layers, checkpoint has {len(checkpoint.snapshots)}"
        )
        for c, s in zip(snaps, checkpoint.snapshots, strict=True):
            _restore_snapshot(c, s, length)
    return cache


# --- optional storage quantization ----------------------------------------------------------


def quantize_block(block: BlockPayload, *, bits: int = 8, group_size: int = 64) -> BlockPayload:
    """A lossy, smaller copy of `block` (off unless the caller asks; restoring into a KVCache
    dequantizes). Layers whose head dim is not a multiple of `group_size` stay dense."""

    def q(p: PagedKV) -> PagedKV:
        if (
            isinstance(p, QuantKV)
            or p.keys.shape[-1] % group_size
            or p.values.shape[-1] % group_size
        ):
            return p
        k, v = (mx.quantize(x, group_size=group_size, bits=bits) for x in (p.keys, p.values))
        return QuantKV(tuple(k), tuple(v), group_size, bits)

    kv = tuple(q(p) for p in block.kv)
    mx.eval(arrays_of(kv))
    return BlockPayload(block.start, block.tokens, kv)
