"""SSD wear: the write policies, the daily meter and cap, and checkpoints a deeper one
supersedes (evicted first, never written).

Real CacheManager, SSDStore on a temporary folder and kv's codec, as in test_cache_tiers;
only the model is absent (payloads are built directly).
"""

from __future__ import annotations

import logging

import pytest

from engine_bridge import kv
from engine_bridge.cache.hashing import Chain
from engine_bridge.cache.kinds import CheckpointReason, EntryKind
from engine_bridge.cache.ram.manager import CacheManager
from engine_bridge.cache.ssd.index import Scope
from engine_bridge.cache.ssd.store import SSDConfig, SSDStore
from engine_bridge.cache.ssd.wear import WEAR_FILE, WearMeter
from engine_bridge.cache.tiers import TieredCache
from engine_bridge.cache.write_policy import WritePolicy, resolve_write_policy
from tests.support import tier_payloads
from tests.support.tier_payloads import BS, block, make_chain

SCOPE = Scope("model-w")
EXTRA = (("model", "model-w"), ("tenant", "default"))
TOKENS = list(range(300, 330))  # 7 full blocks and 2 tokens


def checkpoint(position: int) -> kv.CheckpointPayload:
    return tier_payloads.checkpoint(position, state_width=64)


def chain(tokens=TOKENS) -> Chain:
    return make_chain(tokens, EXTRA)


def open_ssd(root, **kw) -> SSDStore:
    return SSDStore(SSDConfig(root=root, reconcile="off", **kw))


def tiers(ssd, policy: WritePolicy, budget: int = 1 << 30, delay: float = 0.0) -> TieredCache:
    ram = CacheManager(budget, block_size=BS)
    return TieredCache(ram, ssd, kv.HostCodec(), policy=policy, checkpoint_delay_s=delay)


def on_disk(ssd: SSDStore, kind: EntryKind, keys) -> list[bool]:
    assert ssd.flush(30.0)
    return ssd.contains_many(SCOPE, kind, list(keys))


def test_write_policy_and_its_write_through_alias():
    assert resolve_write_policy(None, None) is WritePolicy.THROUGH
    assert resolve_write_policy(None, False) is WritePolicy.EVICT
    assert resolve_write_policy("second-use", None) is WritePolicy.SECOND_USE
    assert resolve_write_policy("evict", False) is WritePolicy.EVICT
    with pytest.raises(ValueError, match="disagrees with write_through = true"):
        resolve_write_policy("evict", True)
    with pytest.raises(ValueError, match="'sometimes' is not one of"):
        resolve_write_policy("sometimes", None)


def test_through_writes_blocks_on_store_and_evict_only_what_ram_evicts(tmp_path):
    c = chain()
    with open_ssd(tmp_path / "through") as ssd:
        tiers(ssd, WritePolicy.THROUGH).store_blocks(c, SCOPE, {i: block(i) for i in range(7)})
        assert on_disk(ssd, EntryKind.BLOCK, c.hashes) == [True] * 7
    with open_ssd(tmp_path / "evict") as ssd:
        t = tiers(ssd, WritePolicy.EVICT)
        t.store_blocks(c, SCOPE, {i: block(i) for i in range(7)})
        assert on_disk(ssd, EntryKind.BLOCK, c.hashes) == [False] * 7
        assert ssd.stats().writes == 0
        t.ram.set_budget(3 * block(0).nbytes)  # the four least recently used go
        assert on_disk(ssd, EntryKind.BLOCK, c.hashes) == [False] * 3 + [True] * 4
        assert (ssd.stats().spills, ssd.stats().write_throughs) == (4, 0)


