"""`TieredCache.lookup` only reads (issue 23, part 6): it puts and flushes nothing, a restore
walks RAM once, and the hybrid SSD search asks the index once for the checkpoints it holds.

Real CacheManager, real SSDStore on a temporary folder, kv's codec; spies count the calls
and change nothing. The last test runs CacheSession.restore on the demo models.
"""

from __future__ import annotations

import shutil
import time

import pytest

from engine_bridge import kv
from engine_bridge.cache.hashing import Chain
from engine_bridge.cache.kinds import CheckpointReason, EntryKind
from engine_bridge.cache.ram import manager as ram_manager
from engine_bridge.cache.ram.manager import CacheManager
from engine_bridge.cache.ssd.index import Index, Scope
from engine_bridge.cache.ssd.store import SSDConfig, SSDStore
from engine_bridge.cache.tiers import TieredCache
from engine_bridge.cache.write_policy import WritePolicy
from engine_bridge.prompt_cache import CacheSession
from tests.conftest import fresh_cache_dir
from tests.support.cache_driver import Driver
from tests.support.tier_payloads import BS, block, checkpoint, make_chain

SCOPE = Scope("model-q")
EXTRA = (("model", "model-q"), ("tenant", "default"))
TOKENS = list(range(700, 730))  # 7 full blocks and 2 tokens


def chain(tokens=TOKENS) -> Chain:
    return make_chain(tokens, EXTRA)


def open_ssd(root) -> SSDStore:
    return SSDStore(SSDConfig(root=root, reconcile="off"))


def tiers(ssd: SSDStore | None, *, delay: float = 0.0) -> TieredCache:
    ram = CacheManager(1 << 30, block_size=BS)
    return TieredCache(
        ram, ssd, kv.HostCodec(), policy=WritePolicy.THROUGH, checkpoint_delay_s=delay
    )


def count_puts(monkeypatch, ssd: SSDStore) -> list[bytes]:
    """The keys of every put the store is asked for from now on."""
    puts: list[bytes] = []
    real = ssd.put

    def put(scope, kind, key, *args, **kwargs):
        puts.append(key)
        return real(scope, kind, key, *args, **kwargs)

    monkeypatch.setattr(ssd, "put", put)
    return puts


def count_matches(monkeypatch) -> list[str]:
    """Every walk of RAM for a match (CacheManager.match and .matches), from now on."""
    walks: list[str] = []
    for name in ("find_match", "find_matches"):
        real = getattr(ram_manager, name)

        def spy(*args, _real=real, _name=name):
            walks.append(_name)
            return _real(*args)

        monkeypatch.setattr(ram_manager, name, spy)
    return walks


def restore(t: TieredCache, c: Chain, snapshots: bool) -> tuple[int, bool]:
    """catch_up → lookup → promote → pin → release, as CacheSession.restore does."""
    t.catch_up(SCOPE, needs_checkpoint=snapshots)
    hit = t.lookup(c, SCOPE, needs_checkpoint=snapshots)
    promoted = hit.ssd is not None and t.promote(hit)
    match = t.pin(hit, promoted=promoted)
    if match.pinned:
        t.ram.release(match)
    return match.length, promoted


# -- lookup writes nothing ------------------------------------------------------------------


