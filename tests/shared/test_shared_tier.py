"""Shared tier under the SSD: two TieredCaches (two machines: own RAM, own SSD folder) and
one real redis-server. Lookup order RAM → SSD → shared, a run promoted in one round trip
under the RAM reservation, the three write policies, tenants, and faults that fall back
to what the local tiers hold."""

from __future__ import annotations

import pytest

from engine_bridge import kv
from engine_bridge.cache.hashing import Chain
from engine_bridge.cache.kinds import CheckpointReason, EntryKind
from engine_bridge.cache.ram.manager import CacheManager
from engine_bridge.cache.shared.config import SharedConfig, SharedWritePolicy
from engine_bridge.cache.shared.store import SharedStore
from engine_bridge.cache.shared.tier import SharedTier
from engine_bridge.cache.ssd.index import Scope
from engine_bridge.cache.ssd.store import SSDConfig, SSDStore
from engine_bridge.cache.tiers import TieredCache
from tests.support.redis_helpers import RedisServer, redis_server_fixture  # noqa: F401
from tests.support.tier_payloads import BS, block, checkpoint, make_chain

SCOPE = Scope("model-t", "alice")
EXTRA = (("model", "model-t"), ("tenant", "alice"))
TOKENS = list(range(200, 230))  # 7 full blocks and 2 tokens


def chain(tokens=TOKENS) -> Chain:
    return make_chain(tokens, EXTRA)


class Machine:
    """One proxy's tiers: RAM, an SSD folder of its own, the shared store."""

    def __init__(self, tmp_path, name: str, url: str, *, ssd: bool = True, ram=1 << 30, **kw):
        kw.setdefault("write_policy", SharedWritePolicy.ALL)
        self.ssd = SSDStore(SSDConfig(root=tmp_path / name, reconcile="off")) if ssd else None
        self.store = SharedStore(SharedConfig(url=url, timeout_s=2.0, retry_s=3600, **kw))
        self.tiers = TieredCache(
            CacheManager(ram, block_size=BS),
            self.ssd,
            kv.HostCodec(),
            write_through=True,
            shared=SharedTier(self.store),
        )

    def compute(self, c: Chain, blocks=range(7), checkpoints=()) -> None:
        """What a prefill stores: blocks, then checkpoints, then everything sent."""
        self.tiers.store_blocks(c, SCOPE, {i: block(i) for i in blocks})
        for p in checkpoints:
            self.tiers.store_checkpoint(c, SCOPE, p, checkpoint(p), CheckpointReason.BOUNDARY)
        assert self.store.flush(20)

    def restore(self, c: Chain, snapshots: bool = False, scope: Scope = SCOPE):
        """catch_up → lookup → promote → pin, as CacheSession.restore does; the match."""
        self.tiers.catch_up(scope, needs_checkpoint=snapshots)
        hit = self.tiers.lookup(c, scope, needs_checkpoint=snapshots)
        promoted = hit.ssd is not None and self.tiers.promote(hit)
        match = self.tiers.pin(hit, promoted=promoted)
        if match.pinned:
            self.tiers.ram.release(match)
        return hit, promoted, match

    def close(self) -> None:
        self.tiers.close(5.0)


@pytest.fixture
def machines(tmp_path, redis_server):
    made: list[Machine] = []

    def make(name: str, **kw) -> Machine:
        m = Machine(tmp_path, name, redis_server.url, **kw)
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


def host_bytes(payload) -> dict[str, bytes]:
    tensors, _ = kv.HostCodec().to_host(payload)
    return {n: bytes(t.data) for n, t in tensors.items()}


