"""SSD tier, store: lookups follow the disk, RAM reservations around promotion, capacity and
TTL, disk faults that disable writes, and the offline ls/stats/clear helpers."""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import threading
import time
from pathlib import Path

from engine_bridge.cache.kinds import EntryKind
from engine_bridge.cache.ssd.index import Scope
from engine_bridge.cache.ssd.store import offline_clear, offline_ls, offline_stats
from tests.support.ssd_helpers import (
    SCOPE,
    as_bytes,
    flip,
    key,
    open_store,
    path_of,
    quarantined,
    store_fixture,  # noqa: F401 (the `store` fixture)
    temp_files,
    tensors,
    write,
)

# ---- lookup -------------------------------------------------------------------------


def test_contains_many_follows_the_disk(store):
    chain = [key(i) for i in range(6)]
    for i in (0, 1, 2, 4):
        store.put(SCOPE, EntryKind.BLOCK, chain[i], tensors(i))
    assert store.flush()
    assert store.contains_many(SCOPE, EntryKind.BLOCK, chain) == [
        True,
        True,
        True,
        False,
        True,
        False,
    ]
    assert store.get(SCOPE, EntryKind.BLOCK, chain[3]) is None
    assert (store.stats().hits, store.stats().misses) == (0, 1)


def test_failed_read_hands_the_reservation_back(store, tmp_path):
    write(store, key(1), tensors(1))
    flip(path_of(tmp_path, key(1)), 100)
    ledger = []
    got = store.get(
        SCOPE,
        EntryKind.BLOCK,
        key(1),
        reserve=lambda n: ledger.append(n) or True,
        release=lambda n: ledger.append(-n),
    )
    assert got is None
    assert len(ledger) == 2 and sum(ledger) == 0


# ---- promotion reservation ----------------------------------------------------------


class Budget:
    def __init__(self, limit: int) -> None:
        self.limit, self.used, self.peak = limit, 0, 0
        self._lock = threading.Lock()

    def reserve(self, n: int) -> bool:
        with self._lock:
            if self.used + n > self.limit:
                return False
            self.used += n
            self.peak = max(self.peak, self.used)
            return True


