"""The tiers as one cache: one lookup over RAM and SSD, promotion in runs, typed stats.

Real CacheManager, real SSDStore on a temporary folder, real K/V payloads through kv's
codec; only the model is absent (payloads are built directly).
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from engine_bridge import kv
from engine_bridge.cache.hashing import Chain
from engine_bridge.cache.kinds import CheckpointReason, EntryKind
from engine_bridge.cache.ram.manager import CacheManager, CacheStats
from engine_bridge.cache.ssd import files as ssd_files
from engine_bridge.cache.ssd.index import Scope
from engine_bridge.cache.ssd.store import SSDConfig, SSDStats, SSDStore
from engine_bridge.cache.tiers import TieredCache
from tests.support.tier_payloads import BS, block, checkpoint, make_chain

SCOPE = Scope("model-t")
EXTRA = (("model", "model-t"), ("tenant", "default"))
TOKENS = list(range(200, 230))  # 7 full blocks and 2 tokens


def chain(tokens=TOKENS) -> Chain:
    return make_chain(tokens, EXTRA)


@pytest.fixture
def ssd(tmp_path):
    store = SSDStore(SSDConfig(root=tmp_path, reconcile="off"))
    yield store
    store.close()


def tiers(ssd: SSDStore | None, *, write_through: bool = False) -> TieredCache:
    return TieredCache(
        CacheManager(1 << 30, block_size=BS), ssd, kv.HostCodec(), write_through=write_through
    )


def write(ssd: SSDStore, blocks: range = range(7), checkpoints: tuple[int, ...] = ()) -> None:
    """Put blocks and checkpoints of TOKENS on disk, through a write-through tier."""
    writer = tiers(ssd, write_through=True)
    c = chain()
    writer.store_blocks(c, SCOPE, {i: block(i) for i in blocks})
    for p in checkpoints:
        writer.store_checkpoint(c, SCOPE, p, checkpoint(p), CheckpointReason.BOUNDARY)
        # Written before the next one supersedes it (superseded ones are never written).
        assert ssd.flush(30.0)
    assert ssd.flush(30.0)


def test_chain_hashes_match_the_whole_sequence_however_it_is_extended():
    whole = chain()
    for cut in (0, 1, 3, 4, 5, 17, 29):
        grown = chain(TOKENS[:cut])
        grown.extend(TOKENS[cut:])
        assert (grown.tokens, grown.hashes) == (whole.tokens, whole.hashes)
    assert whole.checkpoint_key(9) == chain(TOKENS[:9]).checkpoint_key(9)


def test_lookup_says_how_far_ram_and_ram_plus_ssd_reach(ssd):
    write(ssd)
    t = tiers(ssd)
    c = chain()
    t.store_blocks(c, SCOPE, {i: block(i) for i in range(3)})
    hit = t.lookup(c, SCOPE, needs_checkpoint=False)
    assert (hit.ram_length, hit.length) == (12, 28)  # blocks only: no checkpoint for the tail
    assert hit.ssd is not None and hit.ssd.blocks == (3, 4, 5, 6)
    assert ssd.stats().hits == 0  # a lookup reads the index, never a file


def test_promotion_reads_the_run_and_inserts_it_in_one_call(ssd):
    write(ssd)
    t = tiers(ssd)
    inserts = []
    insert = t.ram.insert_blocks
    t.ram.insert_blocks = lambda c, payloads: (
        inserts.append(sorted(payloads)) or insert(c, payloads)
    )
    c = chain()
    hit = t.lookup(c, SCOPE, needs_checkpoint=False)
    assert hit.ram_length == 0 and t.promote(hit)
    assert inserts == [list(range(7))]
    match = t.ram.match(c, needs_checkpoint=False)
    assert match.length == 28  # seven full blocks; no checkpoint holds the partial tail
    assert all(b.payload.on_ssd for b in match.blocks)
    assert ssd.stats().hits == 7 and t.ram.stats().reserved_bytes == 0


def test_pin_reuses_the_lookups_match_and_rematches_after_a_promotion(ssd):
    write(ssd)
    t = tiers(ssd)
    c = chain()
    t.store_blocks(c, SCOPE, {i: block(i) for i in range(3)})
    hit = t.lookup(c, SCOPE, needs_checkpoint=False)
    held = t.pin(hit, promoted=False)
    assert held is hit.ram and held.pinned and t.ram.stats().pinned_bytes > 0
    t.ram.release(held)
    assert t.promote(hit)
    promoted = t.pin(hit, promoted=True)
    assert (promoted.length, promoted.pinned) == (hit.length, True)
    t.ram.release(promoted)
    assert t.ram.stats().pinned_bytes == 0


def test_cold_prompt_finds_nothing_and_plans_no_read(ssd):
    write(ssd)
    hit = tiers(ssd).lookup(chain(list(range(900, 930))), SCOPE, needs_checkpoint=False)
    assert (hit.ram_length, hit.length, hit.ssd, hit.diverged_at) == (0, 0, None, None)


def test_snapshot_model_plans_the_deepest_checkpoint_and_falls_back_past_a_corrupt_one(
    ssd, tmp_path: Path
):
    write(ssd, checkpoints=(9, 22))
    t = tiers(ssd)
    c = chain()
    hit = t.lookup(c, SCOPE, needs_checkpoint=True)
    assert hit.ssd is not None and (hit.length, hit.ssd.checkpoint) == (22, 22)
    assert hit.ssd.blocks == (0, 1, 2, 3, 4)
    path = ssd_files.entry_path(
        tmp_path, (SCOPE.model, SCOPE.tenant, EntryKind.CHECKPOINT, c.checkpoint_key(22))
    )
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert t.promote(hit)
    match = t.ram.match(c, needs_checkpoint=True)
    assert (match.length, match.checkpoint.reason) == (9, CheckpointReason.BOUNDARY)
    assert ssd.stats().quarantined == 1


def test_a_prompt_that_leaves_a_cached_block_part_way_reports_where(ssd):
    t = tiers(ssd)
    t.store_blocks(chain(), SCOPE, {i: block(i) for i in range(7)})
    edited = TOKENS[:10] + [7] * 12
    hit = t.lookup(chain(edited), SCOPE, needs_checkpoint=False)
    assert (hit.ram_length, hit.diverged_at) == (10, 10)
    longer = t.lookup(chain(TOKENS + [1] * 8), SCOPE, needs_checkpoint=False)
    assert longer.diverged_at is None  # running past the end of the cache is no divergence


def test_eviction_spills_the_typed_entry_with_its_reason(tmp_path):
    store = SSDStore(SSDConfig(root=tmp_path, reconcile="off"))
    t = TieredCache(CacheManager(0, block_size=BS), store, kv.HostCodec(), write_through=False)
    c = chain()
    t.store_blocks(c, SCOPE, {0: block(0)})
    t.store_checkpoint(c, SCOPE, 6, checkpoint(6), CheckpointReason.PROMPT_END)
    assert store.flush(30.0)
    assert store.contains_many(SCOPE, EntryKind.BLOCK, c.hashes[:1]) == [True]
    assert store.stats().spills == 2
    reread = tiers(store)
    hit = reread.lookup(c, SCOPE, needs_checkpoint=True)
    assert reread.promote(hit)
    assert reread.ram.match(c, needs_checkpoint=True).checkpoint.reason is CheckpointReason.PROMPT_END
    store.close()


def test_stats_carry_every_counter_of_both_tiers(tmp_path):
    from engine_bridge.engine import Engine, EngineSettings

    stats = Engine(EngineSettings(cache_dir=tmp_path)).stats()
    assert set(stats["ram"]) == {f.name for f in fields(CacheStats)}
    assert set(stats["ssd"]) == {f.name for f in fields(SSDStats)}
    for counter in ("spill_errors", "reserve_failures", "reserved_bytes"):
        assert stats["ram"][counter] == 0
    for counter in ("read_errors", "quarantined", "queue_drops", "write_errors"):
        assert stats["ssd"][counter] == 0
    assert stats["requests"]["total"] == 0 and stats["hit_ratio"] == 0.0