def test_what_a_computed_is_promoted_on_b_from_the_shared_store(machines, redis_server):
    a, b = machines("a"), machines("b")
    a.compute(chain())
    hit, promoted, match = b.restore(chain())
    assert (hit.ram_length, hit.length, promoted, hit.from_shared) == (0, 28, True, True)
    assert match.length == 28
    assert [host_bytes(x.payload.payload) for x in match.blocks] == [
        host_bytes(block(i)) for i in range(7)
    ]
    assert all(x.payload.on_shared and not x.payload.on_ssd for x in match.blocks)
    s = b.store.stats()
    assert (s.promotions, s.promoted_entries) == (1, 7) and s.bytes_read > 0
    assert redis_server.calls("getex") == 7
    assert b.tiers.ram.stats().reserved_bytes == 0


def test_a_snapshot_model_resumes_at_the_deepest_shared_checkpoint(machines):
    a, b = machines("a"), machines("b")
    a.compute(chain(), checkpoints=(9, 22))
    hit, promoted, match = b.restore(chain(), snapshots=True)
    assert (hit.length, hit.ssd.checkpoint, promoted, hit.from_shared) == (22, 22, True, True)
    assert match.checkpoint.position == 22
    assert host_bytes(match.checkpoint.payload.payload) == host_bytes(checkpoint(22))


def test_the_local_ssd_is_read_first_and_the_store_only_for_the_rest(machines):
    a, b = machines("a"), machines("b")
    a.compute(chain())
    b.compute(chain(), blocks=range(3))  # b's SSD has blocks 0-2 (b's RAM is dropped below)
    assert b.ssd.flush(20)
    b2 = Machine.__new__(Machine)
    b2.ssd, b2.store = b.ssd, b.store
    b2.tiers = TieredCache(
        CacheManager(1 << 30, block_size=BS), b.ssd, kv.HostCodec(), shared=SharedTier(b.store)
    )
    reads_before = b.store.stats().promoted_entries
    hit, promoted, match = b2.restore(chain())
    assert promoted and match.length == 28
    assert b.store.stats().promoted_entries - reads_before == 4  # blocks 3-6
    assert b.ssd.stats().hits == 3


def test_one_round_trip_reads_the_whole_run(machines, redis_server):
    a, b = machines("a"), machines("b")
    long = list(range(1000, 1000 + 40 * BS + 1))
    a.compute(chain(long), blocks=range(40))
    info = redis_server.client()
    hit = b.tiers.lookup(chain(long), SCOPE, needs_checkpoint=False)
    before = info.info("stats")["total_reads_processed"]
    assert b.tiers.promote(hit)
    after = info.info("stats")["total_reads_processed"]
    assert after - before == 2  # the run's pipeline, and INFO itself
    assert b.store.stats().promoted_entries == 40


def test_second_use_sends_an_entry_once_a_request_reuses_it(machines, redis_server):
    a = machines("a", write_policy=SharedWritePolicy.SECOND_USE)
    a.compute(chain())
    assert redis_server.client().dbsize() == 0
    _, _, match = a.restore(chain())
    assert match.length == 28 and a.store.flush(20)
    assert redis_server.client().dbsize() == 7
    a.restore(chain())
    assert a.store.flush(20) and a.store.stats().writes == 7  # sent once


def test_first_n_sends_the_first_blocks_of_a_chain_and_their_checkpoints(machines, redis_server):
    a = machines("a", write_policy=SharedWritePolicy.FIRST_N, first_n=3)
    a.compute(chain(), checkpoints=(9, 22))
    keys = {k.decode().split(":")[3] for k in redis_server.client().keys()}
    assert redis_server.client().dbsize() == 4 and keys == {"b", "c"}
    hit, _, match = machines("b", write_policy=SharedWritePolicy.FIRST_N).restore(chain())
    assert (hit.length, match.length) == (12, 12)


def test_another_tenant_finds_nothing_of_alices(machines):
    a, b = machines("a"), machines("b")
    a.compute(chain())
    bob = Scope("model-t", "bob")
    hit, promoted, match = b.restore(chain(), scope=bob)
    assert (hit.length, promoted, match.length) == (0, False, 0)
    bobs_chain = make_chain(TOKENS, (("model", "model-t"), ("tenant", "bob")))
    assert b.restore(bobs_chain, scope=bob)[2].length == 0


