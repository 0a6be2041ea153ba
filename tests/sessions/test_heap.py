"""glibc heap tuning (engine_bridge/ops/heap.py), each case in a fresh process: the mmap
threshold a large free would raise stays at 128 KiB once tuned, and the heap figures add up."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine_bridge.ops import heap

pytestmark = pytest.mark.skipif(not heap.usage(), reason="needs glibc (mallinfo2, mallopt)")

# Free a 4 MB block (glibc then raises its threshold to 4 MB unless tuned), then take 1 MB:
# print how many bytes of it went to an mmapped chunk rather than the heap arena.
PROBE = """
import ctypes, ctypes.util, sys
from engine_bridge.ops import heap
if sys.argv[1] == "tune":
    assert heap.tune()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.free(libc.malloc(4 << 20))
before = heap.usage()["heap_mmap_bytes"]
block = libc.malloc(1 << 20)
print(heap.usage()["heap_mmap_bytes"] - before)
"""


def _mmapped(mode: str, **env: str) -> int:
    run_env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"} | env
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, env=run_env
    )
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


def test_a_tuned_threshold_keeps_large_blocks_out_of_the_heap_after_a_large_free():
    assert _mmapped("plain") == 0, "untuned, the 4 MB free raised the threshold past 1 MB"
    assert _mmapped("tune") >= 1 << 20


def test_a_threshold_the_user_set_is_left_alone():
    code = "from engine_bridge.ops import heap; print(heap.tune())"
    env = os.environ | {"MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.strip() == "False"


def test_the_heap_figures_are_consistent():
    u = heap.usage()
    assert u["heap_in_use_bytes"] >= u["heap_mmap_bytes"] >= 0 and u["heap_free_bytes"] >= 0
