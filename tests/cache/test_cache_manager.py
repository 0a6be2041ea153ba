import threading
from dataclasses import dataclass

import pytest

from engine_bridge.cache.hashing import Chain
from engine_bridge.cache.kinds import CheckpointReason, EntryKind
from engine_bridge.cache.ram.checkpoints import Checkpoint
from engine_bridge.cache.ram.manager import CacheManager, InsertResult
from engine_bridge.cache.ram.matching import Match
from engine_bridge.cache.ram.pool import Block

BS = 4
TENANT_A = (("model", "m"), ("tenant", "a"))
TENANT_B = (("model", "m"), ("tenant", "b"))


@dataclass(frozen=True, slots=True)
class FakePayload:
    nbytes: int
    label: str = ""


def cache(budget: int = 10**9, **kwargs) -> CacheManager:
    return CacheManager(budget, block_size=BS, **kwargs)


def chain(tokens, extra=()) -> Chain:
    return Chain(tokens, BS, extra)


def checkpoint(m: CacheManager, tokens, extra, payload, reason: str) -> InsertResult:
    """Insert a checkpoint after all of `tokens`."""
    at = Chain(tokens, m.block_size, extra)
    return m.insert_checkpoint(at, len(tokens), payload, CheckpointReason(reason))


def store(m: CacheManager, tokens, extra=(), nbytes: int = 10, label: str = "") -> None:
    """Insert every full block of `tokens`."""
    n = len(tokens) // BS
    m.insert_blocks(chain(tokens, extra), {i: FakePayload(nbytes, f"{label}{i}") for i in range(n)})


def restored(match: Match) -> list[int]:
    """The tokens a runner would restore from `match`, in order."""
    out: list[int] = []
    for block in match.blocks[:-1]:
        out += block.tokens
    if match.blocks:
        out += match.blocks[-1].tokens[: match.used_tokens]
    if match.checkpoint is not None:
        out += match.checkpoint.tail[: match.checkpoint_tokens]
    return out


def lru(m: CacheManager) -> list[str]:
    """The free queue, head (next evicted) first, as b<id> / c<position>."""
    return [
        f"b{e.block_id}" if isinstance(e, Block) else f"c{e.position}"
        for e in m._lru  # noqa: SLF001 - the queue order is the behaviour under test
    ]


SEQ = list(range(100, 112))  # three full blocks


# ---- paged matches ----------------------------------------------------------------------


def test_empty_cache_misses():
    match = cache().match(chain(SEQ), needs_checkpoint=False)
    assert (match.length, match.blocks, match.checkpoint, match.pinned) == (0, (), None, False)


def test_exact_repeat_leaves_one_token_to_prefill():
    m = cache()
    store(m, SEQ)
    match = m.match(chain(SEQ), needs_checkpoint=False)
    assert (match.length, len(match.blocks), match.used_tokens) == (11, 3, 3)
    assert restored(match) == SEQ[:11]


def test_prefix_request_cuts_a_cached_block():
    m = cache()
    store(m, SEQ)
    match = m.match(chain(SEQ[:6]), needs_checkpoint=False)
    assert (match.length, len(match.blocks), match.used_tokens) == (5, 2, 1)
    assert restored(match) == SEQ[:5]


def test_supersequence_request_restores_all_cached_blocks():
    m = cache()
    store(m, SEQ[:8])
    match = m.match(chain(SEQ + [1, 2, 3]), needs_checkpoint=False)
    assert (match.length, len(match.blocks), match.used_tokens) == (8, 2, 4)


def test_block_boundary_request_does_not_restore_a_useless_block():
    m = cache()
    store(m, SEQ)
    match = m.match(chain(SEQ[:9]), needs_checkpoint=False)
    assert (match.length, len(match.blocks), match.used_tokens) == (8, 2, 4)


def test_divergence_mid_block_uses_common_prefix_of_cached_block():
    m = cache()
    store(m, SEQ)
    request = SEQ[:6] + [7, 7, 7, 7, 7, 7]
    match = m.match(chain(request), needs_checkpoint=False)
    assert (match.length, len(match.blocks), match.used_tokens) == (6, 2, 2)
    assert match.blocks[1].tokens == tuple(SEQ[4:8])
    assert restored(match) == request[:6]


