"""What the cache stores per block and per checkpoint: immutable arrays plus their byte size."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import mlx.core as mx


def _nbytes(*arrays: mx.array | None) -> int:
    # Shape × dtype only: never forces a lazy array to evaluate.
    return sum(a.size * a.itemsize for a in arrays if a is not None)


@dataclass(slots=True)
class DenseKV:
    """Keys and values of one paged layer for a token range, shape (B, heads, tokens, dim)."""

    keys: mx.array
    values: mx.array

    @property
    def tokens(self) -> int:
        return self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        return _nbytes(self.keys, self.values)


@dataclass(slots=True)
class QuantKV:
    """Affine-quantized keys and values, each (packed uint32, scales, biases)."""

    keys: tuple[mx.array, mx.array, mx.array]
    values: tuple[mx.array, mx.array, mx.array]
    group_size: int
    bits: int

    @property
    def tokens(self) -> int:
        return self.keys[0].shape[2]

    @property
    def nbytes(self) -> int:
        return _nbytes(*self.keys, *self.values)


PagedKV = DenseKV | QuantKV


@dataclass(slots=True)
class ArraysState:
    """An ArraysCache's arrays (e.g. conv and recurrent state), None where never written."""

    arrays: tuple[mx.array | None, ...]

    @property
    def nbytes(self) -> int:
        return _nbytes(*self.arrays)


@dataclass(slots=True)
class RotatingState:
    """A RotatingKVCache's buffers and cursor, as the live cache would resume from them."""

    keys: mx.array
    values: mx.array
    offset: int
    idx: int
    keep: int
    max_size: int

    @property
    def nbytes(self) -> int:
        return _nbytes(self.keys, self.values)


Snapshot = ArraysState | RotatingState


class PayloadKind(StrEnum):
    """What a stored payload is, as its metadata spells it on SSD and in the shared store."""

    BLOCK = "block"
    CHECKPOINT = "checkpoint"


@dataclass(slots=True)
class BlockPayload:
    """Paged layers' K/V for tokens [start, start + tokens), in layout order."""

    start: int
    tokens: int
    kv: tuple[PagedKV, ...]

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.kv)


@dataclass(slots=True)
class CheckpointPayload:
    """State at exactly `position`: snapshot layers in full, plus the paged layers' tail
    [tail_start, position), which is empty when `position` is block-aligned."""

    position: int
    block_size: int
    tail: tuple[PagedKV, ...]
    snapshots: tuple[Snapshot, ...]

    @property
    def tail_start(self) -> int:
        return self.position - self.position % self.block_size

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.tail) + sum(s.nbytes for s in self.snapshots)


Payload = BlockPayload | CheckpointPayload


def arrays_of(parts: tuple[PagedKV | Snapshot, ...] | list[PagedKV | Snapshot]) -> list[mx.array]:
    """Every array held by `parts`, for one batched `mx.eval`."""
    out: list[mx.array] = []
    for p in parts:
        match p:
            case DenseKV(keys=k, values=v) | RotatingState(keys=k, values=v):
                out += (k, v)
            case QuantKV(keys=k, values=v):
                out += (*k, *v)
            case ArraysState(arrays=a):
                out += [x for x in a if x is not None]
    return out
