"""SSD tier: a persistent, crash-safe, content-addressed store of cache entries.

Works on host bytes only (HostTensor), under the RAM tier. Writes go through one writer
thread behind a bounded queue that drops rather than blocks; reads run on the caller's
thread and validate every byte before returning it. Any I/O fault degrades to a miss or
to RAM-only operation, counted and logged once; nothing here raises into a request. A
folder deleted under the store is made again, and a tier turned RAM-only by a failed
write resumes once a probe succeeds (ssd_health); either way the owner hears of it through
`on_lost`, to write again what RAM still holds.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from engine_bridge.cache.evictions import Cause, EvictionRecord
from engine_bridge.cache.kinds import EntryKind, PutReason
from engine_bridge.cache.ssd import files, health, maintenance
from engine_bridge.cache.ssd.format import encode
from engine_bridge.cache.ssd.index import EntryRow, Index, RawId, Scope
from engine_bridge.cache.ssd.maintenance import ReconcileReport
from engine_bridge.cache.ssd.offline import offline_clear, offline_ls, offline_stats
from engine_bridge.cache.ssd.read import Unreadable, read_file
from engine_bridge.cache.ssd.types import (
    Counters,
    OnLost,
    PutOutcome,
    SSDConfig,
    SSDEntry,
    SSDStats,
)
from engine_bridge.cache.ssd.wear import WEAR_FILE, WearMeter
from engine_bridge.cache.ssd.writer import WriteJob, Writer
from engine_bridge.cache.tensors import HostTensor

__all__ = [
    "PutOutcome",
    "ReconcileReport",
    "SSDConfig",
    "SSDEntry",
    "SSDStats",
    "SSDStore",
    "Scope",
    "offline_clear",
    "offline_ls",
    "offline_stats",
]

log = logging.getLogger(__name__)


class SSDStore:
    """One cache root: every model and tenant under it shares the capacity limit."""

    def __init__(self, config: SSDConfig) -> None:
        self.config = config
        self.root = Path(config.root).expanduser()
        self._lock = threading.Lock()  # counters and touches
        self._io_lock = threading.Lock()  # serialises writes, eviction, reconcile, sweeps
        self._touches: dict[RawId, float] = {}  # last accesses not yet in the index
        self._c = Counters()
        self._disabled_reason: str | None = None
        self._reconciled = threading.Event()
        self.last_reconcile: ReconcileReport | None = None
        # Set by the tier above (TieredCache); called on the writer thread.
        self.on_lost: OnLost | None = None
        # Set by the tier above; called on the writer thread about once a second (it queues
        # held-back checkpoint writes that are due, see checkpoint_writes.py).
        self.on_tick: Callable[[], object] | None = None
        # What LRU eviction and the TTL deleted lately, so a later miss can say which.
        self.evicted = EvictionRecord()
        self._next_check = 0.0
        self.wear = WearMeter(self.root / WEAR_FILE, config.max_write_per_day)
        self._watch = health.FolderWatch(
            self.root,
            health.Retry(config.retry_s, max(config.retry_s, config.maintenance_interval_s)),
            max_entry_bytes=config.max_bytes,
            disable=self._disable,
            enable=self._enable,
            lost=self._notify_lost,
        )
        self._watch.open()
        if config.reconcile == "sync":
            self.reconcile()
        self._writer = Writer(
            process=self._process,
            maintain=self._maintain,
            startup=self._startup,
            on_drop=lambda job: self._count("queue_drops", None),
            on_exit=self._shutdown,
            tick=self._tick,
            queue_size=config.queue_size,
            queue_max_bytes=config.queue_max_bytes,
            interval_s=config.maintenance_interval_s,
        )

    # ---- requests -------------------------------------------------------------------

    def put(
        self,
        scope: Scope,
        kind: EntryKind,
        key: bytes,
        tensors: Mapping[str, HostTensor],
        meta: Mapping[str, str] | None = None,
        *,
        tokens: int = 0,
        tags: str = "",
        reason: PutReason = PutReason.WRITE_THROUGH,
        skip: Callable[[], bool] | None = None,
    ) -> PutOutcome:
        """Queue an entry for writing; never blocks, never raises on I/O.

        The tensors' bytes must not change afterwards (they are written later, by reference).
        `skip()`, asked by the writer just before it writes, drops an entry that has become
        useless while it waited (a checkpoint superseded by a deeper one).
        """
        assert isinstance(kind, EntryKind), f"kind {kind!r} is not an EntryKind"
        reason = PutReason(reason)  # a stray string fails here, naming itself
        assert len(key) == 32, f"entry key must be 32 bytes, got {len(key)}"
        if self._disabled_reason is not None:
            return self._count("disabled_drops", "disabled")
        if not self.wear.allow():
            return "dropped"  # today's write cap is reached; reads go on
        rid = (scope.model, scope.tenant, kind, key)
        nbytes = sum(t.nbytes for t in tensors.values())
        job = WriteJob(rid, dict(tensors), dict(meta or {}), tokens, tags, reason, nbytes, skip)
        admission = self._writer.submit(job)
        if admission == "closed":
            return self._count("disabled_drops", "disabled")
        if admission == "duplicate":
            self._count("dedup_skips", None)
        elif admission == "dropped":
            self._count("queue_drops", None)
        return admission

    def contains_many(self, scope: Scope, kind: EntryKind, keys: Sequence[bytes]) -> list[bool]:
        """Which keys are on disk, from the index alone (no file is opened)."""
        found = self._present(scope, kind, keys)
        return [k in found for k in keys]

    def checkpoints_between(self, scope: Scope, lo: int, hi: int) -> list[tuple[int, bytes]]:
        """(position, key) of `scope`'s checkpoints in (lo, hi] on disk, deepest first."""
        return [] if self._index is None else self._index.checkpoints_between(scope, lo, hi)

    def rows(self, scope: Scope, kind: EntryKind, keys: Sequence[bytes]) -> list[EntryRow]:
        """The index rows of those keys that are on disk (sizes, last use; no file opened)."""
        try:
            return [] if self._index is None else self._index.select(scope, kind, keys)
        except sqlite3.Error:
            return []

    def delete(self, select: Callable[[Index], list[EntryRow]]) -> tuple[int, int]:
        """Delete now (file, then row) the entries `select(index)` names, e.g. a deleted
        session's own; returns (entries, bytes). Queued writes are not waited for."""
        with self._io_lock:
            index = self._index
            if index is None:
                return 0, 0
            try:
                rows = select(index)
                return maintenance.delete_entries(self.root, index, rows), sum(r.size for r in rows)
            except sqlite3.Error as e:
                log.warning("SSD cache: deleting entries failed: %s", e)
                return 0, 0

    def holds(self, scope: Scope, kind: EntryKind, key: bytes) -> bool:
        """Whether the index has the entry and its file is there (one stat: for writing
        lost entries again, not for lookups, which trust the index)."""
        path = files.entry_path(self.root, (scope.model, scope.tenant, kind, key))
        return bool(self._present(scope, kind, [key])) and not health.missing(path)

    def get(
        self,
        scope: Scope,
        kind: EntryKind,
        key: bytes,
        *,
        reserve: Callable[[int], bool] | None = None,
        release: Callable[[int], None] | None = None,
    ) -> SSDEntry | None:
        """Read and validate one entry; None on a miss, a corrupt file or a refused reserve.

        `reserve(nbytes)` is asked before anything is read or allocated; when it says no,
        nothing is read and a promotion failure is counted. If it said yes but the read
        then fails, `release(nbytes)` hands the reservation back.
        """
        rid = (scope.model, scope.tenant, kind, key)
        try:
            size = None if self._index is None else self._index.size_of(scope, kind, key)
        except sqlite3.Error:
            size = None
        if size is None:
            return self._count("misses", None)
        if reserve is not None and not reserve(size):
            return self._count("promotion_failures", None)
        start = time.perf_counter()
        entry = None
        try:
            entry = self._read(rid, size)
        finally:
            if entry is None and reserve is not None and release is not None:
                release(size)
        if entry is None:
            return self._count("misses", None)
        seconds = time.perf_counter() - start
        with self._lock:
            self._c.hit(seconds, size)
            self._touches[rid] = time.time()
        return entry

    def stats(self) -> SSDStats:
        try:
            entries, nbytes = (0, 0) if self._index is None else self._index.totals()
        except sqlite3.Error:
            entries, nbytes = (0, 0)
        wear = self.wear.stats()
        with self._lock:
            return self._c.snapshot(
                entries=entries,
                bytes=nbytes,
                max_bytes=self.config.max_bytes,
                queued=self._writer.pending,
                folder_losses=self._watch.losses,
                resumes=self._watch.resumes,
                disabled=self._disabled_reason is not None,
                disabled_reason=self._disabled_reason,
                written_today_bytes=wear.written_today_bytes,
                max_write_per_day=wear.max_write_per_day,
                write_capped=wear.capped,
                capped_drops=wear.capped_drops,
                write_history=wear.history,
            )

    @property
    def room(self) -> int:
        """About how many more entries `put` would queue now without dropping."""
        return self._writer.room

    def check_folder(self, timeout_s: float = 1.0) -> bool:
        """Look now for a deleted folder or index (the writer looks before each write and
        about once a second, and for deleted scope folders once per maintenance interval).
        False if a write held the disk for `timeout_s` (a hung disk must not hang a close)."""
        if not self._io_lock.acquire(timeout=timeout_s):
            return False
        try:
            self._watch.check_scopes()
        finally:
            self._io_lock.release()
        return True

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued entry has been written or dropped; False on timeout."""
        return self._writer.flush(timeout_s)

    def wait_reconciled(self, timeout_s: float = 10.0) -> bool:
        return self._reconciled.wait(timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Drain the queue for at most `timeout_s`, drop the rest, close the index."""
        if not self._writer.close(timeout_s):
            log.warning("SSD cache: writer still busy after %.1fs; it closes on its own", timeout_s)

    def __enter__(self) -> SSDStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- maintenance ----------------------------------------------------------------

    def reconcile(self) -> ReconcileReport:
        """Make index and files agree (see ssd_maintenance.reconcile), then apply the TTL."""
        start = time.perf_counter()
        report = ReconcileReport()
        if self._index is not None:
            with self._io_lock:
                try:
                    report = maintenance.reconcile(
                        self.root, self._index, max_entry_bytes=self.config.max_bytes
                    )
                    report.expired = self._expire()
                except (OSError, sqlite3.Error) as e:
                    log.warning("SSD cache: reconcile of %s stopped early: %s", self.root, e)
        self._count("quarantined", None, report.quarantined)
        report.seconds = time.perf_counter() - start
        self.last_reconcile = report
        log.info("SSD cache: reconciled %s: %s", self.root, report)
        return report

    def _maintain(self) -> None:
        with self._io_lock:
            try:
                self._watch.check_scopes()
                self._expire()
            except sqlite3.Error as e:
                log.debug("SSD cache: maintenance skipped: %s", e)

    def _tick(self) -> None:
        self.wear.maybe_save()
        if self.on_tick is not None:
            try:
                self.on_tick()
            except Exception:
                log.exception("SSD cache: queueing held-back writes failed")
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + self.config.check_interval_s
        try:
            with self._io_lock:
                self._watch.check()
                if self._disabled_reason is not None and self._watch.retry.due(now):
                    self._watch.try_resume(now)
        except Exception:
            log.exception("SSD cache: checking %s failed", self.root)

    def _expire(self) -> int:
        self._flush_touches()
        if self.config.ttl_s is None or self._index is None or self._disabled_reason:
            return 0
        n = maintenance.expire(
            self.root, self._index, time.time() - self.config.ttl_s, self._deleting("expired")
        )
        return self._count("expired", n, n)

    def _flush_touches(self) -> None:
        with self._lock:
            touches, self._touches = self._touches, {}
        if touches and self._index is not None:
            try:
                self._index.touch(touches.items())
            except sqlite3.Error:
                pass  # a read-only index: LRU order goes stale, nothing worse

    # ---- writer thread callbacks ---------------------------------------------------

    def _startup(self) -> None:
        if self.config.reconcile == "background":
            self.reconcile()
        self._reconciled.set()

    def _shutdown(self) -> None:
        self._reconciled.set()
        try:
            self.wear.save()
            self._flush_touches()
        finally:
            self._watch.close()

    def _process(self, job: WriteJob) -> None:
        try:
            with self._io_lock:
                self._watch.check()
                self._write(job)
        except Exception:
            log.exception("SSD cache: writing entry %s failed", job.rid[3].hex())
            self._count("write_errors", None)

    def _write(self, job: WriteJob) -> None:
        index = self._index
        if self._disabled_reason is not None or index is None:
            self._count("disabled_drops", None)
            return
        model, tenant, kind, key = job.rid
        scope = Scope(model, tenant)
        path = files.entry_path(self.root, job.rid)
        try:
            self._watch.check_scope(scope)
            if index.present(scope, kind, [key]):
                if not health.missing(path):
                    self._count("dedup_skips", None)
                    return
                index.remove([job.rid])  # its file was deleted by hand: write it again
        except sqlite3.Error as e:
            self._disable(f"index unusable: {e}")
            return
        if job.skip is not None and job.skip():
            self._count("superseded_skips", None)
            return
        if not self.wear.allow():
            return
        now = time.time()
        head, chunks = encode(
            key, job.tensors, job.meta, tokens=job.tokens, tags=job.tags, created=now,
        )  # fmt: skip
        size = len(head) + job.nbytes
        if size > self.config.max_bytes:
            self._count("oversize_drops", None)
            return
        try:
            files.write_atomic(path, [head, *chunks])
        except FileNotFoundError as e:
            # Its folder vanished mid-write (a `cache clear` from the CLI): skip this one.
            log.debug("SSD cache: %s", e)
            self._count("write_errors", None)
            return
        except OSError as e:
            self._disable(f"cannot write {path.parent}: {e}", path.parent)
            return
        try:
            index.add([EntryRow(scope, kind, key, size, job.tokens, now, now, job.tags)])
        except sqlite3.Error as e:
            # The file stays: the next start's reconcile adopts it.
            self._disable(f"cannot update the index: {e}")
            return
        with self._lock:
            v = self._c.values
            v["writes"] += 1
            v["bytes_written"] += size
            v["spills" if job.reason is PutReason.SPILL else "write_throughs"] += 1
        self.wear.record(size)
        if index.totals()[1] > self.config.max_bytes:
            self._flush_touches()
            evicted = maintenance.evict_lru(
                self.root, index, self.config.max_bytes, self._deleting("evicted")
            )
            self._count("evictions", None, evicted)

    def _deleting(self, cause: Cause) -> maintenance.OnDelete:
        return lambda rows: self.evicted.add((r.key for r in rows), cause)

    # ---- faults ---------------------------------------------------------------------

    @property
    def _index(self) -> Index | None:
        return self._watch.index

    def _disable(self, reason: str, folder: Path | None = None) -> None:
        with self._lock:
            if self._disabled_reason is not None:
                return
            self._disabled_reason = reason
        self._watch.probe_dir = folder or self.root
        self._watch.retry.schedule(time.monotonic())
        health.warn_disabled(reason, self.root, self._watch.retry)

    def _enable(self) -> str | None:
        with self._lock:
            reason, self._disabled_reason = self._disabled_reason, None
        return reason

    def _notify_lost(self, scope: Scope | None) -> int:
        if self.on_lost is None:
            return 0
        try:
            return self.on_lost(scope)
        except Exception:
            log.exception("SSD cache: re-queueing what RAM holds for %s failed", scope or "all")
            return 0

    def _read(self, rid: RawId, size: int) -> SSDEntry | None:
        got = read_file(self.root, rid, size, lambda: self._size_of(rid))
        if isinstance(got, Unreadable):
            if got.why == "gone":
                self._forget(rid)  # evicted meanwhile, or deleted by hand
            elif got.why == "corrupt":
                log.warning("SSD cache: quarantined %s: %s", got.path, got.detail)
                files.quarantine(self.root, rid, got.path, got.inode)
                self._forget(rid)
                self._count("quarantined", None)
            elif got.why == "error":
                log.debug("SSD cache: cannot read %s: %s", got.path, got.detail)
                self._count("read_errors", None)
            return None
        return got

    def _forget(self, rid: RawId) -> None:
        try:
            if self._index is not None:
                self._index.remove([rid])
        except sqlite3.Error:
            pass

    def _present(self, scope: Scope, kind: EntryKind, keys: Sequence[bytes]) -> set[bytes]:
        try:
            return set() if self._index is None else self._index.present(scope, kind, keys)
        except sqlite3.Error:
            return set()

    def _size_of(self, rid: RawId) -> int | None:
        if self._index is None:
            return None
        try:
            return self._index.size_of(Scope(rid[0], rid[1]), rid[2], rid[3])
        except sqlite3.Error:
            return None

    def _count(self, name: str, result, n: int = 1):
        with self._lock:
            self._c.values[name] += n
        return result