def test_divergence_in_first_block_uses_common_prefix():
    m = cache()
    store(m, [1, 2, 3, 4])
    match = m.match(chain([1, 2, 9, 9, 9]), needs_checkpoint=False)
    assert (match.length, len(match.blocks), match.used_tokens) == (2, 1, 2)


def test_longest_sibling_wins_inside_a_block():
    m = cache()
    store(m, [1, 2, 3, 4, 5, 6, 0, 0])
    store(m, [1, 2, 3, 4, 5, 6, 7, 0])
    store(m, [1, 2, 3, 4, 5, 0, 0, 0])
    match = m.match(chain([1, 2, 3, 4, 5, 6, 7, 9, 9]), needs_checkpoint=False)
    assert (match.length, match.blocks[-1].tokens) == (7, (5, 6, 7, 0))


def test_checkpoint_tail_extends_a_paged_match_and_can_be_cut():
    m = cache()
    store(m, SEQ[:4])
    checkpoint(m, SEQ[:7], (), FakePayload(5), "prompt_end")
    longer = m.match(chain(SEQ), needs_checkpoint=False)
    assert (longer.length, len(longer.blocks), longer.checkpoint_tokens) == (7, 1, 3)
    assert longer.checkpoint.position == 7
    edited = m.match(chain(SEQ[:6] + [0, 0]), needs_checkpoint=False)
    assert (edited.length, edited.checkpoint_tokens) == (6, 2)
    assert restored(edited) == SEQ[:6]


def test_tie_between_block_and_checkpoint_tail_goes_to_the_block():
    m = cache()
    store(m, SEQ[:8])
    checkpoint(m, SEQ[:7], (), FakePayload(5), "boundary")
    match = m.match(chain(SEQ[:6] + [0, 0]), needs_checkpoint=False)
    assert (match.length, match.checkpoint, len(match.blocks)) == (6, None, 2)


def test_hole_in_the_chain_stops_the_walk():
    m = cache()
    m.insert_blocks(chain(SEQ), {0: FakePayload(1), 2: FakePayload(1)})
    match = m.match(chain(SEQ + [0]), needs_checkpoint=False)
    assert (match.length, len(match.blocks)) == (4, 1)


@pytest.mark.parametrize("request_tokens", [[], [100]])
def test_one_token_or_less_restores_nothing(request_tokens):
    m = cache()
    store(m, SEQ)
    checkpoint(m, SEQ[:1], (), FakePayload(1), "boundary")
    for needs in (False, True):
        assert m.match(chain(request_tokens), needs_checkpoint=needs).length == 0


# ---- checkpoint matches -----------------------------------------------------------------


def test_snapshot_model_needs_a_checkpoint_to_hit():
    m = cache()
    store(m, SEQ)
    assert m.match(chain(SEQ), needs_checkpoint=True).length == 0


def test_snapshot_model_resumes_at_deepest_checkpoint_on_its_path():
    m = cache()
    store(m, SEQ)
    for position in (3, 6, 10):
        checkpoint(m, SEQ[:position], (), FakePayload(5), "boundary")
    deeper = m.match(chain(SEQ + [1]), needs_checkpoint=True)
    assert (deeper.length, len(deeper.blocks), deeper.checkpoint.position) == (10, 2, 10)
    assert deeper.checkpoint_tokens == 2 and restored(deeper) == SEQ[:10]
    # A prompt ending exactly at a checkpoint must prefill its last token, so one back.
    assert m.match(chain(SEQ[:10]), needs_checkpoint=True).length == 6
    diverged = m.match(chain(SEQ[:8] + [0, 0, 0]), needs_checkpoint=True)
    assert (diverged.length, len(diverged.blocks)) == (6, 1)


def test_checkpoint_at_block_boundary_has_empty_tail():
    m = cache()
    store(m, SEQ)
    checkpoint(m, SEQ[:8], (), FakePayload(5), "prompt_end")
    match = m.match(chain(SEQ), needs_checkpoint=True)
    assert (match.length, len(match.blocks), match.checkpoint.tail) == (8, 2, ())