def test_second_use_writes_after_the_first_hit_and_drops_what_was_never_reused(tmp_path):
    c = chain()
    with open_ssd(tmp_path) as ssd:
        t = tiers(ssd, WritePolicy.SECOND_USE)
        t.store_blocks(c, SCOPE, {i: block(i) for i in range(7)})
        assert on_disk(ssd, EntryKind.BLOCK, c.hashes) == [False] * 7
        # A later request whose prompt shares the first three blocks restores from them.
        later = chain(TOKENS[:12] + [9, 9, 9, 9, 9])
        hit = t.lookup(later, SCOPE, needs_checkpoint=False)
        match = t.pin(hit, promoted=False)
        assert match.length == 12
        t.ram.release(match)
        assert on_disk(ssd, EntryKind.BLOCK, c.hashes) == [True] * 3 + [False] * 4
        t.ram.set_budget(0)  # everything goes; the four never reused are not written
        assert on_disk(ssd, EntryKind.BLOCK, c.hashes) == [True] * 3 + [False] * 4
        assert ssd.stats().writes == 3


def test_max_write_per_day_stops_writes_with_one_warning_and_reads_go_on(tmp_path, caplog):
    c = chain()
    with open_ssd(tmp_path, max_write_per_day=1) as ssd:
        t = tiers(ssd, WritePolicy.THROUGH)
        with caplog.at_level(logging.WARNING, logger="engine_bridge.cache.ssd.wear"):
            t.store_blocks(c, SCOPE, {0: block(0)})
            assert ssd.flush(30.0)
            t.store_blocks(c, SCOPE, {i: block(i) for i in range(1, 7)})
            assert ssd.flush(30.0)
        # The first write crossed the cap (an entry is never cut); nothing after it.
        assert ssd.contains_many(SCOPE, EntryKind.BLOCK, c.hashes) == [True] + [False] * 6
        stats = ssd.stats()
        assert (stats.writes, stats.write_capped, stats.max_write_per_day) == (1, True, 1)
        assert stats.capped_drops == 6 and stats.written_today_bytes == stats.bytes_written
        warnings = [r for r in caplog.records if "max_write_per_day" in r.getMessage()]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        entry = ssd.get(SCOPE, EntryKind.BLOCK, c.hashes[0])
        assert entry is not None and ssd.stats().hits == 1


def test_the_daily_meter_survives_a_restart_and_keeps_a_short_history(tmp_path):
    c = chain()
    with open_ssd(tmp_path) as ssd:
        tiers(ssd, WritePolicy.THROUGH).store_blocks(c, SCOPE, {i: block(i) for i in range(7)})
        assert ssd.flush(30.0)
        written = ssd.stats().bytes_written
    assert written > 0 and (tmp_path / WEAR_FILE).is_file()
    with open_ssd(tmp_path) as ssd:
        stats = ssd.stats()
        assert (stats.bytes_written, stats.written_today_bytes) == (0, written)
        assert stats.write_history[0]["bytes"] == written
    day = 86400.0
    clock = [10 * day]
    meter = WearMeter(tmp_path / "m.json", 100, clock=lambda: clock[0])
    meter.record(150)
    assert not meter.allow()
    clock[0] += day  # a new UTC day: writes go again
    assert meter.allow()
    meter.record(7)
    meter.save()
    again = WearMeter(tmp_path / "m.json", 100, clock=lambda: clock[0])
    assert [h["bytes"] for h in again.stats().history] == [7, 150]


def _store_session(t: TieredCache, c: Chain, points) -> None:
    for p, reason in points:
        t.store_checkpoint(c, SCOPE, p, checkpoint(p), reason)


SESSION = [
    (5, CheckpointReason.BOUNDARY),
    (9, CheckpointReason.PROMPT_END),
    (13, CheckpointReason.BOUNDARY),
    (22, CheckpointReason.PROMPT_END),
]


def test_superseded_checkpoints_are_evicted_first_and_never_written(tmp_path):
    c = chain()
    keys = [c.checkpoint_key(p) for p, _ in SESSION]
    with open_ssd(tmp_path) as ssd:
        t = tiers(ssd, WritePolicy.THROUGH, delay=3600.0)
        t.store_blocks(c, SCOPE, {i: block(i) for i in range(7)})
        _store_session(t, c, SESSION)
        # 9 and 13 lie on 22's path with nothing branching off: superseded. The first
        # message boundary (5) stays live, for other sessions that will branch there.
        superseded = {e.position for e in t.ram.entries() if getattr(e, "superseded", False)}
        assert superseded == {9, 13} and t.ram.stats().superseded_checkpoints == 2
        evicted = []
        t.ram.on_evict = evicted.append
        t.ram.set_budget(t.ram.stats().bytes - 1)
        # Before any block or live checkpoint, though they were used longer ago.
        assert [e.position for e in evicted] == [13]
        t.ram.on_evict = t.writes.spill
        # The first boundary went at once (every session of the project resumes there);
        # 22 is held back until it has stayed the deepest a while, or until close.
        assert on_disk(ssd, EntryKind.CHECKPOINT, keys) == [True, False, False, False]
        t.close(30.0)
        assert t.deferred.dropped == 2  # 9 and 13 were waiting when they were superseded
    with open_ssd(tmp_path) as ssd:
        assert ssd.contains_many(SCOPE, EntryKind.CHECKPOINT, keys) == [True, False, False, True]


