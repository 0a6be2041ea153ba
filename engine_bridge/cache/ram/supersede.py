"""Session-aware eviction: which checkpoints a deeper one on the same path makes redundant.

A session grows one path turn after turn, leaving a checkpoint at every message boundary
and prompt end (66 MB each on a 30-layer Gated DeltaNet model). Once a deeper checkpoint
exists on that path, an older one is useful only to a request that leaves the path between
the two: it resumes from the deepest checkpoint at or before where it leaves. So for every
place some other stored path branches off (a sibling block, or a checkpoint whose tail
differs), the deepest older checkpoint at or before the branch stays live, and so does the
path's first message boundary (the end of the system prompt, where other sessions of the
same project will branch off later); every other older checkpoint is superseded.
Superseded checkpoints go to the head of the LRU queue (evicted before anyone's live state)
and are never written to SSD; one that a request reuses becomes live again.

A conversation also leaves its own tips behind: a new user message makes the chat template
re-render the turns since the previous one (older thinking stripped), so the next prompt
leaves the stored path inside a message and the old tip (a prompt end, with no live message
boundary past the fork) is a branch nobody returns to. Such a tip is superseded too, once
this path had gone past its first message before the fork; a branch that leaves at the
first message (another session sharing only the system prompt and tools) stays live.

It is structural, no session ids needed. Two things do not count as a branch: a
generation-end checkpoint (the state after the model's own output; the client's next turn
re-renders that output and leaves the path there, so it is a dead leaf, not a session),
and a branch of blocks that holds no live checkpoint, which a snapshot model cannot
resume from anyway and a paged one resumes from without any checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine_bridge.cache.hashing import BlockHash, Chain
from engine_bridge.cache.kinds import CheckpointReason
from engine_bridge.cache.ram.checkpoints import Checkpoint, CheckpointStore
from engine_bridge.cache.ram.pool import BlockPool

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
    branch needs, and the tips of branches this conversation left (module doc);
    generation-end checkpoints supersede nothing."""
    if newest.reason is CheckpointReason.GENERATION_END:
        return []
    bs, tokens, q = chain.block_size, chain.tokens, newest.position
    on_path: list[Checkpoint] = []
    # Where another stored path leaves this one, and its live checkpoints (None: too
    # large to walk, so taken for a live branch).
    branches: list[tuple[int, list[Checkpoint] | None]] = []
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
            elif ckpt.reason is not CheckpointReason.GENERATION_END and not ckpt.superseded:
                branches.append((start + common, [ckpt]))
        own = chain.hashes[a] if a < len(chain.hashes) else None
        for child in pool.children(anchor):
            if child.hash == own:
                continue
            live = _live_checkpoints(pool, checkpoints, child.hash)
            if live is None or live:
                branches.append((start + _common(child.tokens, window), live))
    on_path.sort(key=lambda c: c.position)
    keep: set[int] = set()
    # The shallowest message boundary stays: where the system prompt and tools end, the
    # point every other session of the same project leaves this path (most of them
    # arrive after this one has grown, when no branch is there yet to protect it).
    first = next((c for c in on_path if c.reason is CheckpointReason.BOUNDARY), None)
    if first is not None:
        keep.add(id(first))
    elif newest.reason is CheckpointReason.BOUNDARY:
        newest.first_boundary = True
    tips: list[Checkpoint] = []
    for b, live in branches:
        if live is not None and _left_tip(on_path, first, b, live):
            tips += live
            continue
        below = [c for c in on_path if c.position <= b]
        if below:
            keep.add(id(below[-1]))
    older = [c for c in on_path if id(c) not in keep]
    return [c for c in older + tips if c.ref_cnt == 0 and not c.superseded]


def _left_tip(
    on_path: list[Checkpoint], first: Checkpoint | None, at: int, live: list[Checkpoint]
) -> bool:
    """Whether a branch leaving this path at `at` with live checkpoints `live` is a tip
    this conversation left: it has no live message boundary past the fork (the fork is
    inside its last message, as when a turn re-renders the previous one), and this
    conversation had gone past its first message before the fork (a checkpoint other
    than a periodic one between the first boundary and the fork), so the branch is not
    another session that shares only the system prompt."""
    if first is None or any(c.reason is CheckpointReason.BOUNDARY for c in live):
        return False
    return any(
        first.position < c.position <= at and c.reason is not CheckpointReason.PERIODIC for c in on_path
    )


def _live_checkpoints(
    pool: BlockPool, checkpoints: CheckpointStore, root: BlockHash
) -> list[Checkpoint] | None:
    """The checkpoints in the subtree under block `root` that are neither generation ends
    nor superseded; None when it is too large to walk here."""
    stack, seen, live = [root], 0, []
    while stack:
        h = stack.pop()
        seen += 1
        if seen > _BRANCH_WALK_LIMIT:
            return None
        live += [
            c
            for c in checkpoints.at(h)
            if c.reason is not CheckpointReason.GENERATION_END and not c.superseded
        ]
        stack.extend(child.hash for child in pool.children(h))
    return live


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