def test_checkpoint_is_unusable_while_its_blocks_are_missing():
    m = cache()
    m.insert_blocks(chain(SEQ), {0: FakePayload(1), 2: FakePayload(1)})
    checkpoint(m, SEQ[:2], (), FakePayload(5), "boundary")
    checkpoint(m, SEQ[:10], (), FakePayload(5), "boundary")
    assert m.match(chain(SEQ), needs_checkpoint=True).length == 2


def test_checkpoint_on_another_branch_is_not_used():
    m = cache()
    store(m, SEQ)
    checkpoint(m, SEQ[:6], (), FakePayload(5), "boundary")
    assert m.match(chain(SEQ[:5] + [0, 0, 0]), needs_checkpoint=True).length == 0


# ---- tenants and dedupe -----------------------------------------------------------------


def test_tenants_with_identical_tokens_share_nothing():
    m = cache()
    store(m, SEQ, TENANT_A)
    checkpoint(m, SEQ[:6], TENANT_A, FakePayload(5), "boundary")
    for needs in (False, True):
        assert m.match(chain(SEQ, TENANT_B), needs_checkpoint=needs).length == 0
        assert m.match(chain(SEQ), needs_checkpoint=needs).length == 0
    store(m, SEQ, TENANT_B)
    stats = m.stats()
    assert (stats.blocks, stats.dedupe_hits) == (6, 0)
    a = m.match(chain(SEQ, TENANT_A), needs_checkpoint=False)
    b = m.match(chain(SEQ, TENANT_B), needs_checkpoint=False)
    assert not {x.block_id for x in a.blocks} & {x.block_id for x in b.blocks}


def test_reinserting_blocks_keeps_existing_payloads_and_counts_dedupe():
    m = cache()
    store(m, SEQ, label="first")
    result = m.insert_blocks(chain(SEQ + [0] * 4), {i: FakePayload(10, "second") for i in range(4)})
    assert (result.inserted, result.deduped) == (1, 3)
    match = m.match(chain(SEQ), needs_checkpoint=False)
    assert [b.payload.label for b in match.blocks] == ["first0", "first1", "first2"]
    stats = m.stats()
    assert (stats.blocks, stats.bytes, stats.dedupe_hits) == (4, 40, 3)


def test_reinserted_entries_become_most_recently_used():
    m = cache()
    store(m, SEQ[:4])
    store(m, [5] * 4)
    checkpoint(m, SEQ[:2], (), FakePayload(5), "boundary")
    checkpoint(m, [5, 5], (), FakePayload(5), "boundary")
    assert lru(m) == ["b0", "b1", "c2", "c2"]
    store(m, SEQ[:4])
    checkpoint(m, SEQ[:2], (), FakePayload(5), "boundary")
    assert lru(m) == ["b1", "c2", "b0", "c2"]
    assert [e.tail for e in m._lru if isinstance(e, Checkpoint)] == [(5, 5), (100, 101)]  # noqa: SLF001


def test_shared_system_prompt_is_stored_once_for_many_sessions():
    m = cache()
    system = list(range(8))
    matches = []
    for session in range(100):
        store(m, system + [session] * 4)
        match = m.match(chain(system + [session] * 4 + [0]), needs_checkpoint=False)
        assert m.acquire(match)
        matches.append(match)
    assert m.stats().blocks == 2 + 100
    assert [b.ref_cnt for b in matches[0].blocks] == [100, 100, 1]
    for match in matches:
        m.release(match)
    assert [b.ref_cnt for b in matches[0].blocks] == [0, 0, 0]


def test_insert_of_block_beyond_the_sequence_is_rejected():
    with pytest.raises(AssertionError, match="block 3 of a 12-token"):
        cache().insert_blocks(chain(SEQ), {3: FakePayload(1)})


# ---- pinning and eviction ---------------------------------------------------------------


def test_insert_queues_deepest_first_and_release_returns_deepest_first():
    m = cache()
    store(m, SEQ)
    # Inserted deepest first: block ids run backwards along the chain.
    match = m.match(chain(SEQ), needs_checkpoint=False)
    assert [b.block_id for b in match.blocks] == [2, 1, 0]
    assert lru(m) == ["b0", "b1", "b2"]
    checkpoint(m, SEQ[:10], (), FakePayload(5), "boundary")
    match = m.match(chain(SEQ), needs_checkpoint=True)
    assert m.acquire(match)
    assert [b.ref_cnt for b in match.blocks] == [1, 1] and match.checkpoint.ref_cnt == 1
    assert lru(m) == ["b0"]
    m.release(match)
    assert lru(m) == ["b0", "c10", "b1", "b2"]