def test_a_checkpoint_another_branch_leaves_from_stays_live(tmp_path):
    c = chain()
    branch = chain(TOKENS[:15] + [7, 7, 7, 7, 7])  # leaves the path at 15, after 13
    with open_ssd(tmp_path) as ssd:
        t = tiers(ssd, WritePolicy.THROUGH, delay=3600.0)
        t.store_blocks(c, SCOPE, {i: block(i) for i in range(7)})
        t.store_blocks(branch, SCOPE, {3: block(30), 4: block(40)})
        # The branch has a message boundary of its own past the fork: a conversation.
        t.store_checkpoint(branch, SCOPE, 17, checkpoint(17), CheckpointReason.BOUNDARY)
        t.store_checkpoint(branch, SCOPE, 19, checkpoint(19), CheckpointReason.PROMPT_END)
        _store_session(t, c, SESSION)
        superseded = {e.position for e in t.ram.entries() if getattr(e, "superseded", False)}
        assert superseded == {9}  # 13 is where the branch resumes from
        # A request that reuses a superseded checkpoint makes it live again.
        again = chain(TOKENS[:9] + [5, 5])
        match = t.pin(t.lookup(again, SCOPE, needs_checkpoint=True), promoted=False)
        assert match.length == 9 and not match.checkpoint.superseded
        t.ram.release(match)
        t.close(30.0)
    with open_ssd(tmp_path) as ssd:
        keys = [c.checkpoint_key(p) for p in (5, 9, 13, 22)]
        assert ssd.contains_many(SCOPE, EntryKind.CHECKPOINT, keys) == [True] * 4


def test_a_generation_end_checkpoint_is_written_only_once_a_request_reuses_it(tmp_path):
    c = chain()
    with open_ssd(tmp_path) as ssd:
        t = tiers(ssd, WritePolicy.THROUGH)
        t.store_blocks(c, SCOPE, {i: block(i) for i in range(7)})
        t.store_checkpoint(c, SCOPE, 29, checkpoint(29), CheckpointReason.GENERATION_END)
        key = c.checkpoint_key(29)
        assert on_disk(ssd, EntryKind.CHECKPOINT, [key]) == [False]
        match = t.pin(t.lookup(chain(TOKENS + [1]), SCOPE, needs_checkpoint=True), promoted=False)
        assert match.length == 29
        t.ram.release(match)
        assert on_disk(ssd, EntryKind.CHECKPOINT, [key]) == [True]


def test_config_keys_reach_the_engine_and_a_disagreeing_alias_is_refused(tmp_path):
    from proxy.config.loader import load_config
    from proxy.config.schema import ConfigError
    from proxy.wiring import engine_settings

    path = tmp_path / "config.toml"
    path.write_text(
        '[cache.ssd]\nwrite_through = false\nmax_write_per_day = "2GB"\n'
        'checkpoint_write_delay = "5m"\n'
    )
    settings = engine_settings(load_config(path, {}, {}))
    assert (
        settings.ssd_write_policy,
        settings.ssd_max_write_per_day,
        settings.ssd_checkpoint_delay_s,
    ) == (WritePolicy.EVICT, 2 * 1000**3, 300.0)
    path.write_text('[cache.ssd]\nwrite_policy = "second-use"\nwrite_through = true\n')
    with pytest.raises(ConfigError, match="cache.ssd.write_policy: .*disagrees with write_through"):
        load_config(path, {}, {})
