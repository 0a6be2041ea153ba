"""Folder layout and crash-safe file operations of the SSD tier.

    <root>/<model>/<tenant>/<kind>/<hh>/<hash>.safetensors   entries, hh = first hex byte
    <root>/quarantine/                                       files that failed validation
    <root>/index.sqlite3                                     the index (see index.py)
Anything else under the root (e.g. `models/`, the demo model builds) is not ours.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Iterator, Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from engine_bridge.cache.kinds import EntryKind
from engine_bridge.cache.ssd.index import RawId, is_valid_name

QUARANTINE = "quarantine"
SUFFIX = ".safetensors"
TEMP_SUFFIX = ".tmp"
# A temp file of a live writer is kept unless it is older than this (its writer is stuck
# or the pid was reused); a dead writer's temp file is removed at once.
STALE_TEMP_S = 3600.0
QUARANTINE_KEEP = 100


def entry_path(root: Path, rid: RawId) -> Path:
    model, tenant, kind, key = rid
    h = key.hex()
    return root / model / tenant / kind / h[:2] / f"{h}{SUFFIX}"


def makedirs_private(path: Path) -> None:
    """mkdir -p with mode 0700 on every level created (os.makedirs only applies it to the leaf)."""
    if path.is_dir():
        return
    if path.parent != path:
        makedirs_private(path.parent)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        if not path.is_dir():
            raise


def write_atomic(path: Path, chunks: Sequence[bytes | memoryview]) -> None:
    """Temp name in the same folder, fsync, rename over the final name, fsync the folder.

    A reader (or a restart after kill -9) sees either no file or the whole file.
    """
    makedirs_private(path.parent)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        try:
            for chunk in chunks:
                view = memoryview(chunk)
                while view.nbytes:
                    view = view[os.write(fd, view[: 1 << 30]) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def probe_write(folder: Path, nbytes: int = 4096) -> None:
    """Take the steps an entry write takes (make the folder, create, fill and fsync a temp
    file) with a throwaway file, so a probe fails as a write would; raises OSError."""
    makedirs_private(folder)
    # The temp name's form, so that reconcile removes it if this process dies mid-probe.
    tmp = folder / f".probe.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        try:
            os.write(fd, bytes(nbytes))
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        with suppress(OSError):
            os.unlink(tmp)


def fsync_dir(path: Path) -> None:
    """Make a rename durable; best effort (not every platform lets a folder be fsynced)."""
    with suppress(OSError):
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@dataclass(frozen=True, slots=True)
class FoundFile:
    rid: RawId | None  # None for a temp file
    path: str


def walk_entries(root: Path, model: str | None = None) -> Iterator[FoundFile]:
    """Entry files and temp files in the layout; other files are not ours and are skipped.

    Uses scandir's cached file types, so 100k entries cost no stat calls.
    """
    models = [model] if model is not None else [e.name for e in _subdirs(str(root))]
    for m in models:
        if not is_valid_name(m):
            continue
        for tenant in _subdirs(os.path.join(root, m)):
            if not is_valid_name(tenant.name):
                continue
            for kind in EntryKind:
                for shard in _subdirs(os.path.join(tenant.path, kind)):
                    for f in _files(shard.path):
                        rid = _parse_name(f.name, shard.name, m, tenant.name, kind)
                        if rid is not None:
                            yield FoundFile(rid, f.path)
                        elif f.name.startswith(".") and f.name.endswith(TEMP_SUFFIX):
                            yield FoundFile(None, f.path)


def is_stale_temp(path: str) -> bool:
    """True for a temp file whose writer is gone (by pid) or that is very old."""
    parts = os.path.basename(path).split(".")  # ["", hash, pid, random, "tmp"]
    try:
        pid = int(parts[2])
        age = time.time() - os.stat(path).st_mtime
    except (IndexError, ValueError):
        return True
    except OSError:
        return False
    return pid == os.getpid() or age > STALE_TEMP_S or not _pid_alive(pid)


def quarantine(root: Path, rid: RawId, path: Path, inode: int | None = None) -> None:
    """Move a bad file aside for inspection (or delete it if it cannot be moved).

    With `inode`, only the file that was actually read is moved: if it was replaced by a
    fresh write in the meantime, the new file is left alone.
    """
    model, tenant, kind, _ = rid
    try:
        if inode is not None and os.stat(path).st_ino != inode:
            return
        qdir = root / QUARANTINE
        makedirs_private(qdir)
        os.replace(path, qdir / f"{model}.{tenant}.{kind}.{path.name}.{time.time_ns()}")
    except FileNotFoundError:
        return
    except OSError:
        with suppress(OSError):
            os.unlink(path)


def prune_quarantine(root: Path, keep: int = QUARANTINE_KEEP) -> None:
    """Keep the newest `keep` quarantined files, so a failing disk cannot fill the folder."""
    qdir = root / QUARANTINE
    with suppress(OSError):
        files = sorted(_files(str(qdir)), key=lambda e: e.stat().st_mtime, reverse=True)
        for f in files[keep:]:
            with suppress(OSError):
                os.unlink(f.path)


def remove_empty_dirs(root: Path, model: str | None = None) -> None:
    """Drop empty layout folders bottom-up (after a clear); never a folder with files."""
    models = [model] if model is not None else [e.name for e in _subdirs(str(root))]
    for m in models:
        if not is_valid_name(m):
            continue
        for dirpath, _, _ in sorted(os.walk(root / m), key=lambda w: -len(w[0])):
            with suppress(OSError):
                os.rmdir(dirpath)


def _parse_name(name: str, shard: str, model: str, tenant: str, kind: str) -> RawId | None:
    if len(name) != 64 + len(SUFFIX) or not name.endswith(SUFFIX) or name[:2] != shard:
        return None
    try:
        key = bytes.fromhex(name[:64])
    except ValueError:
        return None
    if key.hex() != name[:64]:  # upper-case hex is not a name we write
        return None
    return (model, tenant, kind, key)


def _subdirs(path: str) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return [e for e in it if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def _files(path: str) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return [e for e in it if e.is_file(follow_symlinks=False)]
    except OSError:
        return []


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
