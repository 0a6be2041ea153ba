"""SSD tier, writer: each entry written once, a bounded queue that drops rather than blocks,
write reasons counted apart, and a close that drains but never hangs."""

from __future__ import annotations

import threading
import time

from engine_bridge.cache.kinds import EntryKind
from engine_bridge.cache.ssd import files as ssd_files
from engine_bridge.cache.ssd.index import Scope
from tests.support.ssd_helpers import (
    SCOPE,
    key,
    open_store,
    path_of,
    store_fixture,  # noqa: F401 (the `store` fixture)
    tensors,
    write,
)

# ---- dedupe and queue ---------------------------------------------------------------


def test_same_entry_is_written_once(store, tmp_path, monkeypatch):
    t = tensors(5)
    gate = threading.Event()
    real = ssd_files.write_atomic
    monkeypatch.setattr(ssd_files, "write_atomic", lambda p, c: (gate.wait(10), real(p, c)))
    assert store.put(SCOPE, EntryKind.BLOCK, key(5), t) == "queued"
    assert store.put(SCOPE, EntryKind.BLOCK, key(5), t) == "duplicate"  # already queued
    gate.set()
    assert store.flush()
    mtime = path_of(tmp_path, key(5)).stat().st_mtime_ns
    assert store.put(SCOPE, EntryKind.BLOCK, key(5), t, reason="spill") == "queued"
    assert store.flush()
    stats = store.stats()
    assert (stats.writes, stats.dedup_skips, stats.entries) == (1, 2, 1)
    assert path_of(tmp_path, key(5)).stat().st_mtime_ns == mtime
    # The same hash under another tenant or kind is a different entry.
    write(store, key(5), t, scope=Scope("model-a", "tenant-2"))
    assert store.stats().writes == 2


def test_full_queue_drops_and_counts_without_blocking(tmp_path, monkeypatch):
    gate = threading.Event()
    real = ssd_files.write_atomic
    monkeypatch.setattr(ssd_files, "write_atomic", lambda p, c: (gate.wait(10), real(p, c)))
    store = open_store(tmp_path, queue_size=2)
    outcomes = []
    # In a thread, so that a put that blocked would fail the join below, not hang the suite.
    worker = threading.Thread(
        target=lambda: outcomes.extend(
            store.put(SCOPE, EntryKind.BLOCK, key(i), tensors(i)) for i in range(6)
        )
    )
    worker.start()
    worker.join(5)
    assert not worker.is_alive()
    # The writer holds one job (blocked on the gate), the queue two more; the rest drop.
    assert outcomes.count("queued") in (2, 3)
    assert outcomes.count("dropped") == 6 - outcomes.count("queued")
    assert store.stats().queue_drops == outcomes.count("dropped")
    gate.set()
    assert store.flush()
    assert store.stats().writes == outcomes.count("queued")
    store.close()


def test_queue_byte_bound_drops_large_backlog(tmp_path, monkeypatch):
    gate = threading.Event()
    real = ssd_files.write_atomic
    monkeypatch.setattr(ssd_files, "write_atomic", lambda p, c: (gate.wait(10), real(p, c)))
    store = open_store(tmp_path, queue_max_bytes=10_000)
    got = [store.put(SCOPE, EntryKind.BLOCK, key(i), tensors(i, 4096)) for i in range(4)]
    assert got == ["queued", "queued", "dropped", "dropped"]
    gate.set()
    store.close()


def test_spills_and_write_throughs_are_counted_apart(store):
    write(store, key(1), tensors(1), reason="spill")
    write(store, key(2), tensors(2), reason="write_through")
    write(store, key(3), tensors(3), reason="spill")
    s = store.stats()
    assert (s.spills, s.write_throughs, s.writes) == (2, 1, 3)
    assert (
        s.bytes
        == s.bytes_written
        == sum(path_of(store.root, key(i)).stat().st_size for i in (1, 2, 3))
    )


# ---- shutdown -----------------------------------------------------------------------


def test_close_drains_the_queue(tmp_path):
    store = open_store(tmp_path, queue_size=64)
    for i in range(20):
        assert store.put(SCOPE, EntryKind.BLOCK, key(i), tensors(i)) == "queued"
    store.close(timeout_s=30)
    store = open_store(tmp_path)
    assert store.stats().entries == 20
    store.close()


def test_close_is_bounded_when_the_disk_stalls(tmp_path, monkeypatch):
    gate = threading.Event()
    real = ssd_files.write_atomic
    monkeypatch.setattr(ssd_files, "write_atomic", lambda p, c: (gate.wait(10), real(p, c)))
    store = open_store(tmp_path)
    for i in range(5):
        store.put(SCOPE, EntryKind.BLOCK, key(i), tensors(i))
    start = time.monotonic()
    store.close(timeout_s=0.2)
    assert time.monotonic() - start < 5  # generous: the point is that it returns at all
    gate.set()
    store.close(timeout_s=10)  # a second close waits for the writer thread to finish
    stats = store.stats()
    assert (stats.writes, stats.queue_drops, stats.queued) == (1, 4, 0)
    assert store.put(SCOPE, EntryKind.BLOCK, key(9), tensors(9)) == "disabled"
