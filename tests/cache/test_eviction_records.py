"""The tiers remember what they dropped lately, so a miss can say evicted or expired.

Real CacheManager and SSDStore (LRU eviction and the TTL sweep run on the writer thread as
in production); payloads are built directly, as in test_cache_tiers.py.
"""

from __future__ import annotations

import time

from engine_bridge import kv
from engine_bridge.cache.evictions import EvictionRecord
from engine_bridge.cache.hashing import Chain
from engine_bridge.cache.ram.manager import CacheManager
from engine_bridge.cache.ssd.store import SSDConfig, SSDStore
from engine_bridge.cache.tiers import TieredCache
from tests.cache.test_cache_tiers import BS, EXTRA, SCOPE, block

A = Chain(list(range(100, 116)), BS, EXTRA)  # 4 blocks
B = Chain(list(range(300, 332)), BS, EXTRA)  # 8 blocks
BLOCK_BYTES = block(0).nbytes


def test_the_record_keeps_the_newest_keys_and_their_cause():
    record = EvictionRecord(capacity=6)  # two generations of 3
    record.add([b"a", b"b"])
    record.add([b"c", b"d"], "expired")  # c fills the new generation: a, b, c become the old
    assert [record.cause(k) for k in (b"a", b"b", b"c", b"d")] == [
        "evicted",
        "evicted",
        "expired",
        "expired",
    ]
    record.add([b"b"], "expired")  # dropped again, for another reason: the newest counts
    assert (record.cause(b"b"), len(record)) == ("expired", 4)
    record.add([b"e"])  # d, b, e fill the new generation: a and c go with the old one
    assert [record.cause(k) for k in (b"a", b"b", b"c", b"d", b"e")] == [
        None,
        "expired",
        None,
        "expired",
        "evicted",
    ]
    assert len(record) == 3


def test_the_record_stays_bounded_and_knows_the_newest_half():
    record = EvictionRecord(capacity=1000)
    keys = [i.to_bytes(32, "big")[::-1] for i in range(10_000)]  # distinct first 8 bytes
    for key in keys:
        record.add([key])
        assert len(record) <= 1000
    assert all(record.cause(k) == "evicted" for k in keys[-500:])
    assert all(record.cause(k) is None for k in keys[:9000])


def test_blocks_ram_evicted_without_an_ssd_are_evicted_ram():
    tiers = TieredCache(CacheManager(6 * BLOCK_BYTES, block_size=BS), None, kv.HostCodec())
    tiers.store_blocks(A, SCOPE, {i: block(i) for i in range(4)})
    assert tiers.lost(A, SCOPE, 0) is None  # held
    tiers.store_blocks(B, SCOPE, {i: block(i) for i in range(8)})  # pushes A's out
    assert tiers.ram.match(A, needs_checkpoint=False).length == 0
    assert tiers.lost(A, SCOPE, 0) == "evicted_ram"
    assert tiers.lost(Chain(list(range(900, 916)), BS, EXTRA), SCOPE, 0) is None  # never held


def _wait(condition, timeout_s: float = 20.0) -> None:
    end = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def test_blocks_the_ssd_evicted_for_room_are_evicted_ssd(tmp_path):
    # Room on disk for a little more than B: writing B evicts A's (older) files.
    ssd = SSDStore(SSDConfig(root=tmp_path, reconcile="off", max_bytes=10 * BLOCK_BYTES))
    try:
        writer = TieredCache(CacheManager(1 << 30, block_size=BS), ssd, kv.HostCodec())
        writer.store_blocks(A, SCOPE, {i: block(i) for i in range(4)})
        assert ssd.flush(30.0)
        writer.store_blocks(B, SCOPE, {i: block(i) for i in range(8)})
        assert ssd.flush(30.0) and ssd.stats().evictions > 0
        fresh = TieredCache(CacheManager(1 << 30, block_size=BS), ssd, kv.HostCodec())
        assert fresh.lookup(A, SCOPE, needs_checkpoint=False).length == 0
        assert fresh.lost(A, SCOPE, 0) == "evicted_ssd"
        assert fresh.lost(B, SCOPE, 7) is None  # B's newest block is still on disk
    finally:
        ssd.close()


def test_blocks_the_ssd_ttl_deleted_are_expired(tmp_path):
    config = SSDConfig(root=tmp_path, reconcile="off", ttl_s=0.2, maintenance_interval_s=0.05)
    ssd = SSDStore(config)
    try:
        writer = TieredCache(CacheManager(1 << 30, block_size=BS), ssd, kv.HostCodec())
        writer.store_blocks(A, SCOPE, {i: block(i) for i in range(4)})
        assert ssd.flush(30.0)
        _wait(lambda: ssd.stats().entries == 0)
        fresh = TieredCache(CacheManager(1 << 30, block_size=BS), ssd, kv.HostCodec())
        assert fresh.lost(A, SCOPE, 0) == "expired"
    finally:
        ssd.close()
