"""Offline views of an SSD cache root for the CLI (`cache stats|ls|clear`); no server needed.

Safe beside a running server: both go through the same SQLite index (WAL, so these reads
never block the server's writer), and clear deletes a file before its row, so the server
sees at worst a miss. Files that are not cache entries (e.g. `models/`) are left alone.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from engine_bridge.cache.session_store import forget_sessions
from engine_bridge.cache.ssd import files
from engine_bridge.cache.ssd.index import Index, RawId, is_valid_name


def offline_ls(root: str | Path) -> list[dict[str, object]]:
    """Per model fingerprint and tenant: entries, blocks, checkpoints, bytes, tokens,
    last access (epoch seconds)."""
    index = _open(Path(root).expanduser(), write=False)
    if index is None:
        return []
    try:
        return index.groups()
    finally:
        index.close()


def offline_stats(root: str | Path) -> dict[str, object]:
    """Totals over the whole root, plus what sits in quarantine."""
    root = Path(root).expanduser()
    groups = offline_ls(root)
    quarantined = _files_in(root / files.QUARANTINE)
    accesses = [g["last_access"] for g in groups if g["last_access"] is not None]
    return {
        "root": str(root),
        "entries": sum(g["entries"] for g in groups),
        "bytes": sum(g["bytes"] for g in groups),
        "blocks": sum(g["blocks"] for g in groups),
        "checkpoints": sum(g["checkpoints"] for g in groups),
        "models": len({g["model"] for g in groups}),
        "tenants": len(groups),
        "last_access": max(accesses, default=None),
        "quarantined_files": len(quarantined),
        "quarantined_bytes": sum(size for _, size in quarantined),
    }


def offline_clear(root: str | Path, model: str | None = None) -> int:
    """Remove cache entries (of one model fingerprint, or all and the quarantine).

    Returns how many entries were removed; other files under the root are kept.
    """
    root = Path(root).expanduser()
    if not root.is_dir() or (model is not None and not is_valid_name(model)):
        return 0
    removed: set[RawId] = set()
    index = _open(root, write=True)
    try:
        if index is not None:
            rows = index.rows(model)
            for row in rows:
                _unlink(files.entry_path(root, row.rid))
            index.remove(r.rid for r in rows)
            removed.update(r.rid for r in rows)
    except sqlite3.Error:
        pass  # rows left without files are dropped by the server's next reconcile
    try:
        for found in files.walk_entries(root, model):  # files the index did not know
            if found.rid is not None:
                _unlink(found.path)
                removed.add(found.rid)
            elif files.is_stale_temp(found.path):
                _unlink(found.path)
    finally:
        if index is not None:
            index.close()
    if model is None:
        for path, _ in _files_in(root / files.QUARANTINE):
            _unlink(path)
    files.remove_empty_dirs(root, model)
    forget_sessions(root, model)  # they referenced what is gone
    return len(removed)


def _open(root: Path, *, write: bool) -> Index | None:
    try:
        return Index.open_existing(root) if write else Index.open_readonly(root)
    except sqlite3.Error:
        return None


def _files_in(folder: Path) -> list[tuple[str, int]]:
    try:
        with os.scandir(folder) as it:
            return [(e.path, e.stat().st_size) for e in it if e.is_file(follow_symlinks=False)]
    except OSError:
        return []


def _unlink(path: str | Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