def test_budget_evicts_least_recently_used_leaf_first():
    evicted = []
    m = cache(30, on_evict=lambda entry: evicted.append((entry.kind, entry.tokens)))
    a, b = SEQ, [5] * 12
    store(m, a)
    store(m, b)
    assert evicted == [
        ("blocks", tuple(a[8:12])),
        ("blocks", tuple(a[4:8])),
        ("blocks", tuple(a[:4])),
    ]
    stats = m.stats()
    assert (stats.blocks, stats.bytes, stats.evicted_blocks, stats.evicted_bytes) == (3, 30, 3, 30)


def test_pinned_entries_survive_budget_pressure():
    m = cache(30)
    store(m, SEQ)
    match = m.match(chain(SEQ), needs_checkpoint=False)
    assert m.acquire(match)
    store(m, [5] * 12)
    stats = m.stats()
    assert (stats.blocks, stats.bytes, stats.pinned_bytes) == (3, 30, 30)
    assert m.match(chain(SEQ), needs_checkpoint=False).length == 11
    m.release(match)


def test_over_budget_from_pins_is_repaid_on_release():
    m = cache(20)
    store(m, SEQ[:8])
    match = m.match(chain(SEQ[:8]), needs_checkpoint=False)
    assert m.acquire(match)
    checkpoint(m, SEQ[:7], (), FakePayload(10), "boundary")
    assert m.stats().bytes == 20
    m.insert_blocks(chain(SEQ), {2: FakePayload(10)})
    assert m.stats().bytes == 20
    m.release(match)
    assert m.stats().bytes <= 20


def test_acquire_fails_after_the_match_was_evicted():
    m = cache(30)
    store(m, SEQ)
    match = m.match(chain(SEQ), needs_checkpoint=False)
    store(m, [5] * 12)
    assert m.acquire(match) is False
    assert not match.pinned


def test_on_evict_reports_checkpoint_anchor_and_tail_after_unlocking():
    seen = []

    def on_evict(entry):
        seen.append((entry.kind, entry.anchor, entry.tail, entry.payload, m.stats().checkpoints))

    m = cache(10, on_evict=on_evict)
    payload = FakePayload(10)
    checkpoint(m, SEQ[:6], (), payload, "boundary")
    checkpoint(m, [1], (), FakePayload(10), "boundary")
    anchor = chain(SEQ).hashes[0]
    assert seen == [(EntryKind.CHECKPOINT, anchor, tuple(SEQ[4:6]), payload, 1)]


def test_failing_spill_is_counted_and_the_cache_stays_usable():
    def on_evict(*_):
        raise OSError("disk full")

    m = cache(30, on_evict=on_evict)
    store(m, SEQ)
    store(m, [5] * 12)
    stats = m.stats()
    assert (stats.spill_errors, stats.evicted_blocks, stats.blocks) == (3, 3, 3)
    assert m.match(chain([5] * 12), needs_checkpoint=False).length == 11


def test_reserve_evicts_for_promotion_and_refuses_beyond_pins():
    m = cache(100)
    store(m, SEQ[:8], nbytes=25)
    pinned = m.match(chain(SEQ[:8] + [0]), needs_checkpoint=False)
    assert m.acquire(pinned)
    store(m, [5] * 8, nbytes=20)
    assert m.reserve(60) is False
    assert m.stats().blocks == 4
    assert m.reserve(45) is True
    stats = m.stats()
    # Room for 45 more means evicting both unpinned 20-byte blocks, not just one.
    assert (stats.blocks, stats.bytes, stats.reserved_bytes, stats.reserve_failures) == (
        2,
        50,
        45,
        1,
    )
    store(m, [6] * 4, nbytes=5)
    assert m.stats().bytes + m.stats().reserved_bytes <= 100
    m.unreserve(45)
    assert m.stats().reserved_bytes == 0
    with pytest.raises(AssertionError, match="unreserve 1 of 0"):
        m.unreserve(1)


# ---- checkpoint thinning ----------------------------------------------------------------


