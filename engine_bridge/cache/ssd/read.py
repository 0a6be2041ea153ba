"""Reading one SSD entry back: open it, check its size against the index, validate every
byte (ssd_format), and say why it cannot be served when it cannot; the store decides what
that costs (a forgotten row, a quarantined file, a counted read error)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from engine_bridge.cache.ssd import files
from engine_bridge.cache.ssd.format import FormatError, read_entry
from engine_bridge.cache.ssd.index import RawId
from engine_bridge.cache.ssd.types import SSDEntry


@dataclass(frozen=True, slots=True)
class Unreadable:
    """Why an entry was not served: "gone" (deleted since the lookup), "changed"
    (rewritten since, a plain miss), "error" (an I/O error) or "corrupt" (quarantine it)."""

    why: Literal["gone", "changed", "error", "corrupt"]
    path: Path
    inode: int | None = None
    detail: str = ""


def read_file(
    root: Path, rid: RawId, size: int, size_now: Callable[[], int | None]
) -> SSDEntry | Unreadable:
    """The entry `rid` of `size` bytes (the index's figure; `size_now` asks it again)."""
    path = files.entry_path(root, rid)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return Unreadable("gone", path)
    except OSError as e:
        return Unreadable("error", path, detail=str(e))
    inode = None
    try:
        st = os.fstat(fd)
        inode = st.st_ino
        if st.st_size != size:
            if size_now() == st.st_size:
                return Unreadable("changed", path, inode)
            raise FormatError(f"file is {st.st_size} bytes, the index says {size}")
        header, tensors = read_entry(fd, size, rid[3])
    except FormatError as e:
        return Unreadable("corrupt", path, inode, str(e))
    except OSError as e:
        return Unreadable("error", path, inode, str(e))
    finally:
        os.close(fd)
    return SSDEntry(tensors, dict(header.meta))
