"""What the MLX thread must not do (issue 33, "I/O off the MLX thread"): ask the SSD's
SQLite index. The writes a request makes first (entries the SSD lost put again), the rule
that sends a periodic checkpoint to disk, and the probe's lookup each asked it there.

Every SQL statement the index runs is recorded with the thread that ran it (a trace on
each connection it opens: sqlite3 calls it on the executing thread); the thread that plays
the MLX thread must have run none. Real CacheManager, SSDStore and kv's codec; the probe
test runs an in-process Engine on demo-llama.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time

from engine_bridge import kv
from engine_bridge.cache.kinds import CheckpointReason, EntryKind
from engine_bridge.cache.ram.manager import CacheManager
from engine_bridge.cache.ssd import files
from engine_bridge.cache.ssd import index as ssd_index
from engine_bridge.cache.ssd.index import Scope
from engine_bridge.cache.ssd.store import SSDConfig, SSDStore
from engine_bridge.cache.tiers import TieredCache
from engine_bridge.cache.write_policy import WritePolicy
from tests.cache.test_tier_io_off_thread import WAITING, empty_ram, make_engine, text_of
from tests.conftest import fresh_cache_dir
from tests.support import tier_payloads
from tests.support.tier_payloads import BS, block, make_chain

SCOPE = Scope("model-m")
EXTRA = (("model", SCOPE.model), ("tenant", SCOPE.tenant))
TOKENS = list(range(300, 330))  # 7 full blocks and 2 tokens
HOUR = 3600.0


class IndexCalls:
    """Every SQL statement the SSD index runs from now on, with the thread that ran it."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[tuple[int, str]] = []
        real = ssd_index._connect

        def connect(target: str, *, uri: bool) -> sqlite3.Connection:
            conn = real(target, uri=uri)
            conn.set_trace_callback(lambda sql: self.calls.append((threading.get_ident(), sql)))
            return conn

        monkeypatch.setattr(ssd_index, "_connect", connect)

    def mark(self) -> int:
        return len(self.calls)

    def by(self, thread: int, since: int = 0) -> list[str]:
        """The statements `thread` ran since `mark()` said `since`."""
        return [sql for t, sql in self.calls[since:] if t == thread]

    def besides(self, thread: int, since: int = 0) -> list[str]:
        return [sql for t, sql in self.calls[since:] if t != thread]


