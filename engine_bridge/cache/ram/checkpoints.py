"""Checkpoints: layer state valid only at one exact token position, and how they are thinned.

A checkpoint at position P is keyed by its anchor (the hash of the last full block before P,
or the chain root when P < block_size) and its tail (the tokens from that block's start to
P, fewer than block_size). It holds the snapshot layers' state (SSM, wrapped sliding window)
and the paged layers' partial tail block, so it can sit at any position.

Thinning policy. Inserting a checkpoint at P drops every unreferenced *periodic* checkpoint
that lies earlier on the same token path. Periodic checkpoints exist so a long prefill can
resume part way; once a deeper checkpoint covers the same path, only a request diverging
between the two would want the older one, and the message boundaries (`boundary`,
`prompt_end`, `generation_end`), which are never thinned, are the better resume points for
that. So each branch keeps its newest periodic checkpoint plus all its boundaries; the
memory budget then evicts by LRU like any other entry.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import ClassVar

from engine_bridge.cache.hashing import BlockHash, Chain, checkpoint_key
from engine_bridge.cache.kinds import CheckpointReason, EntryKind
from engine_bridge.cache.ram.pool import GroupedStore, Linked


@dataclass(slots=True, eq=False)
class Checkpoint:
    """State at exactly `position` tokens: `tail` tokens past the full blocks under `anchor`."""

    kind: ClassVar[EntryKind] = EntryKind.CHECKPOINT
    ckpt_id: int
    key: BlockHash
    anchor: BlockHash
    tail: tuple[int, ...]
    position: int
    reason: CheckpointReason
    payload: object = field(repr=False)
    nbytes: int
    ref_cnt: int = 0
    reads: int = 0  # lookups that restored it (halved each time eviction spares it)
    # A deeper checkpoint on the same path makes this one redundant (supersede.py).
    superseded: bool = False
    # The first message boundary on its path (the system prompt's end): never superseded,
    # and written to SSD at once, since every session of a project resumes there.
    first_boundary: bool = False
    prev_free: Linked | None = field(default=None, repr=False)
    next_free: Linked | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        return (
            f"Checkpoint(id={self.ckpt_id}, position={self.position}, reason={self.reason}, "
            f"anchor={self.anchor.hex()[:12]}, nbytes={self.nbytes}, ref_cnt={self.ref_cnt})"
        )


class CheckpointStore(GroupedStore):
    """Checkpoints by key and by anchor, sharing the block pool's LRU free queue."""

    @staticmethod
    def key_of(entry: Checkpoint) -> BlockHash:
        return entry.key

    @staticmethod
    def group_of(entry: Checkpoint) -> BlockHash:
        return entry.anchor

    def at(self, anchor: BlockHash) -> Collection[Checkpoint]:
        return self.group(anchor)

    def insert(
        self,
        anchor: BlockHash,
        tail: tuple[int, ...],
        position: int,
        reason: CheckpointReason,
        payload: object,
        nbytes: int,
    ) -> tuple[Checkpoint, bool]:
        """The checkpoint at (anchor, tail) and whether it is new; an existing one wins.

        A boundary reason upgrades an existing periodic checkpoint so thinning spares it.
        """
        assert isinstance(reason, CheckpointReason), f"checkpoint reason {reason!r} is not a CheckpointReason"
        key = checkpoint_key(anchor, tail)
        ckpt = self._by_key.get(key)
        if ckpt is not None:
            assert ckpt.position == position, f"{ckpt!r} found for position {position}"
            if ckpt.reason is CheckpointReason.PERIODIC:
                ckpt.reason = reason
            return ckpt, False
        ckpt = Checkpoint(self._next_id, key, anchor, tail, position, reason, payload, nbytes)
        self._next_id += 1
        self._add(ckpt)
        return ckpt, True

    def on_path(self, chain: Chain, lo: int, hi: int) -> list[Checkpoint]:
        """The checkpoints on `chain` at positions in (lo, hi], shallowest first."""
        bs, tokens, found = chain.block_size, chain.tokens, []
        for a in range(max(0, lo // bs), min(hi, len(chain)) // bs + 1):
            start = a * bs
            for ckpt in self.at(chain.anchor(a)):
                if lo < ckpt.position <= hi and tokens[start : ckpt.position] == ckpt.tail:
                    found.append(ckpt)
        return sorted(found, key=lambda c: c.position)

    def thin(self, chain: Chain, newest: Checkpoint) -> list[Checkpoint]:
        """Remove unreferenced periodic checkpoints before `newest` on `chain` (module doc)."""
        thinned = []
        tokens, bs = chain.tokens, chain.block_size
        for i, anchor in enumerate(chain.anchors(newest.position // bs)):
            start = i * bs
            for ckpt in list(self.at(anchor)):
                if (
                    ckpt.reason is CheckpointReason.PERIODIC
                    and ckpt.ref_cnt == 0
                    and ckpt.position < newest.position
                    and tokens[start : start + len(ckpt.tail)] == ckpt.tail
                ):
                    self.remove(ckpt)
                    ckpt.superseded = True  # so a write still waiting for it is dropped
                    thinned.append(ckpt)
        return thinned
