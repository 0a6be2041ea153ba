"""Disk faults for a real server process, loaded through PYTHONPATH by the server tests.

Only the SSD tier's entry files are affected: temp files (`.<hash>.<pid>.<rand>.tmp`) and
the folders under `$MPC_FAULT_ROOT/<model>/`; the index, `models/` and everything else
work as usual. The fault is read from the file `$MPC_FAULT_TRIGGER` on every entry write,
so a test can switch it on while the server runs:

    enospc     writes to a temp file fail with ENOSPC (open succeeds, as on a full disk)
    erofs      creating a temp file or an entry folder fails with EROFS
    slow:SECS  creating a temp file takes SECS longer (a slow disk, to keep a queue busy)
"""

from __future__ import annotations

import errno
import os
import time

_ROOT = os.environ.get("MPC_FAULT_ROOT")
_TRIGGER = os.environ.get("MPC_FAULT_TRIGGER")


def _fault() -> str:
    try:
        with open(_TRIGGER) as f:  # noqa: PTH123 - builtin open is not patched
            return f.read().strip()
    except OSError:
        return ""


def _is_entry_path(path: object) -> bool:
    try:
        p = os.path.abspath(os.fsdecode(path))
    except TypeError:
        return False
    rel = os.path.relpath(p, _ROOT)
    if rel.startswith("..") or rel in (".", "quarantine") or rel.startswith("models"):
        return False
    return os.sep in rel  # below <root>/<model>/, not a file directly in the root


def _install() -> None:
    real_open, real_write, real_close, real_mkdir = os.open, os.write, os.close, os.mkdir
    failing_fds: set[int] = set()

    def fault_open(path, flags, mode=0o777, *, dir_fd=None):
        if flags & os.O_CREAT and str(path).endswith(".tmp") and _is_entry_path(path):
            fault = _fault()
            if fault == "erofs":
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(path))
            if fault.startswith("slow:"):
                time.sleep(float(fault[5:]))
            fd = real_open(path, flags, mode, dir_fd=dir_fd)
            if fault == "enospc":
                failing_fds.add(fd)
            return fd
        return real_open(path, flags, mode, dir_fd=dir_fd)

    def fault_write(fd, data):
        if fd in failing_fds:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    def fault_close(fd):
        failing_fds.discard(fd)  # the number may be reused for a file that works
        return real_close(fd)

    def fault_mkdir(path, mode=0o777, *, dir_fd=None):
        if _is_entry_path(path) and _fault() == "erofs":
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(path))
        return real_mkdir(path, mode, dir_fd=dir_fd)

    os.open, os.write, os.close, os.mkdir = fault_open, fault_write, fault_close, fault_mkdir


if _ROOT and _TRIGGER:
    _install()
