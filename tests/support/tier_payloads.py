"""Tiny block and checkpoint payloads for tests that drive the tiers directly."""

from __future__ import annotations

import mlx.core as mx

from engine_bridge import kv
from engine_bridge.cache.hashing import Chain

BS = 4


def block(i: int) -> kv.BlockPayload:
    x = mx.full((1, 1, BS, 8), float(i), dtype=mx.float16)
    return kv.BlockPayload(i * BS, BS, (kv.DenseKV(x, x),))


def checkpoint(position: int, state_width: int = 3) -> kv.CheckpointPayload:
    """A paged tail (when `position` is mid-block) plus one layer of recurrent state."""
    tail_len = position % BS
    tail = ()
    if tail_len:
        x = mx.full((1, 1, tail_len, 8), float(position), dtype=mx.float16)
        tail = (kv.DenseKV(x, x),)
    state = kv.ArraysState((mx.full((1, state_width), float(position)), None))
    return kv.CheckpointPayload(position, BS, tail, (state,))


def make_chain(tokens: list[int], extra: tuple) -> Chain:
    return Chain(tokens, BS, extra)
