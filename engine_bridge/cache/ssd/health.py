"""Noticing, while serving, that the SSD tier's folder was deleted or stopped taking writes.

Deleted: a user or a disk cleaner removes the cache folder, or one model's folder in it,
under a running server. Nothing fails then: SQLite keeps writing into the unlinked index
file, and every write "succeeds" into a file no restart will find. So the store looks: it
compares the index file at its path with the one it has open (device and inode) before
each write and about once a second, and before writing into a scope's folder that is
missing it asks the index whether entries were there.

Unwritable: a failed write (permission denied, disk full, read-only mount) turns the tier
RAM-only with one warning. Probes then repeat what failed (a temp file created, written,
fsynced and removed in the same folder, and one index write), backing off from seconds to
the maintenance interval; the first that succeeds turns writing back on.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine_bridge.cache.ssd import files, maintenance
from engine_bridge.cache.ssd.index import Index, Scope, index_path
from engine_bridge.cache.ssd.maintenance import ReconcileReport

log = logging.getLogger(__name__)

FileId = tuple[int, int]  # (st_dev, st_ino)


def file_id(path: Path) -> FileId | None:
    """Which file `path` names now; None if nothing does. Other OSErrors (a folder on the
    way that cannot be searched) propagate: then nobody can tell, and nobody should guess."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino)


def missing(path: Path) -> bool:
    """True only if `path` is known not to exist (an unreadable parent is not 'missing')."""
    try:
        return file_id(path) is None
    except OSError:
        return False


def identity(root: Path) -> tuple[FileId | None, FileId | None]:
    """The cache folder and its index file as they are now; OSError if that cannot be seen."""
    return file_id(root), file_id(index_path(root))


def what_changed(root: Path, opened: tuple[FileId | None, FileId | None]) -> str | None:
    """What happened to the folder and index the store opened (`identity` then): None while
    both are still the same files, or when that cannot be seen."""
    try:
        folder, index = identity(root)
    except OSError:
        return None
    if (folder, index) == opened:
        return None
    if folder != opened[0]:  # gone, or gone and made again (by a write into it)
        return f"cache folder {root} was deleted while serving"
    if index is None:
        return f"the index {index_path(root)} was deleted while serving"
    return f"the index {index_path(root)} was replaced while serving"


@dataclass(slots=True)
class Retry:
    """When to probe a disabled tier again: after `first_s`, then twice as long each time
    a probe fails, up to `max_s`. A write that fails again soon after a resume doubles the
    delay too, so a fault that comes and goes (a disk a few bytes from full) backs off to
    one warning per `max_s`."""

    first_s: float
    max_s: float
    delay: float = 0.0
    at: float = 0.0
    last_resume: float = float("-inf")

    def schedule(self, now: float) -> None:
        """A write just failed."""
        flapping = now - self.last_resume < 2 * self.max_s
        self.delay = (
            min(self.max_s, max(self.first_s, self.delay * 2)) if flapping else self.first_s
        )
        self.at = now + self.delay

    def due(self, now: float) -> bool:
        return now >= self.at

    def failed(self, now: float) -> None:
        self.delay = min(self.max_s, max(self.first_s, self.delay * 2))
        self.at = now + self.delay

    def resumed(self, now: float) -> None:
        self.last_resume = now


