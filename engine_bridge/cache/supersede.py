"""Session-aware eviction: which checkpoints a deeper one on the same path makes redundant.

A session grows one path turn after turn, leaving a checkpoint at every message boundary
and prompt end (66 MB each on a 30-layer Gated DeltaNet model). Once a deeper checkpoint
exists on that path, an older one is useful only to a request that leaves the path between
the two: it resumes from the deepest checkpoint at or before where it leaves. So for every
place some other stored path branches off (a sibling block, or a checkpoint whose tail
differs), the deepest older checkpoint at or before the branch stays live, and so does the
path's first message boundary (the end of the system prompt, where other sessions of the
same project will branch off later); every other older checkpoint is superseded. Superseded checkpoints go to the head of the LRU queue
(evicted before anyone's live state) and are never written to SSD; one that a request
reuses becomes live again.

It is structural, no session ids needed. Two things do not count as a branch: a
generation-end checkpoint (the state after the model's own output; the client's next turn
re-renders that output and leaves the path there, so it is a dead leaf, not a session),
and a branch of blocks that holds no other checkpoint, which a snapshot model cannot
resume from anyway and a paged one resumes from without any checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine_bridge.cache.checkpoints import Checkpoint, CheckpointStore
from engine_bridge.cache.hashing import BlockHash, Chain
from engine_bridge.cache.kinds import Reason
from engine_bridge.cache.pool import BlockPool

# Blocks visited below one sibling block before it is taken for a live branch unexamined.
_BRANCH_WALK_LIMIT = 256


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def superseded_by(
    pool: BlockPool, checkpoints: CheckpointStore, chain: Chain, newest: Checkpoint
) -> list[Checkpoint]:
    """The unreferenced, not yet superseded checkpoints on `chain` before `newest` that no
    branch needs (module doc); generation-end checkpoints supersede nothing."""
    if newest.reason is Reason.GENERATION_END:
        return []
    bs, tokens, q = chain.block_size, chain.tokens, newest.position
    on_path: list[Checkpoint] = []
    branches: list[int] = []  # positions where another live path leaves this one
    for a, anchor in enumerate(chain.anchors(q // bs)):
        start = a * bs
        window = tokens[start : start + bs]
        for ckpt in checkpoints.at(anchor):
            if ckpt is newest:
                continue
            common = _common(ckpt.tail, window)
            if common == len(ckpt.tail):
                if ckpt.position < q:
                    on_path.append(ckpt)
            elif ckpt.reason is not Reason.GENERATION_END:
                branches.append(start + common)
        own = chain.hashes[a] if a < len(chain.hashes) else None
        for child in pool.children(anchor):
            if child.hash != own and _holds_live_checkpoint(pool, checkpoints, child.hash):
                branches.append(start + _common(child.tokens, window))
    on_path.sort(key=lambda c: c.position)
    keep: set[int] = set()
    # The shallowest message boundary stays: where the system prompt and tools end, the
    # point every other session of the same project leaves this path (most of them
    # arrive after this one has grown, when no branch is there yet to protect it).
    first = next((c for c in on_path if c.reason is Reason.BOUNDARY), None)
    if first is not None:
        keep.add(id(first))
    elif newest.reason is Reason.BOUNDARY:
        newest.first_boundary = True
    for b in branches:
        below = [c for c in on_path if c.position <= b]
        if below:
            keep.add(id(below[-1]))
    return [c for c in on_path if id(c) not in keep and c.ref_cnt == 0 and not c.superseded]


def _holds_live_checkpoint(pool: BlockPool, checkpoints: CheckpointStore, root: BlockHash) -> bool:
    """Whether the subtree under block `root` holds a checkpoint other than a generation
    end; True as well when it is too large to walk here."""
    stack, seen = [root], 0
    while stack:
        h = stack.pop()
        seen += 1
        if seen > _BRANCH_WALK_LIMIT:
            return True
        if any(c.reason is not Reason.GENERATION_END for c in checkpoints.at(h)):
            return True
        stack.extend(child.hash for child in pool.children(h))
    return False


def mark_superseded(
    pool: BlockPool, checkpoints: CheckpointStore, chain: Chain, newest: Checkpoint
) -> int:
    """Mark what `newest` supersedes and queue it first for eviction; returns how many."""
    found = superseded_by(pool, checkpoints, chain, newest)
    queue = checkpoints.free_queue
    for ckpt in found:
        ckpt.superseded = True
        queue.remove(ckpt)
        queue.appendleft(ckpt)
    return len(found)
