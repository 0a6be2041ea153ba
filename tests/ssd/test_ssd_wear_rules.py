"""SSD wear on a snapshot (hybrid) model: the rules that keep a session's writes near its
final KV plus one checkpoint. A tip the conversation left is superseded, a reused
checkpoint waits like a new one, periodic checkpoints go to disk only as far apart as the
crash promise needs, and blocks are written with the checkpoints that need them.

Real CacheManager, SSDStore on a temporary folder and kv's codec, as in test_ssd_wear;
only the model is absent (payloads are built directly).
"""

from __future__ import annotations

from engine_bridge import kv
from engine_bridge.cache.checkpoint_writes import DeferredStats, DeferredWrites
from engine_bridge.cache.hashing import Chain
from engine_bridge.cache.kinds import CheckpointReason, EntryKind
from engine_bridge.cache.ram.manager import CacheManager
from engine_bridge.cache.ssd.index import Scope
from engine_bridge.cache.ssd.store import SSDConfig, SSDStore
from engine_bridge.cache.tiers import TieredCache
from engine_bridge.cache.write_policy import WritePolicy
from tests.support import tier_payloads
from tests.support.tier_payloads import BS, block, make_chain

SCOPE = Scope("model-r")
EXTRA = (("model", "model-r"), ("tenant", "default"))
TOKENS = list(range(500, 530))  # 7 full blocks and 2 tokens
HOUR = 3600.0


def checkpoint(position: int) -> kv.CheckpointPayload:
    return tier_payloads.checkpoint(position, state_width=64)


def chain(tokens=TOKENS) -> Chain:
    return make_chain(tokens, EXTRA)


def open_ssd(root) -> SSDStore:
    return SSDStore(SSDConfig(root=root, reconcile="off"))


def hybrid_tiers(ssd, delay: float = HOUR, every: int | None = None) -> TieredCache:
    ram = CacheManager(1 << 30, block_size=BS)
    t = TieredCache(
        ram,
        ssd,
        kv.HostCodec(),
        policy=WritePolicy.THROUGH,
        checkpoint_delay_s=delay,
        periodic_write_every=every,
    )
    # What the engine does first for every request of a snapshot model.
    t.catch_up(SCOPE, needs_checkpoint=True)
    return t