def test_lookup_and_probe_put_nothing_the_ssd_lost_and_catch_up_puts_it(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    with open_ssd(root) as ssd:
        t = tiers(ssd)
        c = chain()
        t.store_blocks(c, SCOPE, {i: block(i) for i in range(7)})
        assert ssd.flush(30.0) and ssd.stats().writes == 7
        shutil.rmtree(root)
        ssd.check_folder()
        assert t.writes.stats().rewrites_pending == 7
        puts = count_puts(monkeypatch, ssd)
        for needs in (False, True):  # a request's lookup, then the probe's two questions
            hit = t.lookup(chain(TOKENS + [1]), SCOPE, needs_checkpoint=needs)
            t.local_length(hit)
        assert ssd.flush(30.0)
        assert puts == [] and t.writes.stats().rewrites_pending == 7
        assert ssd.stats().writes == 7 and SCOPE not in t.writes.snapshot_scopes
        t.catch_up(SCOPE, needs_checkpoint=False)  # what a request's restore does first
        assert sorted(puts) == sorted(c.hashes[:7]) and t.writes.stats().rewrites_pending == 0
        assert ssd.flush(30.0) and ssd.stats().writes == 14


def test_lookup_flushes_no_held_back_checkpoint_and_catch_up_does(tmp_path, monkeypatch):
    with open_ssd(tmp_path) as ssd:
        t = tiers(ssd, delay=0.001)
        t.catch_up(SCOPE, needs_checkpoint=True)  # a snapshot model's request
        c = chain()
        t.store_blocks(c, SCOPE, {i: block(i) for i in range(7)})
        t.store_checkpoint(c, SCOPE, 9, checkpoint(9), CheckpointReason.BOUNDARY)  # goes at once
        t.store_checkpoint(c, SCOPE, 22, checkpoint(22), CheckpointReason.PROMPT_END)  # held
        assert t.deferred.stats().held == 1
        time.sleep(0.01)
        assert t.deferred.due()
        flushes = []
        real_flush = t.deferred.flush
        monkeypatch.setattr(
            t.deferred, "flush", lambda **kw: flushes.append(kw) or real_flush(**kw)
        )
        puts = count_puts(monkeypatch, ssd)
        hit = t.lookup(chain(TOKENS + [1]), SCOPE, needs_checkpoint=True)
        t.local_length(hit)
        assert hit.length == 22  # RAM answers; nothing was written to find that out
        assert (flushes, puts, t.deferred.stats().held) == ([], [], 1)
        t.catch_up(SCOPE, needs_checkpoint=True)
        assert flushes == [{}] and t.deferred.stats().held == 0
        # The checkpoint at 22, after the three blocks under it that 9's write left out.
        assert puts == [*c.hashes[2:5], c.checkpoint_key(22)]


# -- one RAM walk per restore ---------------------------------------------------------------


def write(ssd: SSDStore, c: Chain, blocks: range, checkpoints: tuple[int, ...] = ()) -> None:
    """Put blocks and checkpoints of `c` on disk through a write-through tier."""
    writer = tiers(ssd)
    writer.store_blocks(c, SCOPE, {i: block(i) for i in blocks})
    for p in checkpoints:
        writer.store_checkpoint(c, SCOPE, p, checkpoint(p), CheckpointReason.BOUNDARY)
        assert ssd.flush(30.0)  # written before the next one supersedes it
    assert ssd.flush(30.0)


@pytest.mark.parametrize(
    ("case", "snapshots", "expected"),
    [
        ("ram", False, (28, False, 1)),
        ("ram", True, (22, False, 1)),  # before: 3 (the checkpoint match, the prefix, pin)
        ("miss", False, (0, False, 1)),  # before: 2 (lookup, then pin matched again)
        ("miss", True, (0, False, 1)),
        # Promotion changed RAM, so pin matches once more to reach into it; before: 3.
        ("ssd", False, (28, True, 2)),
        ("ssd", True, (22, True, 2)),  # before: 4
    ],
)
def test_a_restore_walks_ram_once_unless_promotion_changed_it(
    tmp_path, monkeypatch, case, snapshots, expected
):
    c = chain()
    with open_ssd(tmp_path) as ssd:
        t = tiers(ssd)
        if case == "ram":
            t.store_blocks(c, SCOPE, {i: block(i) for i in range(7)})
            t.store_checkpoint(c, SCOPE, 22, checkpoint(22), CheckpointReason.BOUNDARY)
        elif case == "ssd":
            write(ssd, c, range(7), (22,))
        walks = count_matches(monkeypatch)
        length, promoted = restore(t, chain(TOKENS + [1]), snapshots)
        assert (length, promoted, len(walks)) == expected, walks


def test_promotion_pins_the_lookups_prefix_match_and_matches_again_once_it_left_ram(
    tmp_path, monkeypatch
):
    """The prefix promotion pins is the lookup's; if one of its blocks left RAM in between
    (`acquire` sees another object, or none), it matches again, once, and still promotes
    the plan the lookup made."""
    long = chain(TOKENS + list(range(40)))
    with open_ssd(tmp_path) as ssd:
        write(ssd, long, range(17))
        t = tiers(ssd)
        t.store_blocks(long, SCOPE, {i: block(i) for i in range(3)})
        hit = t.lookup(long, SCOPE, needs_checkpoint=False)
        assert (hit.ram_length, hit.prefix is hit.ram, hit.length) == (12, True, 68)
        walks = count_matches(monkeypatch)
        t.ram.discard([(EntryKind.BLOCK, long.hashes[2])])  # RAM changed since the lookup
        assert t.promote(hit) and walks == ["find_match"]
        assert t.ram.stats().pinned_bytes == 0  # what it pinned is let go
        assert t.ram.has_blocks(long.hashes[:17]) == [True] * 2 + [False] + [True] * 14


# -- the hybrid SSD search asks about checkpoints, not positions ---------------------------


def spy_index(monkeypatch) -> tuple[list[int], list[tuple[int, int]]]:
    """Keys asked of the index about checkpoints by presence, and each range query."""
    asked: list[int] = []
    ranges: list[tuple[int, int]] = []
    real_present, real_between = Index.present, Index.checkpoints_between

    def present(self, scope, kind, keys):
        if kind == EntryKind.CHECKPOINT:
            asked.append(len(keys))
        return real_present(self, scope, kind, keys)

    def between(self, scope, lo, hi):
        ranges.append((lo, hi))
        return real_between(self, scope, lo, hi)

    monkeypatch.setattr(Index, "present", present)
    monkeypatch.setattr(Index, "checkpoints_between", between)
    return asked, ranges


@pytest.mark.parametrize("blocks", [20, 100])
def test_the_hybrid_ssd_search_asks_the_index_once_however_far_the_hit_reaches(
    tmp_path, monkeypatch, blocks
):
    tokens = list(range(1000, 1000 + blocks * BS + 2))
    mine = chain(tokens)
    # A sibling in the same scope, past block 1: deeper checkpoints, none of them ours.
    sibling = chain(tokens[: 2 * BS] + [7] * (blocks * BS))
    with open_ssd(tmp_path) as ssd:
        write(ssd, mine, range(blocks), (9, 21))
        write(ssd, sibling, range(2, blocks), (30, 9 + 4 * BS, (blocks - 1) * BS + 1))
        asked, ranges = spy_index(monkeypatch)
        t = tiers(ssd)
        hit = t.lookup(mine, SCOPE, needs_checkpoint=True)
        # Before: one presence query per block between RAM's hit and the reach (up to
        # `blocks` queries, a key per position); now one range query, whatever the distance.
        assert (hit.length, hit.ssd.checkpoint) == (21, 21)
        assert asked == [] and ranges == [(0, blocks * BS + 1)]
        assert restore(t, chain(tokens), True) == (21, True)


# -- CacheSession.restore on real models ----------------------------------------------------


@pytest.fixture(scope="module")
def driver(demo_root, tmp_path_factory):
    d = Driver(
        fresh_cache_dir(demo_root, tmp_path_factory.mktemp("reads")), ["demo-llama", "demo-hybrid"]
    )
    yield d
    d.close()


@pytest.mark.parametrize("model", ["demo-llama", "demo-hybrid"])
def test_cache_session_restore_walks_ram_once_and_hits_as_before(driver, monkeypatch, model):
    walks = count_matches(monkeypatch)
    per_restore: list[int] = []
    real_restore = CacheSession.restore

    def restore_spy(self):
        before = len(walks)
        try:
            return real_restore(self)
        finally:
            per_restore.append(len(walks) - before)

    monkeypatch.setattr(CacheSession, "restore", restore_spy)
    messages = [{"role": "user", "content": "tell me about the tiers of a prompt cache " * 4}]
    cold = driver.generate(model, messages)
    warm = driver.generate(model, messages)
    assert per_restore == [1, 1]
    assert warm.source == "ram" and warm.cached > 0
    assert warm.out == cold.out  # greedy: the cache changes nothing
    assert warm.text == cold.text == driver.bypass(model, messages).text
