"""A cache folder checked offline: index rows against entry files, every checksum verified."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from engine_bridge.cache.ssd import files as ssd_files
from engine_bridge.cache.ssd.format import FormatError, verify_file
from engine_bridge.cache.ssd.index import Index


@dataclass(slots=True)
class DiskScan:
    """Index rows against entry files, every file's checksum verified."""

    rows: int = 0
    files: int = 0
    bytes: int = 0
    temps: int = 0
    torn: int = 0  # files under an entry name that fail validation
    rows_without_files: int = 0
    files_without_rows: int = 0
    size_mismatches: int = 0
    quarantined: int = 0  # files in <root>/quarantine
    problems: list[str] = field(default_factory=list)

    @property
    def inconsistent(self) -> int:
        return (
            self.rows_without_files + self.files_without_rows + self.size_mismatches
            + self.temps + self.torn
        )  # fmt: skip


def scan(root: Path) -> DiskScan:
    out = DiskScan()
    index = Index.open_readonly(root)
    rows = {} if index is None else {r.rid: r.size for r in index.rows()}
    if index is not None:
        index.close()
    on_disk: dict = {}
    for found in ssd_files.walk_entries(root):
        if found.rid is None:
            out.temps += 1
            continue
        fd = os.open(found.path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            on_disk[found.rid] = size
            verify_file(fd, size, expect_key=found.rid[3])
        except FormatError as e:
            out.torn += 1
            out.problems.append(f"torn {found.path}: {e}")
        finally:
            os.close(fd)
    out.rows, out.files, out.bytes = len(rows), len(on_disk), sum(on_disk.values())
    out.rows_without_files = len(rows.keys() - on_disk.keys())
    out.files_without_rows = len(on_disk.keys() - rows.keys())
    both = rows.keys() & on_disk.keys()
    out.size_mismatches = sum(rows[r] != on_disk[r] for r in both)
    q = root / ssd_files.QUARANTINE
    out.quarantined = len(list(q.iterdir())) if q.is_dir() else 0
    return out
