"""SSD tier, recovery: startup reconcile of index against files, and damaged files
quarantined (on read, and at startup when no index row vouches for them)."""

from __future__ import annotations

import json
import os
import random
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from engine_bridge.cache.kinds import EntryKind
from tests.support.ssd_helpers import (
    SCOPE,
    U64,
    as_bytes,
    flip,
    index_rows,
    key,
    open_store,
    path_of,
    quarantined,
    store_fixture,  # noqa: F401 (the `store` fixture)
    tensors,
    write,
)

# ---- reconcile ----------------------------------------------------------------------


def _drop_row(root: Path, k: bytes) -> None:
    with sqlite3.connect(root / "index.sqlite3") as conn:
        conn.execute("DELETE FROM entries WHERE key = ?", (k,))


def test_reconcile_drops_rows_adopts_orphans_and_removes_temps(tmp_path):
    store = open_store(tmp_path)
    for i in range(4):
        write(store, key(i), tensors(i), tokens=64 * (i + 1), tags=f"s{i}")
    store.close()
    path_of(tmp_path, key(0)).unlink()  # row without a file
    _drop_row(tmp_path, key(1))  # file without a row
    shard = path_of(tmp_path, key(2)).parent
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True
    )
    dead_temp = shard / f".{key(2).hex()}.{int(dead.stdout)}.0badc0de.tmp"
    dead_temp.write_bytes(b"half a file")
    live_temp = shard / f".{key(2).hex()}.{os.getppid()}.1badc0de.tmp"  # a live writer's
    live_temp.write_bytes(b"in progress")

    store = open_store(tmp_path)
    report = store.reconcile()  # the constructor ran one already; this one finds nothing
    assert (report.rows_dropped, report.adopted, report.temps_removed) == (0, 0, 0)
    assert store.contains_many(SCOPE, EntryKind.BLOCK, [key(i) for i in range(4)]) == [
        False, True, True, True,
    ]  # fmt: skip
    assert not dead_temp.exists() and live_temp.exists()
    adopted = store.get(SCOPE, EntryKind.BLOCK, key(1))
    assert adopted is not None and as_bytes(adopted.tensors) == as_bytes(tensors(1))
    store.close()
    rows = {r.key: r for r in index_rows(tmp_path)}
    assert (rows[key(1)].tokens, rows[key(1)].tags) == (128, "s1")