def positions(m: CacheManager, tokens, extra=()) -> list[tuple[int, str]]:
    """Every stored checkpoint on `tokens`'s path, as (position, reason)."""
    found = []
    for position in range(1, len(tokens) + 1):
        match = m.match(chain(tokens[:position] + [-1 & 0xFFFF], extra), needs_checkpoint=True)
        if match.length == position:
            found.append((position, match.checkpoint.reason))
    return found


def test_newer_checkpoint_thins_periodic_ones_before_it_and_keeps_boundaries():
    m = cache()
    store(m, SEQ)
    checkpoint(m, SEQ[:2], (), FakePayload(5), "periodic")
    checkpoint(m, SEQ[:3], (), FakePayload(5), "boundary")
    checkpoint(m, SEQ[:5], (), FakePayload(5), "periodic")
    assert positions(m, SEQ) == [(3, "boundary"), (5, "periodic")]
    result = checkpoint(m, SEQ[:9], (), FakePayload(5), "periodic")
    assert result.thinned == 1
    checkpoint(m, SEQ[:11], (), FakePayload(5), "prompt_end")
    assert positions(m, SEQ) == [(3, "boundary"), (11, "prompt_end")]
    assert m.stats().thinned_checkpoints == 3


def test_thinning_spares_other_branches_and_pinned_checkpoints():
    m = cache()
    other = SEQ[:5] + [0] * 7
    store(m, SEQ)
    store(m, other)
    checkpoint(m, other[:7], (), FakePayload(5), "periodic")
    checkpoint(m, SEQ[:2], (), FakePayload(5), "periodic")
    pinned = m.match(chain(SEQ[:3]), needs_checkpoint=True)
    assert m.acquire(pinned) and pinned.checkpoint.position == 2
    checkpoint(m, SEQ[:10], (), FakePayload(5), "generation_end")
    assert positions(m, other) == [(2, "periodic"), (7, "periodic")]
    m.release(pinned)
    assert positions(m, SEQ) == [(2, "periodic"), (10, "generation_end")]
    checkpoint(m, SEQ[:11], (), FakePayload(5), "prompt_end")
    assert positions(m, SEQ) == [(10, "generation_end"), (11, "prompt_end")]


def test_boundary_at_a_periodic_position_upgrades_it_and_counts_dedupe():
    m = cache()
    store(m, SEQ)
    first = FakePayload(5, "periodic")
    checkpoint(m, SEQ[:6], (), first, "periodic")
    result = checkpoint(m, SEQ[:6], (), FakePayload(5, "boundary"), "boundary")
    assert (result.inserted, result.deduped) == (0, 1)
    checkpoint(m, SEQ[:9], (), FakePayload(5), "periodic")
    match = m.match(chain(SEQ[:7]), needs_checkpoint=True)
    assert (match.checkpoint.reason, match.checkpoint.payload) == ("boundary", first)


def test_thinning_can_be_turned_off():
    m = cache(thin_periodic=False)
    store(m, SEQ)
    for position in (2, 5, 9):
        checkpoint(m, SEQ[:position], (), FakePayload(5), "periodic")
    assert [p for p, _ in positions(m, SEQ)] == [2, 5, 9]


def test_checkpoint_reason_must_be_a_reason():
    with pytest.raises(AssertionError, match="'boundary' is not a CheckpointReason"):
        cache().insert_checkpoint(chain(SEQ), len(SEQ), FakePayload(1), "boundary")
    with pytest.raises(ValueError, match="'sometimes'"):
        CheckpointReason("sometimes")


# ---- stats and threads ------------------------------------------------------------------


def test_stats_read_from_another_thread_while_the_worker_mutates():
    m = cache(400)
    stop = threading.Event()
    snapshots = []

    def reader():
        while not stop.is_set():
            snapshots.append(m.stats())

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for i in range(300):
            tokens = [i % 7] * 8 + [i] * 8
            store(m, tokens)
            match = m.match(chain(tokens), needs_checkpoint=False)
            if m.acquire(match):
                m.release(match)
    finally:
        stop.set()
        thread.join()
    assert snapshots
    for s in snapshots:
        assert s.bytes == s.block_bytes + s.checkpoint_bytes
        assert s.bytes == 10 * s.blocks
        assert s.bytes <= 400 or s.pinned_bytes
