"""Give freed heap memory back to the system, where the C library keeps it otherwise.

Also `tune`: glibc raises its mmap threshold each time a large mmapped block is freed (up to
32 MB). MLX's CPU buffers come and go at many sizes, so after the first few frees they all
land in the heap arenas, between small long-lived objects that pin the pages: over 10,000
soak requests, 46 → 76 MB sat free but kept, and RSS peaked 49 MB higher than with the
threshold fixed at its 128 KiB default, where free-but-kept stayed 16-22 MB at the same
request rate (tests/tools/soak.py, side by side).

glibc's malloc keeps what a thread frees in that thread's arena for reuse. A server whose
request threads, MLX thread and SSD writer allocate and free all day holds on to tens of
megabytes that nothing uses: the load soak saw RSS creep about 6 MB a minute at a steady
state, and one ``malloc_trim(0)`` gave back 56 MB of it. macOS's allocator returns memory by
itself, so there this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

log = logging.getLogger(__name__)


def _glibc(name: str, argtypes: list, restype):
    """One of the C library's malloc functions, or None where it has none (not Linux, or
    not glibc: musl has no malloc_trim, and mallinfo2 needs glibc 2.33)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = argtypes, restype
    return fn


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


_TRIM = _glibc("malloc_trim", [ctypes.c_size_t], ctypes.c_int)
_INFO = _glibc("mallinfo2", [], _Mallinfo2)
_MALLOPT = _glibc("mallopt", [ctypes.c_int, ctypes.c_int], ctypes.c_int)
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD = 128 * 1024  # glibc's own starting value, kept from moving up


def tune() -> bool:
    """Fix glibc's mmap threshold at 128 KiB (see above), unless the environment sets it
    (MALLOC_MMAP_THRESHOLD_); False where there is nothing to do."""
    if _TRIM is None or _MALLOPT is None or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False  # no malloc_trim: not glibc (musl's mallopt does nothing)
    return bool(_MALLOPT(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def trim() -> bool:
    """Return free heap pages to the system; False where the C library cannot."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


def usage() -> dict[str, int]:
    """The C heap, every arena: bytes in use (MLX's CPU buffers included), bytes free but
    kept, and bytes in mmapped chunks. Empty where the C library cannot say. Free bytes that
    grow while in-use bytes do not are fragmentation, not a leak."""
    if _INFO is None:
        return {}
    m = _INFO()
    return {
        "heap_in_use_bytes": m.uordblks + m.hblkhd,
        "heap_free_bytes": m.fordblks,
        "heap_mmap_bytes": m.hblkhd,
    }