def wait_for(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# -- entries the SSD lost, put again ---------------------------------------------------


def test_a_request_puts_what_the_ssd_lost_again_without_asking_the_index(tmp_path, monkeypatch):
    """The index deleted while serving, and three entry files with it. The writer thread
    finds the loss and makes a new index, which adopts the four files left; it asks that
    index which entries RAM holds survived, so only the three lost ones wait to be put
    again. The next request puts them (on the MLX thread, here this one) and asks the
    index nothing. Before: all seven waited, and the request asked the index (and stat'ed
    the file) of each one it took, on the MLX thread."""
    sql = IndexCalls(monkeypatch)
    root = tmp_path / "cache"
    # The writer looks for its index on its own, as a server's does about once a second.
    ssd = SSDStore(SSDConfig(root=root, reconcile="sync", check_interval_s=0.02))
    t = TieredCache(CacheManager(1 << 30, block_size=BS), ssd, kv.HostCodec())
    c = make_chain(TOKENS, EXTRA)
    t.store_blocks(c, SCOPE, {i: block(i) for i in range(7)})
    assert ssd.flush() and ssd.stats().writes == 7
    for key in c.hashes[4:]:
        files.entry_path(root, (SCOPE.model, SCOPE.tenant, EntryKind.BLOCK, key)).unlink()
    (root / "index.sqlite3").unlink()
    wait_for(lambda: ssd.stats().folder_losses == 1, "the writer to find the loss")
    assert ssd.check_folder()  # waits for the writer's own look to be over
    assert t.writes.stats().rewrites_pending == 3  # before: 7

    me, start = threading.get_ident(), sql.mark()
    t.catch_up(SCOPE, needs_checkpoint=False)  # what a request's restore does first
    assert sql.by(me, start) == []
    assert t.writes.stats().rewrites_pending == 0
    assert ssd.flush() and ssd.stats().writes == 7 + 3  # the survivors are not rewritten
    assert ssd.contains_many(SCOPE, EntryKind.BLOCK, c.hashes) == [True] * 7
    t.close(5.0)


# -- the periodic write rule -----------------------------------------------------------


def hybrid_tiers(ssd: SSDStore, every: int) -> TieredCache:
    t = TieredCache(
        CacheManager(1 << 30, block_size=BS), ssd, kv.HostCodec(), policy=WritePolicy.THROUGH,
        checkpoint_delay_s=HOUR, periodic_write_every=every,
    )  # fmt: skip
    t.catch_up(SCOPE, needs_checkpoint=True)  # a snapshot model's request
    return t


def prefill(t: TieredCache, c, start: int, end: int) -> None:
    """What a prefill from `start` to `end` stores: blocks, then a periodic checkpoint
    every 2 tokens (a boundary first when it starts at 0)."""
    t.store_blocks(c, SCOPE, {i: block(i) for i in range(start // BS, end // BS)})
    if start == 0:
        t.store_checkpoint(c, SCOPE, 3, tier_payloads.checkpoint(3), CheckpointReason.BOUNDARY)
    for p in range(start + 2 if start else 4, end + 1, 2):
        t.store_checkpoint(c, SCOPE, p, tier_payloads.checkpoint(p), CheckpointReason.PERIODIC)


def checkpoints_on_disk(ssd: SSDStore, c, positions) -> set[int]:
    assert ssd.flush(30.0)
    found = ssd.contains_many(SCOPE, EntryKind.CHECKPOINT, [c.checkpoint_key(p) for p in positions])
    return {p for p, present in zip(positions, found, strict=True) if present}


def test_the_periodic_write_rule_asks_the_index_nothing_and_holds_across_a_restart(
    tmp_path, monkeypatch
):
    """A long prefill's periodic checkpoints go to disk every 16 tokens at most from the
    first boundary (as tests/ssd/test_ssd_wear_rules.py checks), decided from what RAM and
    this process know, with no index query on the MLX thread. After a restart the next
    request resumes from the deepest one on disk, and the rest of its prefill writes none
    (within 16 tokens of where it resumed) without asking the index either."""
    sql = IndexCalls(monkeypatch)
    c = make_chain(list(range(600, 645)), EXTRA)  # 11 full blocks and 1 token
    me = threading.get_ident()
    with SSDStore(SSDConfig(root=tmp_path, reconcile="off")) as ssd:
        t = hybrid_tiers(ssd, every=16)
        start = sql.mark()
        prefill(t, c, 0, 36)  # a crash after 36 tokens: nothing held back is written
        assert sql.by(me, start) == []  # before: one query per periodic checkpoint
        assert checkpoints_on_disk(ssd, c, range(3, 37)) == {3, 18, 34}

    with SSDStore(SSDConfig(root=tmp_path, reconcile="sync")) as ssd:
        t = hybrid_tiers(ssd, every=16)
        hit = t.lookup(c, SCOPE, needs_checkpoint=True)  # no read-ahead here: it asks
        assert t.promote(hit)
        match = t.pin(hit, promoted=True)
        assert match.length == 34
        t.ram.release(match)
        start = sql.mark()
        prefill(t, c, 34, 44)
        assert sql.by(me, start) == []
        assert checkpoints_on_disk(ssd, c, range(35, 45)) == set()


# -- the probe -------------------------------------------------------------------------


def test_the_probe_asks_the_index_on_the_io_threads_and_a_hung_one_costs_only_it(
    demo_root, tmp_path, monkeypatch
):
    """POST /v1/cache/probe's lookup: the SSD's index is asked on the tiers' I/O threads
    under the read-ahead's deadline, the MLX thread then looks up RAM and those answers.
    An index that hangs leaves the probe at its deadline with the SSD a miss. Before: the
    probe's lookup asked the index on the MLX thread, which waited out the hang."""
    sql = IndexCalls(monkeypatch)
    engine = make_engine(fresh_cache_dir(demo_root, tmp_path / "cache"))
    runner = asyncio.Runner()
    try:
        runner.run(text_of(engine, WAITING))  # stored, and written through to the SSD
        assert engine.tiers.ssd.flush(30)
        runner.run(engine.scheduler.run(empty_ram, engine))
        mlx = runner.run(engine.scheduler.run(threading.get_ident))

        start = sql.mark()
        probe = runner.run(engine.probe(WAITING))
        assert probe.ram_tokens == 0 and probe.ssd_tokens > 0, probe  # on the SSD only
        assert sql.by(mlx, start) == []
        assert sql.besides(mlx, start), "the index was asked, off the MLX thread"
        assert runner.run(engine.probe(WAITING)) == probe  # it promoted nothing

        real = engine.tiers.ssd.contains_many

        def hung(*args, **kwargs):
            time.sleep(2.0)
            return real(*args, **kwargs)

        monkeypatch.setattr(engine.tiers.ssd, "contains_many", hung)
        engine.tiers.reads.ssd_stall_s = 0.3
        sent = time.perf_counter()
        late = runner.run(engine.probe(WAITING))
        assert time.perf_counter() - sent < 1.5
        assert (late.ssd_tokens, late.recompute_tokens) == (0, probe.prompt_tokens), late
        assert engine.tiers.reads.stats().late_ssd == 1
    finally:
        runner.run(engine.close())
        runner.close()
