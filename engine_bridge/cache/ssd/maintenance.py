"""Keeping the SSD tier's files and index in agreement: reconcile, LRU eviction, TTL.

Plain functions over (root, index). The store calls them on one thread at a time, with
last-access times already flushed to the index.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine_bridge.cache.ssd import files
from engine_bridge.cache.ssd.format import FormatError, verify_file
from engine_bridge.cache.ssd.index import EntryRow, Index, RawId, Scope

log = logging.getLogger(__name__)
_BATCH = 256


@dataclass(slots=True)
class ReconcileReport:
    rows_dropped: int = 0  # index rows whose file was gone
    adopted: int = 0  # valid files the index lacked
    temps_removed: int = 0  # left by writers that died mid-write
    quarantined: int = 0
    expired: int = 0
    seconds: float = 0.0


def reconcile(root: Path, index: Index, *, max_entry_bytes: int) -> ReconcileReport:
    """Drop rows without files, adopt valid files without rows, delete dead writers' temp
    files, quarantine what fails validation. Indexed files are trusted here (every read
    validates them), so the cost is one directory scan, not one read per entry."""
    report = ReconcileReport()
    on_disk: dict[RawId, str] = {}
    for found in files.walk_entries(root):
        if found.rid is not None:
            on_disk[found.rid] = found.path
        elif files.is_stale_temp(found.path):
            try:
                os.unlink(found.path)
                report.temps_removed += 1
            except OSError:
                pass
    indexed = index.all_ids()
    report.rows_dropped = index.remove(indexed - on_disk.keys())
    adopted: list[EntryRow] = []
    for rid in on_disk.keys() - indexed:
        row = _adopt(root, rid, Path(on_disk[rid]), max_entry_bytes)
        if row is None:
            report.quarantined += 1
        else:
            adopted.append(row)
    index.add(adopted)
    report.adopted = len(adopted)
    files.prune_quarantine(root)
    return report


# Told the rows about to be deleted (the store records their keys, to explain misses).
OnDelete = Callable[[list[EntryRow]], None]


def evict_lru(root: Path, index: Index, target: int, on_delete: OnDelete | None = None) -> int:
    """Delete least recently used entries until the root holds at most `target` bytes."""
    evicted = 0
    _, total = index.totals()
    while total > target:
        victims = []
        for row in index.least_recent(_BATCH):
            victims.append(row)
            total -= row.size
            if total <= target:
                break
        if not victims:
            break
        if on_delete is not None:
            on_delete(victims)
        evicted += delete_entries(root, index, victims)
        _, total = index.totals()
    return evicted


def expire(root: Path, index: Index, cutoff: float, on_delete: OnDelete | None = None) -> int:
    """Delete entries last used before `cutoff` (epoch seconds)."""
    n = 0
    while rows := index.least_recent(_BATCH, before=cutoff):
        if on_delete is not None:
            on_delete(rows)
        n += delete_entries(root, index, rows)
    return n


def delete_entries(root: Path, index: Index, rows: list[EntryRow]) -> int:
    # File first, then row: a crash in between leaves a row without a file, which the
    # next reconcile drops, rather than a file nobody accounts for.
    for row in rows:
        try:
            os.unlink(files.entry_path(root, row.rid))
        except OSError:
            pass  # already gone; or undeletable, and then re-adopted at next start
    return index.remove(r.rid for r in rows)


def _adopt(root: Path, rid: RawId, path: Path, max_entry_bytes: int) -> EntryRow | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if st.st_size > max_entry_bytes:
            raise FormatError(f"{st.st_size} bytes is more than the whole cache")
        header = verify_file(fd, st.st_size, expect_key=rid[3])
    except (FormatError, OSError) as e:
        log.warning("SSD cache: quarantined %s: %s", path, e)
        files.quarantine(root, rid, path)
        return None
    finally:
        os.close(fd)
    return EntryRow(
        Scope(rid[0], rid[1]), rid[2], rid[3], st.st_size, header.tokens, header.created,
        max(st.st_mtime, header.created), header.tags,
    )  # fmt: skip
