"""The ranks this process runs with, and the few ways they agree.

Every rank runs the same model calls in the same order: a sharded layer's `all_sum` waits
for every rank. So whatever decides a call (which requests run, how much the cache gives)
is decided once and shared: rank 0 sends a decision (`share`), or every rank offers what
it can do and all take the least (`least`). Each is one or two collectives, so both sides
must reach it at the same point of their program.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeVar

import mlx.core as mx

T = TypeVar("T")


class Mode(StrEnum):
    """How the model is split: by heads within each layer, or by layers."""

    TENSOR = "tensor"  # model.shard(group): every rank holds its heads of every layer
    PIPELINE = "pipeline"  # model.model.pipeline(group): every rank holds its own layers


class Backend(StrEnum):
    RING = "ring"  # TCP: Ethernet, Wi-Fi, Thunderbolt bridge, or loopback
    JACCL = "jaccl"  # RDMA over Thunderbolt 5


@dataclass(frozen=True, slots=True)
class World:
    """This process's place among the ranks; `size` 1 is a single process."""

    group: Any  # mx.distributed.Group, or None alone
    rank: int
    size: int
    mode: Mode = Mode.TENSOR

    @property
    def alone(self) -> bool:
        return self.size <= 1

    @property
    def leader(self) -> bool:
        """Rank 0: it answers HTTP and decides for every rank."""
        return self.rank == 0

    @property
    def layout(self) -> str:
        """Which part of a model this rank holds: "tensor 0/2" (heads), "pipeline 1/2"."""
        return f"{self.mode} {self.rank}/{self.size}"

    def fingerprint(self, whole: str) -> str:
        """The cache's name for this rank's part of a model whose whole is `whole`: every
        tier keys entries by it, so a slice is only ever restored into the same part of
        the same split (the same rank of the same layout), never into a whole model or
        another rank's. Alone, the whole model's name, unchanged."""
        if self.alone:
            return whole
        return hashlib.sha256(f"{whole}\0{self.layout}".encode()).hexdigest()[:32]

    def share(self, obj: T | None) -> T | None:
        """Rank 0's `obj`, on every rank (others pass None). Pickled: only plain data. An
        empty list reaches the others as None (it costs one collective, not two)."""
        if self.alone:
            return obj
        if self.leader:
            # Nothing to send (a step with no new operations: most decode steps): the size
            # alone, 0, which followers read as None; one collective instead of two.
            data = pickle.dumps(obj) if obj is not None and obj != [] else b""
            # One collective at a time, in the followers' order: evaluated together, the
            # two could be scheduled the other way round, and every rank would wait.
            mx.eval(mx.distributed.all_sum(mx.array(len(data), dtype=mx.int32), group=self.group))
            if data:
                payload = mx.array(memoryview(data), dtype=mx.uint8)
                mx.eval(mx.distributed.all_sum(payload, group=self.group))
            return obj
        size = mx.distributed.all_sum(mx.array(0, dtype=mx.int32), group=self.group).item()
        if not size:
            return None
        payload = mx.distributed.all_sum(mx.zeros(int(size), dtype=mx.uint8), group=self.group)
        return pickle.loads(bytes(memoryview(payload)))

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, by rank, on every rank (pickled: only plain data). Two
        collectives: the sizes, then one buffer where each rank fills its own span."""
        if self.alone:
            return [obj]
        data = pickle.dumps(obj)
        sizes = [0] * self.size
        sizes[self.rank] = len(data)
        sizes = mx.distributed.all_sum(mx.array(sizes, dtype=mx.int32), group=self.group)
        sizes = sizes.tolist()
        start = sum(sizes[: self.rank])
        buffer = bytearray(sum(sizes))
        buffer[start : start + len(data)] = data
        mine = mx.array(memoryview(buffer), dtype=mx.uint8)
        every = bytes(memoryview(mx.distributed.all_sum(mine, group=self.group)))
        offsets = [sum(sizes[:r]) for r in range(self.size)]
        return [pickle.loads(every[o : o + n]) for o, n in zip(offsets, sizes, strict=True)]

    def least(self, value: int) -> int:
        """The smallest of every rank's `value`: what all of them can do."""
        if self.alone:
            return value
        out = mx.distributed.all_min(mx.array(value, dtype=mx.int32), group=self.group)
        return int(out.item())

    def deepest_common(self, positions: Sequence[int], limit: int = 64) -> int:
        """The deepest position every rank can resume a prompt at, 0 if none: rank 0 offers
        its `limit` deepest, each rank marks those it holds, and all keep the deepest one
        every rank marked. A hybrid model resumes only at its checkpoints, and a rank that
        lost one (a file gone, a smaller RAM share) must not leave the others ahead."""
        if self.alone:
            return max(positions, default=0)
        offered = self.share(sorted(set(positions), reverse=True)[:limit] if self.leader else None)
        offered = offered or []
        held = set(positions)
        # The same length on every rank (rank 0's list, or one 0 for an empty one).
        marks = mx.array([int(p in held) for p in offered] or [0], dtype=mx.int32)
        agreed = mx.distributed.all_min(marks, group=self.group).tolist()
        # An empty offer sent one placeholder mark: zip stops at the offer.
        return next((p for p, ok in zip(offered, agreed, strict=False) if ok), 0)

    def all_ok(self, ok: bool) -> bool:
        """Whether every rank says `ok`."""
        return self.least(1 if ok else 0) == 1


ALONE = World(None, 0, 1)


class RankLost(RuntimeError):
    """A link between the ranks broke, or a rank stopped answering: the world cannot take
    another step together, and its requests end (503). The ranks are started again."""


def link_failed(error: BaseException) -> bool:
    """Whether `error` is MLX's distributed backend saying a link to a rank broke."""
    return isinstance(error, RuntimeError) and str(error).startswith(("[ring]", "[jaccl]"))


def peers(world: World) -> str:
    """The ranks rank 0 waits on, named for an error: "rank 1", "one of ranks 1-3"."""
    return "rank 1" if world.size == 2 else f"one of ranks 1-{world.size - 1}"


def join(mode: Mode | str = Mode.TENSOR) -> World:
    """The world `mlx.launch` started this process in (its environment says which); a
    process started alone is a world of one."""
    if not _launched():
        return ALONE
    group = mx.distributed.init(strict=True)
    return World(group, group.rank(), group.size(), Mode(mode))


def _launched() -> bool:
    # mlx.launch gives every rank its number (and the ring or jaccl backend its peers).
    return "MLX_RANK" in os.environ