def test_concurrent_promotions_never_exceed_the_budget(store):
    for i in range(8):
        store.put(SCOPE, EntryKind.BLOCK, key(i), tensors(i, 64 * 1024))
    assert store.flush()
    sizes = [path_of(store.root, key(i)).stat().st_size for i in range(8)]
    budget = Budget(3 * max(sizes) + min(sizes) // 2)
    barrier = threading.Barrier(8)
    results = [None] * 8

    def promote(i: int) -> None:
        barrier.wait()
        results[i] = store.get(SCOPE, EntryKind.BLOCK, key(i), reserve=budget.reserve)

    threads = [threading.Thread(target=promote, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    loaded = [i for i, r in enumerate(results) if r is not None]
    assert len(loaded) == 3
    assert budget.peak <= budget.limit
    assert budget.used == sum(sizes[i] for i in loaded)
    for i in loaded:
        assert as_bytes(results[i].tensors) == as_bytes(tensors(i, 64 * 1024))
    stats = store.stats()
    assert (stats.hits, stats.promotion_failures, stats.misses) == (3, 5, 0)


def test_refused_reservation_reads_nothing(store, tmp_path, monkeypatch):
    write(store, key(1), tensors(1))
    opened = []
    real_open = os.open

    def spy(path, *args, **kw):
        opened.append(path)
        return real_open(path, *args, **kw)

    monkeypatch.setattr(os, "open", spy)
    assert store.get(SCOPE, EntryKind.BLOCK, key(1), reserve=lambda n: False) is None
    assert opened == [] and store.stats().promotion_failures == 1


# ---- capacity and retention ---------------------------------------------------------


def test_capacity_evicts_least_recently_used(tmp_path):
    probe = open_store(tmp_path / "probe")
    write(probe, key(0), tensors(0))
    size = probe.stats().bytes
    probe.close()
    store = open_store(tmp_path / "c", max_bytes=3 * size + size // 2)
    for name in "abc":
        write(store, key(name), tensors(1))
    assert store.get(SCOPE, EntryKind.BLOCK, key("a")) is not None  # a is now fresher than b
    write(store, key("d"), tensors(1))
    assert store.contains_many(SCOPE, EntryKind.BLOCK, [key(n) for n in "abcd"]) == [
        True,
        False,
        True,
        True,
    ]
    stats = store.stats()
    assert (stats.evictions, stats.entries) == (1, 3)
    assert stats.bytes <= 3 * size + size // 2
    assert not path_of(store.root, key("b")).exists()
    store.close()


def _age(root: Path, k: bytes, seconds: float) -> None:
    with sqlite3.connect(root / "index.sqlite3") as conn:
        conn.execute("UPDATE entries SET last_access = last_access - ? WHERE key = ?", (seconds, k))


def test_ttl_expires_unused_entries_at_startup(tmp_path):
    store = open_store(tmp_path)
    write(store, key(1), tensors(1))
    write(store, key(2), tensors(2))
    store.close()
    _age(tmp_path, key(1), 7200)
    store = open_store(tmp_path, ttl_s=3600, reconcile="off")
    report = store.reconcile()
    assert report.expired == 1
    assert store.contains_many(SCOPE, EntryKind.BLOCK, [key(1), key(2)]) == [False, True]
    assert not path_of(tmp_path, key(1)).exists()
    store.close()


def test_ttl_is_enforced_periodically(tmp_path):
    store = open_store(tmp_path, ttl_s=3600, maintenance_interval_s=0.05)
    write(store, key(1), tensors(1))
    _age(tmp_path, key(1), 7200)
    deadline = time.monotonic() + 10
    while store.contains_many(SCOPE, EntryKind.BLOCK, [key(1)])[0] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert store.stats().expired == 1 and not path_of(tmp_path, key(1)).exists()
    store.close()


# ---- faults: disk full, read-only -----------------------------------------------------


def test_disk_full_disables_writes_with_one_warning(store, tmp_path, monkeypatch, caplog):
    write(store, key(0), tensors(0))
    real_write = os.write

    def disk_full(fd, data):
        if threading.current_thread().name == "ssd-writer":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", disk_full)
    with caplog.at_level(logging.WARNING, logger="engine_bridge.cache.ssd"):
        assert store.put(SCOPE, EntryKind.BLOCK, key(1), tensors(1)) == "queued"
        assert store.put(SCOPE, EntryKind.BLOCK, key(2), tensors(2)) == "queued"
        assert store.flush()
        assert store.put(SCOPE, EntryKind.BLOCK, key(3), tensors(3)) == "disabled"
    stats = store.stats()
    assert stats.disabled and "No space left" in stats.disabled_reason
    assert (stats.writes, stats.disabled_drops) == (1, 2)
    assert [r.levelname for r in caplog.records if "disabled" in r.message] == ["WARNING"]
    assert temp_files(tmp_path) == []
    assert store.get(SCOPE, EntryKind.BLOCK, key(0)) is not None  # reads still served


def test_read_only_folder_disables_writes_reads_still_work(store, tmp_path, monkeypatch, caplog):
    write(store, key(0), tensors(0))
    real_open, real_mkdir = os.open, os.mkdir
    root = str(tmp_path)

    # As root, chmod 0500 does not stop writes, so fail the calls as a read-only mount would.
    def ro_open(path, flags, *a, **k):
        if str(path).startswith(root) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *a, **k)

    def ro_mkdir(path, *a, **k):
        if str(path).startswith(root):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_mkdir(path, *a, **k)

    monkeypatch.setattr(os, "open", ro_open)
    monkeypatch.setattr(os, "mkdir", ro_mkdir)
    with caplog.at_level(logging.WARNING, logger="engine_bridge.cache.ssd"):
        assert store.put(SCOPE, EntryKind.BLOCK, key(1), tensors(1)) == "queued"
        assert store.flush()
    stats = store.stats()
    assert stats.disabled and "Read-only file system" in stats.disabled_reason
    assert len([r for r in caplog.records if "disabled" in r.message]) == 1
    assert store.get(SCOPE, EntryKind.BLOCK, key(0)) is not None
    assert store.put(SCOPE, EntryKind.BLOCK, key(2), tensors(2)) == "disabled"


def test_unusable_root_starts_disabled_and_never_raises(tmp_path, caplog):
    (tmp_path / "a-file").write_text("not a folder")
    with caplog.at_level(logging.WARNING, logger="engine_bridge.cache.ssd"):
        store = open_store(tmp_path / "a-file" / "cache")
    assert store.stats().disabled
    assert store.put(SCOPE, EntryKind.BLOCK, key(1), tensors(1)) == "disabled"
    assert store.get(SCOPE, EntryKind.BLOCK, key(1)) is None
    assert store.contains_many(SCOPE, EntryKind.BLOCK, [key(1)]) == [False]
    assert store.reconcile().adopted == 0
    store.close()
    assert len([r for r in caplog.records if "disabled" in r.message]) == 1


# ---- offline helpers ----------------------------------------------------------------


def _populate(root: Path) -> None:
    store = open_store(root)
    write(store, key(1), tensors(1), tokens=64)
    write(store, key(2), tensors(2), tokens=128)
    write(store, key(3), tensors(3), scope=Scope("model-a", "t2"), tokens=64)
    assert (
        store.put(Scope("model-b"), EntryKind.CHECKPOINT, key(4), tensors(4), tokens=7) == "queued"
    )
    store.close()


def test_offline_ls_and_stats(tmp_path):
    _populate(tmp_path)
    (tmp_path / "quarantine").mkdir()
    (tmp_path / "quarantine" / "bad").write_bytes(b"12345")
    rows = offline_ls(tmp_path)
    assert [
        (r["model"], r["tenant"], r["entries"], r["blocks"], r["checkpoints"], r["tokens"])
        for r in rows
    ] == [
        ("model-a", "default", 2, 2, 0, 192),
        ("model-a", "t2", 1, 1, 0, 64),
        ("model-b", "default", 1, 0, 1, 7),
    ]
    stats = offline_stats(tmp_path)
    assert (stats["entries"], stats["models"], stats["tenants"]) == (4, 2, 3)
    assert stats["bytes"] == sum(p.stat().st_size for p in tmp_path.rglob("*.safetensors"))
    assert (stats["blocks"], stats["checkpoints"], stats["quarantined_files"]) == (3, 1, 1)
    assert stats["quarantined_bytes"] == 5
    assert offline_ls(tmp_path / "nothing-here") == []
    assert offline_stats(tmp_path / "nothing-here")["entries"] == 0


def test_offline_clear_keeps_other_files(tmp_path):
    _populate(tmp_path)
    demo = tmp_path / "models" / "demo-llama"
    demo.mkdir(parents=True)
    (demo / "config.json").write_text("{}")
    assert offline_clear(tmp_path, model="model-b") == 1
    assert [r["model"] for r in offline_ls(tmp_path)] == ["model-a", "model-a"]
    assert not (tmp_path / "model-b").exists()
    (tmp_path / "quarantine").mkdir()
    (tmp_path / "quarantine" / "bad").write_bytes(b"x")
    assert offline_clear(tmp_path) == 3
    assert offline_ls(tmp_path) == [] and list(tmp_path.rglob("*.safetensors")) == []
    assert (demo / "config.json").read_text() == "{}"
    assert quarantined(tmp_path) == []
    assert offline_clear(tmp_path / "nothing-here") == 0


def test_offline_clear_beside_a_running_store(tmp_path):
    store = open_store(tmp_path)
    write(store, key(1), tensors(1))
    write(store, key(2), tensors(2))
    assert offline_clear(tmp_path) == 2
    assert store.get(SCOPE, EntryKind.BLOCK, key(1)) is None  # a miss, not an error
    assert store.stats().entries == 0
    write(store, key(3), tensors(3))  # and the store keeps working
    assert store.get(SCOPE, EntryKind.BLOCK, key(3)) is not None
    assert offline_stats(tmp_path)["entries"] == 1
    store.close()
