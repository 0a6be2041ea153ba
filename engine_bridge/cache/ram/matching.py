"""Lookup: the deepest position a request can resume from, given what the RAM tier holds.

Exact, prefix, supersequence and longest-common-prefix hits are all one walk: follow the
request's hash chain over full blocks, then compare tokens inside the first block that is
not cached against the cached blocks and checkpoint tails that hang from the same anchor.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_bridge.cache.hashing import Chain, common_prefix
from engine_bridge.cache.ram.checkpoints import Checkpoint, CheckpointStore
from engine_bridge.cache.ram.pool import Block, BlockPool


@dataclass(slots=True)
class Match:
    """Where a request resumes: restore `blocks`, then `checkpoint`, and prefill from `length`.

    All blocks are full except that only `used_tokens` of the last are used. With a
    checkpoint, the blocks are all full and the checkpoint covers `checkpoint_tokens` tokens
    past them: its whole tail when the match asked for a checkpoint, else possibly a prefix
    of its paged tail (paged layers can be cut anywhere).
    """

    length: int
    blocks: tuple[Block, ...]
    used_tokens: int
    checkpoint: Checkpoint | None
    checkpoint_tokens: int
    pinned: bool = False

    @property
    def diverged(self) -> bool:
        """Whether the request left a cached entry part way (not merely ran past its end).

        Meaningful for a paged match (no checkpoint required), which is a longest common
        prefix with what RAM holds.
        """
        if self.checkpoint is not None:
            return self.checkpoint_tokens < len(self.checkpoint.tail)
        return bool(self.blocks) and self.used_tokens < len(self.blocks[-1].tokens)


_Found = tuple[int, list[Block], int, Checkpoint | None, int]


def find_match(
    pool: BlockPool, checkpoints: CheckpointStore, chain: Chain, needs_checkpoint: bool
) -> Match:
    """The deepest restorable position P < len(chain), so at least one token is prefilled."""
    present = _cached_run(pool, chain)
    find = _at_checkpoint if needs_checkpoint else _paged
    return _match(chain, find(pool, checkpoints, chain, present))


def find_matches(
    pool: BlockPool, checkpoints: CheckpointStore, chain: Chain, needs_checkpoint: bool
) -> tuple[Match, Match]:
    """`find_match`, and the paged longest common prefix with what RAM holds (the same
    Match when no checkpoint is needed), from one walk of the chain: what a lookup reports
    and what promotion pins."""
    present = _cached_run(pool, chain)
    prefix = _match(chain, _paged(pool, checkpoints, chain, present))
    if not needs_checkpoint:
        return prefix, prefix
    return _match(chain, _at_checkpoint(pool, checkpoints, chain, present)), prefix


def _cached_run(pool: BlockPool, chain: Chain) -> list[Block]:
    """The leading blocks of the chain the pool holds."""
    present: list[Block] = []
    for block_hash in chain.hashes:
        block = pool.get(block_hash)
        if block is None:
            break
        present.append(block)
    return present


def _match(chain: Chain, found: _Found) -> Match:
    length, blocks, used, ckpt, ckpt_tokens = found
    if not blocks:
        used = 0
    covered = (len(blocks) - 1) * chain.block_size + used if blocks else 0
    assert covered + ckpt_tokens == length, (
        f"match of {length} tokens covers {covered} + {ckpt_tokens}"
    )
    return Match(length, tuple(blocks), used, ckpt, ckpt_tokens)


def _paged(
    pool: BlockPool, checkpoints: CheckpointStore, chain: Chain, present: list[Block]
) -> _Found:
    tokens, bs = chain.tokens, chain.block_size
    limit = len(tokens) - 1
    full = min(len(present), limit // bs) if limit > 0 else 0
    if full < len(present):
        # The last prompt token falls inside a cached chain block: cut it there.
        used = limit - full * bs
        if used:
            return limit, present[: full + 1], used, None, 0
        return limit, present[:full], bs, None, 0
    # The chain ends at a hole or at the prompt's partial tail: the longest common prefix
    # with any cached block or checkpoint tail under the same anchor extends it.
    start = full * bs
    window = tokens[start : min(start + bs, limit)]
    anchor = chain.anchor(full)
    best, best_block, best_ckpt = 0, None, None
    if window:
        for child in pool.children(anchor):
            k = common_prefix(child.tokens, window)
            if k > best:
                best, best_block = k, child
        # Ties go to the block: it restores without touching a checkpoint's snapshot state.
        for ckpt in checkpoints.at(anchor):
            k = common_prefix(ckpt.tail, window)
            if k > best:
                best, best_block, best_ckpt = k, None, ckpt
    if best_block is not None:
        return start + best, [*present[:full], best_block], best, None, 0
    return start + best, present[:full], bs, best_ckpt, best


def _at_checkpoint(
    pool: BlockPool, checkpoints: CheckpointStore, chain: Chain, present: list[Block]
) -> _Found:
    tokens, bs = chain.tokens, chain.block_size
    limit = len(tokens) - 1
    if limit <= 0:
        return 0, [], 0, None, 0
    # Deeper anchors give deeper positions, so the first anchor (deepest down) with a usable
    # checkpoint holds the answer.
    for i in range(min(len(present), limit // bs), -1, -1):
        start = i * bs
        best = None
        for ckpt in checkpoints.at(chain.anchor(i)):
            end = start + len(ckpt.tail)
            if end > limit or (best is not None and len(ckpt.tail) <= len(best.tail)):
                continue
            if tokens[start:end] == ckpt.tail:
                best = ckpt
        if best is not None:
            return best.position, present[:i], bs, best, len(best.tail)
    return 0, [], 0, None, 0