def store(t: TieredCache, c: Chain, *points: tuple[int, CheckpointReason]) -> None:
    """Store the blocks up to the deepest point, then the checkpoints, as a prefill does."""
    deepest = max(p for p, _ in points)
    t.store_blocks(c, SCOPE, {i: block(i) for i in range(deepest // BS)})
    for p, reason in points:
        t.store_checkpoint(c, SCOPE, p, checkpoint(p), reason)


def superseded(t: TieredCache) -> set[int]:
    return {e.position for e in t.ram.entries() if getattr(e, "superseded", False)}


def checkpoints_on_disk(ssd: SSDStore, c: Chain, positions) -> set[int]:
    assert ssd.flush(30.0)
    keys = [c.checkpoint_key(p) for p in positions]
    found = ssd.contains_many(SCOPE, EntryKind.CHECKPOINT, keys)
    return {p for p, present in zip(positions, found, strict=True) if present}


def blocks_on_disk(ssd: SSDStore, c: Chain) -> list[bool]:
    assert ssd.flush(30.0)
    return ssd.contains_many(SCOPE, EntryKind.BLOCK, c.hashes)


def resume(t: TieredCache, c: Chain) -> int:
    """A request for `c` restores what it can and lets go (its prefill is not run)."""
    t.catch_up(SCOPE, needs_checkpoint=True)
    match = t.pin(t.lookup(c, SCOPE, needs_checkpoint=True), promoted=False)
    if match.pinned:
        t.ram.release(match)
    return match.length


def test_a_tip_the_conversation_left_inside_its_last_message_is_superseded(tmp_path):
    turns = chain()
    # The next user message re-renders the last turn: the prompt leaves the path at 10,
    # inside the message after the prompt end at 9, and grows past the old tip at 17.
    rerendered = chain(TOKENS[:10] + list(range(900, 920)))
    with open_ssd(tmp_path) as ssd:
        t = hybrid_tiers(ssd)
        store(t, turns, (5, CheckpointReason.BOUNDARY), (9, CheckpointReason.PROMPT_END))
        store(t, turns, (13, CheckpointReason.BOUNDARY), (17, CheckpointReason.PROMPT_END))
        assert superseded(t) == {9, 13}
        assert resume(t, rerendered) == 9  # live again, and held back like a new one
        assert ssd.flush(30.0)  # the writer would have had time for it meanwhile
        assert superseded(t) == {13}
        store(t, rerendered, (14, CheckpointReason.BOUNDARY), (22, CheckpointReason.PROMPT_END))
        # 17 is a tip nobody returns to; without it no branch needs 9 any more.
        assert superseded(t) == {9, 13, 14, 17}
        t.deferred.flush(everything=True)  # what close does first
        assert checkpoints_on_disk(ssd, turns, (5, 9, 13, 17)) == {5}
        assert checkpoints_on_disk(ssd, rerendered, (14, 22)) == {22}


def test_a_warm_ups_guess_supersedes_nothing_so_the_prompt_end_still_reaches_disk(tmp_path):
    # A request ends at 9; warm-ahead then prefills its guess of the next question past
    # it (the model's own output, then a question). The real next turn is a tool round,
    # which leaves that path at 10: it resumes at 9, after a restart too. Seen in the
    # distributed bench: a restart resumed 2,911 tokens back instead of 4,202.
    turns = chain()
    with open_ssd(tmp_path) as ssd:
        t = hybrid_tiers(ssd)
        store(t, turns, (5, CheckpointReason.BOUNDARY), (9, CheckpointReason.PROMPT_END))
        t.store_blocks(turns, SCOPE, {i: block(i) for i in range(17 // BS)})
        t.store_checkpoint(turns, SCOPE, 17, checkpoint(17), CheckpointReason.PROMPT_END,
                           supersedes=False)  # fmt: skip
        assert superseded(t) == set()
        t.deferred.flush(everything=True)  # what close does first
        assert checkpoints_on_disk(ssd, turns, (5, 9, 17)) == {5, 9, 17}
    # Without the flag a deeper prompt end on the path supersedes 9, as a real turn's does.
    with open_ssd(tmp_path / "real") as ssd:
        t = hybrid_tiers(ssd)
        store(t, turns, (5, CheckpointReason.BOUNDARY), (9, CheckpointReason.PROMPT_END))
        store(t, turns, (17, CheckpointReason.PROMPT_END))
        assert 9 in superseded(t)


def test_a_session_that_shares_only_the_first_message_keeps_its_tip(tmp_path):
    first = chain()
    # Another session: the same system prompt (up to 5), then its own first message.
    other = chain(TOKENS[:6] + list(range(900, 920)))
    with open_ssd(tmp_path) as ssd:
        t = hybrid_tiers(ssd)
        store(t, first, (5, CheckpointReason.BOUNDARY), (9, CheckpointReason.PROMPT_END))
        assert resume(t, other) == 5
        store(t, other, (12, CheckpointReason.BOUNDARY), (20, CheckpointReason.PROMPT_END))
        assert superseded(t) == {12}
        t.deferred.flush(everything=True)  # what close does first
        assert checkpoints_on_disk(ssd, first, (5, 9)) == {5, 9}
        assert checkpoints_on_disk(ssd, other, (12, 20)) == {20}


def test_periodic_checkpoints_reach_disk_only_as_far_apart_as_a_crash_may_lose(tmp_path):
    long = chain(list(range(600, 645)))  # 11 full blocks and 1 token
    every = 16  # 8 intervals of 2 tokens
    with open_ssd(tmp_path) as ssd:
        t = hybrid_tiers(ssd, every=every)
        points = [(3, CheckpointReason.BOUNDARY)] + [
            (p, CheckpointReason.PERIODIC) for p in range(4, 45, 2)
        ]
        store(t, long, *points)
        written = checkpoints_on_disk(ssd, long, [p for p, _ in points])
        # From the first boundary at 3: the last periodic one before 3 + 16 is 18, then 34.
        # A fixed every-16th rule would have written 16 and 32 instead.
        assert written == {3, 18, 34}
        # The promise: a crash anywhere in the prefill resumes at most 16 tokens back.
        for crash in range(3, 45):
            assert crash - max(p for p in written if p <= crash) <= every


def test_a_prefill_counts_its_periodic_writes_from_where_it_resumed(tmp_path):
    tokens = list(range(600, 645))
    every = 16
    with open_ssd(tmp_path) as ssd:
        t = hybrid_tiers(ssd, every=every)
        first = chain(tokens[:21])
        store(
            t, first, (3, CheckpointReason.BOUNDARY), (20, CheckpointReason.PROMPT_END)
        )  # 20 is held back
        # The next turn resumes at 20: its own prefill loses at most 16 tokens to a crash
        # with 36 on disk; counted from the first boundary (3), 22 would be due already.
        nxt = chain(tokens)
        assert resume(t, nxt) == 20
        store(t, nxt, *[(p, CheckpointReason.PERIODIC) for p in range(22, 45, 2)])
        assert checkpoints_on_disk(ssd, nxt, range(3, 45)) == {3, 36}


def test_a_snapshot_models_blocks_are_written_with_the_checkpoints_that_need_them(tmp_path):
    c = chain()
    with open_ssd(tmp_path) as ssd:
        t = hybrid_tiers(ssd)
        t.store_blocks(c, SCOPE, {i: block(i) for i in range(7)})
        assert blocks_on_disk(ssd, c) == [False] * 7
        t.store_checkpoint(c, SCOPE, 9, checkpoint(9), CheckpointReason.BOUNDARY)
        # The first boundary goes at once, and the two blocks under it with it.
        assert blocks_on_disk(ssd, c) == [True] * 2 + [False] * 5
        t.store_checkpoint(c, SCOPE, 22, checkpoint(22), CheckpointReason.PROMPT_END)
        assert blocks_on_disk(ssd, c) == [True] * 2 + [False] * 5  # 22 is held back
        t.deferred.flush(everything=True)  # what close does first
        # Blocks 5 and 6 lie past every written checkpoint: never written.
        assert blocks_on_disk(ssd, c) == [True] * 5 + [False] * 2
    with open_ssd(tmp_path / "paged") as ssd:
        ram = CacheManager(1 << 30, block_size=BS)
        paged = TieredCache(ram, ssd, kv.HostCodec(), policy=WritePolicy.THROUGH)
        paged.catch_up(SCOPE, needs_checkpoint=False)
        paged.store_blocks(c, SCOPE, {i: block(i) for i in range(7)})
        assert blocks_on_disk(ssd, c) == [True] * 7  # a paged model's go through at once


def test_a_restart_never_resumes_from_a_checkpoint_whose_blocks_are_missing(tmp_path):
    c = chain()
    with open_ssd(tmp_path) as ssd:
        t = hybrid_tiers(ssd, delay=0.0)
        store(t, c, (5, CheckpointReason.BOUNDARY), (22, CheckpointReason.PROMPT_END))
        t.close(30.0)
    with open_ssd(tmp_path) as ssd:
        # Block 3 (under 22, past 5) goes missing from the disk.
        gone = c.hashes[3]
        assert ssd.delete(lambda idx: idx.select(SCOPE, EntryKind.BLOCK, [gone]))[0] == 1
        t = TieredCache(CacheManager(1 << 30, block_size=BS), ssd, kv.HostCodec())
        hit = t.lookup(chain(TOKENS + [1]), SCOPE, needs_checkpoint=True)
        assert hit.length == 5
        assert t.promote(hit)
        assert resume(t, chain(TOKENS + [1])) == 5


def test_a_held_back_write_that_comes_due_goes_out_on_the_mlx_thread(tmp_path):
    c = chain()
    with open_ssd(tmp_path) as ssd:
        t = hybrid_tiers(ssd, delay=0.001)
        asked = []
        t.call_on_mlx = asked.append  # the engine passes its scheduler's `call`
        store(t, c, (5, CheckpointReason.BOUNDARY), (22, CheckpointReason.PROMPT_END))
        while not t.deferred.due():
            pass
        t.writes.tick()  # the SSD writer's tick: it converts nothing itself
        t.writes.tick()  # one call at a time
        assert len(asked) == 1 and checkpoints_on_disk(ssd, c, (5, 22)) == {5}
        asked[0]()  # what the MLX thread runs
        assert checkpoints_on_disk(ssd, c, (5, 22)) == {5, 22}
        assert blocks_on_disk(ssd, c) == [True] * 5 + [False] * 2


def test_a_held_back_checkpoint_waits_from_the_end_of_its_request(tmp_path):
    c = chain()
    now = [0.0]
    with open_ssd(tmp_path) as ssd:
        t = hybrid_tiers(ssd)
        t.writes.deferred = DeferredWrites(10.0, clock=lambda: now[0])
        store(t, c, (5, CheckpointReason.BOUNDARY), (22, CheckpointReason.PROMPT_END))
        now[0] = 8.0  # the model generates for 8 s, then the request ends
        t.store_checkpoint(c, SCOPE, 26, checkpoint(26), CheckpointReason.GENERATION_END)
        now[0] = 12.0  # 12 s after the prompt end, 4 s after the request
        t.deferred.flush()
        assert checkpoints_on_disk(ssd, c, (5, 22)) == {5}
        now[0] = 18.0
        t.deferred.flush()
        assert checkpoints_on_disk(ssd, c, (5, 22)) == {5, 22}


def test_held_back_writes_are_bounded_and_the_oldest_go_out_early(tmp_path):
    """Five sessions' prompt ends wait for an hour; past the count bound (3), then the
    byte bound (two snapshots' host bytes), the oldest are written now, and counted."""
    sessions = [chain(list(range(1000 * k, 1000 * k + 30))) for k in range(1, 6)]
    with open_ssd(tmp_path) as ssd:
        t = hybrid_tiers(ssd)
        t.writes.deferred = DeferredWrites(HOUR, max_held=3)
        for c in sessions:
            store(t, c, (5, CheckpointReason.BOUNDARY), (22, CheckpointReason.PROMPT_END))
        one = t.deferred.nbytes // 3
        assert t.stats().writes.deferred == DeferredStats(
            held=3, held_bytes=3 * one, max_held=3, max_held_bytes=1 << 30, dropped=0, early=2
        )
        on_disk = [checkpoints_on_disk(ssd, c, (5, 22)) for c in sessions]
        assert on_disk == [{5, 22}, {5, 22}, {5}, {5}, {5}]

        t.writes.deferred = DeferredWrites(HOUR, max_bytes=2 * one + one // 2)
        more = [chain(list(range(1000 * k, 1000 * k + 30))) for k in range(6, 9)]
        for c in more:
            store(t, c, (5, CheckpointReason.BOUNDARY), (22, CheckpointReason.PROMPT_END))
        assert (t.deferred.stats().held, t.deferred.stats().early) == (2, 1)
        assert [checkpoints_on_disk(ssd, c, (5, 22)) for c in more] == [{5, 22}, {5}, {5}]


def test_past_the_bound_a_superseded_held_write_is_dropped_before_any_goes_early(tmp_path):
    turns = chain()
    with open_ssd(tmp_path) as ssd:
        t = hybrid_tiers(ssd)
        t.writes.deferred = DeferredWrites(HOUR, max_held=2)
        store(t, turns, (5, CheckpointReason.BOUNDARY), (9, CheckpointReason.PROMPT_END))
        store(t, turns, (13, CheckpointReason.BOUNDARY), (17, CheckpointReason.PROMPT_END))
        assert superseded(t) == {9, 13}
        stats = t.deferred.stats()
        assert (stats.held, stats.dropped, stats.early) == (2, 1, 0)
        assert checkpoints_on_disk(ssd, turns, (5, 9, 13, 17)) == {5}