def test_a_corrupt_shared_block_cuts_the_hit_short_instead_of_serving_it(machines, redis_server):
    a, b = machines("a"), machines("b")
    a.compute(chain())
    c = chain()
    name = b.store.key(SCOPE, EntryKind.BLOCK, c.hashes[4])
    value = bytearray(redis_server.client().get(name))
    value[-2] ^= 0x40
    redis_server.client().set(name, bytes(value))
    hit, promoted, match = b.restore(c)
    assert (promoted, match.length) == (True, 16)  # blocks 0-3, then recompute
    assert [host_bytes(x.payload.payload) for x in match.blocks] == [
        host_bytes(block(i)) for i in range(4)
    ]
    assert b.store.stats().errors["corrupt"] == 1
    assert b.tiers.ram.stats().reserved_bytes == 0


def test_a_corrupt_shared_checkpoint_falls_back_to_a_shallower_one(machines, redis_server):
    a, b = machines("a"), machines("b")
    c = chain()
    a.compute(c, checkpoints=(9, 22))
    name = b.store.key(SCOPE, EntryKind.CHECKPOINT, c.checkpoint_key(22))
    redis_server.client().setrange(name, 30, b"garbage")
    hit, promoted, match = b.restore(c, snapshots=True)
    assert (hit.length, promoted, match.length) == (22, True, 9)
    assert host_bytes(match.checkpoint.payload.payload) == host_bytes(checkpoint(9))
    assert b.store.stats().errors["corrupt"] == 1  # not read again while its delete is due
    assert b.store.flush(10) and redis_server.client().exists(name) == 0


def test_a_store_gone_mid_request_leaves_the_local_tiers_serving(machines, redis_server):
    a, b = machines("a"), machines("b")
    a.compute(chain())
    b.compute(chain(), blocks=range(2))
    hit = b.tiers.lookup(chain(), SCOPE, needs_checkpoint=False)
    assert hit.length == 28
    redis_server.stop()
    assert b.tiers.promote(hit) is False
    match = b.tiers.pin(hit, promoted=False)
    assert match.length == 8  # what b's RAM held
    b.tiers.ram.release(match)
    assert b.store.stats().errors["down"] == 1
    again = b.tiers.lookup(chain(), SCOPE, needs_checkpoint=False)
    assert again.length == 8 and b.store.stats().unavailable_skips >= 1


def test_promotion_reserves_ram_before_reading_and_stops_where_it_runs_out(machines):
    a = machines("a")
    a.compute(chain())
    one_block = sum(len(v) for v in host_bytes(block(0)).values()) + 400
    b = machines("b", ram=3 * one_block)
    hit, promoted, match = b.restore(chain())
    assert b.tiers.ram.stats().reserve_failures >= 1
    assert match.length < 28 and match.length % BS == 0
    assert b.tiers.ram.stats().reserved_bytes == 0


def test_shared_stats_reach_the_tier_stats(machines):
    a = machines("a")
    a.compute(chain())
    stats = a.tiers.stats()
    assert stats.shared is not None and stats.shared.writes == 7
    assert stats.shared.url.startswith("redis://127.0.0.1:")


def test_without_an_ssd_the_shared_store_still_serves(tmp_path, redis_server):
    a = Machine(tmp_path, "a", redis_server.url, ssd=False)
    b = Machine(tmp_path, "b", redis_server.url, ssd=False)
    try:
        a.compute(chain(), checkpoints=(22,))
        hit, promoted, match = b.restore(chain(), snapshots=True)
        assert (promoted, match.length, hit.from_shared) == (True, 22, True)
    finally:
        a.close()
        b.close()


def test_redis_fixture_restarts_on_the_same_port(tmp_path):
    server = RedisServer(tmp_path).start()
    port = server.port
    server.stop()
    assert server.start().port == port
    server.stop()