class FolderWatch:
    """The store's open index, and the checks that it is still the cache folder's.

    The store owns the policy (counters, the disabled state, telling the tier above); this
    owns the files. Every method runs under the store's I/O lock.
    """

    def __init__(
        self,
        root: Path,
        retry: Retry,
        *,
        max_entry_bytes: int,
        disable: Callable[[str, Path | None], None],
        enable: Callable[[], str | None],
        lost: Callable[[Scope | None], int],
    ) -> None:
        self.root = root
        self.retry = retry
        self.index: Index | None = None
        self.probe_dir = root  # where the write that disabled the tier failed
        self.losses = 0  # folders or indexes found deleted while serving
        self.resumes = 0
        self._opened: tuple[FileId | None, FileId | None] = (None, None)
        self._abandoned: list[Index] = []  # see `_reopen`
        self._max_entry_bytes = max_entry_bytes
        self._disable, self._enable, self._lost = disable, enable, lost

    def open(self) -> None:
        """At start: the index (made if missing), else a read-only one, else none."""
        try:
            files.makedirs_private(self.root)
            self.index = Index.open(self.root)
        except (OSError, sqlite3.Error) as e:
            self._disable(f"cannot open {self.root}: {e}", None)
            try:  # reads may still work from an existing, read-only cache
                self.index = Index.open_readonly(self.root)
            except (OSError, sqlite3.Error):
                self.index = None
        self._opened = self._identity()

    def close(self) -> None:
        if self.index is not None:
            self.index.close()

    def check(self) -> None:
        """Make the folder and index again if they were deleted (or replaced) under us."""
        if self.index is None:
            return  # nothing open: the retry probes open one
        what = what_changed(self.root, self._opened)
        if what is None:
            return
        try:
            report = self._reopen()
        except (OSError, sqlite3.Error) as e:
            self.losses += 1
            self._disable(f"{what}, and making it again failed: {e}", None)
            return
        self.losses += 1
        n = self._lost(None)
        log.warning(
            "SSD cache: %s; made it again with a new index (%d entry files were still there), "
            "and the %d entries still held in RAM will be written again",
            what, report.adopted, n,
        )  # fmt: skip

    def check_scopes(self) -> None:
        """Drop the rows of every model or tenant folder deleted by hand."""
        self.check()  # a deleted root first: it is one loss, not one per scope
        if self.index is not None and not self.index.read_only:
            for scope in self.index.scopes():
                self.check_scope(scope)

    def check_scope(self, scope: Scope) -> None:
        """Before a write into `scope`: was its folder deleted with entries in it?"""
        index, folder = self.index, self.root / scope.model / scope.tenant
        # A missing folder is normal before its first write: only rows make it a loss.
        if index is None or index.read_only or not missing(folder) or not index.has_scope(scope):
            return
        dropped = index.remove_scope(scope)
        self.losses += 1
        n = self._lost(scope)
        log.warning(
            "SSD cache: folder %s was deleted while serving, with %d entries; the %d entries "
            "of it still held in RAM will be written again",
            folder, dropped, n,
        )  # fmt: skip

    def try_resume(self, now: float) -> None:
        """Probe what failed; on success take writes again and say so."""
        try:
            if self.index is None or self.index.read_only:
                self._reopen()
            assert self.index is not None
            self.index.probe_write()
            files.probe_write(self.probe_dir)
        except (OSError, sqlite3.Error) as e:
            self.retry.failed(now)
            log.debug("SSD cache: still RAM-only; probing %s failed: %s", self.probe_dir, e)
            return
        reason = self._enable()
        self.retry.resumed(now)
        self.resumes += 1
        n = self._lost(None)
        log.info(
            "SSD cache: writing to %s again (after: %s); the %d entries held in RAM will be "
            "written again where the disk lacks them",
            self.root, reason, n,
        )  # fmt: skip

    def _reopen(self) -> ReconcileReport:
        """Open the index at the path (making folder and index if missing) in place of the
        one open now, and adopt the entry files there."""
        old, self.index = self.index, None  # readers miss meanwhile
        if old is not None:
            try:
                now: FileId | None | int = file_id(index_path(self.root))
            except OSError:
                now = -1
            # Closing runs SQLite's last-connection cleanup, which deletes the -wal and -shm
            # files by path: right for our own, wrong if another index lives there now.
            if now is None or now == self._opened[1]:
                old.close()
            else:
                self._abandoned.append(old)
        files.makedirs_private(self.root)
        index = Index.open(self.root)
        self._opened = self._identity()
        self.index = index
        return maintenance.reconcile(self.root, index, max_entry_bytes=self._max_entry_bytes)

    def _identity(self) -> tuple[FileId | None, FileId | None]:
        try:
            return identity(self.root)
        except OSError:
            return (None, None)


def warn_disabled(reason: str, root: Path, retry: Retry) -> None:
    """The one warning when a failed write turns the tier RAM-only, with a hint for the
    usual causes."""
    hint = ""
    if f"[Errno {errno.ENOSPC}]" in reason:
        hint = " (disk full)"
    elif f"[Errno {errno.EACCES}]" in reason or f"[Errno {errno.EPERM}]" in reason:
        hint = " (permission denied)"
    log.warning(
        "SSD cache disabled, continuing RAM-only%s: %s; cache folder %s, writes resume "
        "once a probe succeeds (next in %.0fs, then at most every %.0fs)",
        hint, reason, root, retry.delay, retry.max_s,
    )  # fmt: skip