def test_reconcile_report_counts_what_it_fixed(tmp_path):
    store = open_store(tmp_path)
    for i in range(3):
        write(store, key(i), tensors(i))
    store.close()
    path_of(tmp_path, key(0)).unlink()
    _drop_row(tmp_path, key(1))
    _drop_row(tmp_path, key(2))
    with open(path_of(tmp_path, key(2)), "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"\x00" if f.read(1) != b"\x00" else b"\x01")
    store = open_store(tmp_path, reconcile="off")
    report = store.reconcile()
    assert (report.rows_dropped, report.adopted, report.quarantined) == (1, 1, 1)
    assert len(quarantined(tmp_path)) == 1
    assert store.stats().quarantined == 1
    store.close()


def test_lost_index_is_rebuilt_from_files(tmp_path):
    store = open_store(tmp_path)
    for i in range(5):
        write(store, key(i), tensors(i))
    store.close()
    for p in tmp_path.glob("index.sqlite3*"):
        p.unlink()
    store = open_store(tmp_path)
    assert store.stats().entries == 5
    assert all(store.get(SCOPE, EntryKind.BLOCK, key(i)) is not None for i in range(5))
    store.close()


def test_background_reconcile_serves_at_once_and_adopts_later(tmp_path):
    store = open_store(tmp_path)
    write(store, key(1), tensors(1))
    store.close()
    _drop_row(tmp_path, key(1))
    store = open_store(tmp_path, reconcile="background")
    assert store.wait_reconciled(10)
    assert store.contains_many(SCOPE, EntryKind.BLOCK, [key(1)]) == [True]
    store.close()


def test_foreign_files_under_the_root_are_left_alone(tmp_path):
    demo = tmp_path / "models" / "demo-llama" / "blocks" / "ab"
    demo.mkdir(parents=True)
    (demo / ("ab" * 32 + ".safetensors")).write_bytes(b"a model file, not ours")
    (tmp_path / "model-a" / "default" / "blocks" / "ab").mkdir(parents=True)
    stray = tmp_path / "model-a" / "default" / "blocks" / "ab" / "README"
    stray.write_text("x")
    store = open_store(tmp_path)
    assert store.stats().entries == 0 and store.stats().quarantined == 0
    store.close()
    assert stray.exists() and len(list(demo.iterdir())) == 1


# ---- corruption ---------------------------------------------------------------------


def _damage(path: Path, how: str, other: Path) -> None:
    blob = path.read_bytes()
    n = U64.unpack_from(blob)[0]
    if how == "flip_data":
        flip(path, len(blob) - 1)
    elif how == "flip_meta":  # "layers":"2" -> "3": still valid JSON, still a valid header
        flip(path, blob.index(b'"layers":"2"') + len('"layers":"'))
    elif how == "truncate":
        os.truncate(path, len(blob) // 2)
    elif how == "delete":
        path.unlink()
    elif how == "garbage_header":
        path.write_bytes(blob[:8] + random.Random(0).randbytes(n) + blob[8 + n :])
    elif how == "huge_header_length":
        path.write_bytes(U64.pack(2**62) + blob[8:])
    elif how == "huge_shape":  # consistent with itself, not with the file
        head = json.loads(blob[8 : 8 + n])
        head["layers.0.values"]["shape"] = [2**40, 2**40]
        head["layers.0.values"]["data_offsets"][1] = 2**82
        raw = json.dumps(head).encode()
        path.write_bytes(U64.pack(len(raw)) + raw + blob[8 + n :])
    elif how == "other_entrys_file":
        os.replace(other, path)
    else:
        raise AssertionError(how)


DAMAGES = [
    "flip_data",
    "flip_meta",
    "truncate",
    "delete",
    "garbage_header",
    "huge_header_length",
    "huge_shape",
    "other_entrys_file",
]


@pytest.mark.parametrize("how", DAMAGES)
def test_damaged_file_is_a_miss_and_quarantined_on_read(store, tmp_path, how):
    write(store, key(1), tensors(1))
    write(store, key(2), tensors(1))  # same shapes: same size file, different key
    _damage(path_of(tmp_path, key(1)), how, other=path_of(tmp_path, key(2)))
    assert store.get(SCOPE, EntryKind.BLOCK, key(1)) is None
    assert store.contains_many(SCOPE, EntryKind.BLOCK, [key(1)]) == [False]
    assert not path_of(tmp_path, key(1)).exists()
    expect = 0 if how == "delete" else 1
    assert (store.stats().quarantined, len(quarantined(tmp_path))) == (expect, expect)
    assert store.get(SCOPE, EntryKind.BLOCK, key(1)) is None  # a second read is a plain miss
    # The entry can be written again, and then reads fine.
    write(store, key(1), tensors(1))
    assert as_bytes(store.get(SCOPE, EntryKind.BLOCK, key(1)).tensors) == as_bytes(tensors(1))


@pytest.mark.parametrize("how", [d for d in DAMAGES if d not in ("delete", "other_entrys_file")])
def test_damaged_orphan_is_quarantined_at_startup(tmp_path, how):
    store = open_store(tmp_path)
    write(store, key(1), tensors(1))
    store.close()
    _drop_row(tmp_path, key(1))
    _damage(path_of(tmp_path, key(1)), how, other=tmp_path)
    store = open_store(tmp_path)
    assert store.stats().quarantined == 1 and store.stats().entries == 0
    assert store.get(SCOPE, EntryKind.BLOCK, key(1)) is None
    store.close()
