"""SSD tier startup and reload: index-ready time at N entries, and read bandwidth back to RAM.

Pure SSD store code, no model and no server. Run it as

    .venv/bin/python -m bench.scenarios.ssd_reload [--entries 100000] [--reload-entries 16] [--mb 64]

BENCH_DIR picks the disk it runs on (default: the system temp folder). It prints one JSON
object; nothing asserts wall time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engine_bridge.cache.kinds import EntryKind
from engine_bridge.cache.ssd import files as ssd_files
from engine_bridge.cache.ssd.format import encode
from engine_bridge.cache.ssd.index import EntryRow, Index, Scope
from engine_bridge.cache.ssd.store import SSDConfig, SSDStore
from engine_bridge.cache.tensors import HostTensor

SCOPE = Scope("model-a")


def key(i: int) -> bytes:
    return hashlib.sha256(f"block-{i}".encode()).digest()


def build_cache(root: Path, n: int, nbytes: int = 256) -> None:
    """n valid entries written straight to disk (no fsync) plus their index rows: fast."""
    ssd_files.makedirs_private(root)
    index = Index.open(root)
    rows, now = [], time.time()
    payload = {"x": HostTensor("U8", (nbytes,), bytes(nbytes))}
    for i in range(n):
        k = key(i)
        head, chunks = encode(k, payload, {}, tokens=64, tags="", created=now)
        path = ssd_files.entry_path(root, (SCOPE.model, SCOPE.tenant, EntryKind.BLOCK, k))
        if not path.parent.is_dir():
            ssd_files.makedirs_private(path.parent)
        with open(path, "wb") as f:
            f.write(head)
            f.writelines(chunks)
        rows.append(EntryRow(SCOPE, EntryKind.BLOCK, k, len(head) + nbytes, 64, now, now - i, ""))
        if len(rows) == 10_000:
            index.add(rows)
            rows = []
    index.add(rows)
    index.close()


def bench_startup(root: Path, n: int) -> dict[str, float]:
    """Time until a store at `root` answers lookups, and how long its reconciles take."""
    if not (root / "index.sqlite3").exists():
        t = time.perf_counter()
        build_cache(root, n)
        print(f"built {n} entries in {time.perf_counter() - t:.1f}s", file=sys.stderr)
    t = time.perf_counter()
    store = SSDStore(SSDConfig(root=root, reconcile="background"))
    first = store.contains_many(SCOPE, EntryKind.BLOCK, [key(i) for i in range(min(n, 64))])
    ready = time.perf_counter() - t
    store.wait_reconciled(120)
    background = time.perf_counter() - t
    store.close()
    store = SSDStore(SSDConfig(root=root, reconcile="off"))
    report = store.reconcile()
    store.close()
    assert all(first) and report.rows_dropped == report.adopted == 0, (first, report)
    return {
        "entries": n,
        "ready_s": ready,
        "background_reconcile_s": background,
        "sync_reconcile_s": report.seconds,
    }


def bench_reload(root: Path, entries: int = 16, mb: int = 64) -> dict[str, float | None]:
    """Write entries through the store, drop them from the page cache, read them back."""
    store = SSDStore(SSDConfig(root=root, reconcile="sync", queue_size=entries + 1))
    for i in range(entries):
        store.put(
            SCOPE,
            EntryKind.BLOCK,
            key(i),
            {"x": HostTensor("U8", (mb << 20,), os.urandom(mb << 20))},
        )
        assert store.flush(120)
    out: dict[str, float | None] = {}
    for label in ("cold", "warm"):
        if label == "cold":
            if not hasattr(os, "posix_fadvise"):  # macOS: dropping pages needs root (purge)
                out["cold_MBps"] = None
                continue
            for p in root.rglob("*.safetensors"):
                fd = os.open(p, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
        t = time.perf_counter()
        for i in range(entries):
            assert store.get(SCOPE, EntryKind.BLOCK, key(i)) is not None
        out[f"{label}_MBps"] = entries * mb / (time.perf_counter() - t)
    store.close()
    return out


def run(entries: int = 100_000, reload_entries: int = 16, mb: int = 64) -> dict[str, Any]:
    """Both measurements in a temporary folder under BENCH_DIR."""
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as d:
        return {
            "startup": bench_startup(Path(d) / "startup", entries),
            "reload": bench_reload(Path(d) / "reload", reload_entries, mb),
        }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.scenarios.ssd_reload", description=__doc__)
    p.add_argument("--entries", type=int, default=100_000, help="index size at startup")
    p.add_argument("--reload-entries", type=int, default=16, help="entries read back")
    p.add_argument("--mb", type=int, default=64, help="size of each entry read back, MiB")
    args = p.parse_args(argv)
    print(json.dumps(run(args.entries, args.reload_entries, args.mb), indent=2))


if __name__ == "__main__":
    main()
