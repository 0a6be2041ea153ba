"""SSD tier: format, index, writer, crash safety, faults, capacity, offline helpers.

`PYTHONPATH=. .venv/bin/python tests/test_ssd.py bench [N]` prints index startup time at N entries (default 100k)
and reload bandwidth; the tests themselves never assert wall time.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import random
import signal
import sqlite3
import struct
import subprocess
import sys
import threading
import time
from array import array
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_bridge.cache import ssd_files
from engine_bridge.cache.index import Index, Scope
from engine_bridge.cache.ssd import (
    SSDConfig,
    SSDStore,
    offline_clear,
    offline_ls,
    offline_stats,
)
from engine_bridge.cache.ssd_format import FormatError, encode, parse_header, read_entry
from engine_bridge.cache.tensors import DTYPE_SIZES, HostTensor

REPO = Path(__file__).resolve().parent.parent
SCOPE = Scope("model-a")
U64 = struct.Struct("<Q")


def key(i: int | str) -> bytes:
    return hashlib.sha256(f"block-{i}".encode()).digest()


def tensors(seed: int, nbytes: int = 4096) -> dict[str, HostTensor]:
    """Deterministic layer tensors: the same seed always gives the same bytes."""
    rng = random.Random(seed)
    n = nbytes // 16
    return {
        "layers.0.keys": HostTensor("BF16", (2, n), rng.randbytes(4 * n)),
        "layers.0.values": HostTensor("F32", (n,), rng.randbytes(4 * n)),
        "layers.1.state": HostTensor("U32", (2, n // 2, 2), rng.randbytes(8 * n)),
    }


def open_store(root: Path, **kw) -> SSDStore:
    kw.setdefault("reconcile", "sync")
    return SSDStore(SSDConfig(root=root, **kw))


def write(store: SSDStore, k: bytes, t: dict[str, HostTensor], scope: Scope = SCOPE, **kw) -> None:
    assert store.put(scope, "blocks", k, t, {"layers": "2"}, **kw) == "queued"
    assert store.flush(10.0)


def path_of(root: Path, k: bytes, scope: Scope = SCOPE, kind: str = "blocks") -> Path:
    return ssd_files.entry_path(root, (scope.model, scope.tenant, kind, k))


def as_bytes(t: dict[str, HostTensor]) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    return {name: (x.dtype, x.shape, bytes(x.data)) for name, x in t.items()}


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob(f"*{ssd_files.TEMP_SUFFIX}") if p.name.startswith(".")]


def index_rows(root: Path) -> list:
    index = Index.open_readonly(root)
    try:
        return index.rows()
    finally:
        index.close()


def quarantined(root: Path) -> list[Path]:
    q = root / ssd_files.QUARANTINE
    return sorted(q.iterdir()) if q.exists() else []


@pytest.fixture
def store(tmp_path):
    s = open_store(tmp_path)
    yield s
    s.close()


# ---- format and round trip ----------------------------------------------------------


def test_round_trip_is_bit_exact_for_f32_bf16_u32(store, tmp_path):
    f32 = struct.pack("<6f", 1.5, -0.0, float("inf"), float("-inf"), 3.4e38, 1e-45)
    f32 += struct.pack("<I", 0x7FC00123)  # a NaN with a payload must survive as-is
    u32 = array("I", [0, 1, 2**31, 2**32 - 1, 7, 9])
    t = {
        "f32": HostTensor("F32", (7,), f32),
        "bf16": HostTensor("BF16", (2, 2), bytes([0x80, 0x3F, 0xFF, 0x7F, 0x00, 0x80, 0x01, 0xFF])),
        # A typed, 2-D memoryview, as a numpy or MLX buffer export would hand over.
        "u32": HostTensor("U32", (2, 3), memoryview(u32).cast("B").cast("I", (2, 3))),
        "empty": HostTensor("F32", (0, 4), b""),
    }
    write(store, key(1), t, tokens=64, tags="session-1")
    entry = store.get(SCOPE, "blocks", key(1))
    assert entry is not None
    assert as_bytes(entry.tensors) == as_bytes(t)
    assert entry.meta == {"layers": "2"}
    # One buffer per entry, tensors are read-only views into it: no per-tensor copies.
    views = [x.data for x in entry.tensors.values()]
    assert all(isinstance(v, memoryview) and v.readonly for v in views)
    assert len({id(v.obj) for v in views}) == 1


@pytest.mark.parametrize("offset_mib", [0.0, 1.5, 2.99])
def test_multi_leaf_entry_is_verified_in_every_leaf(store, tmp_path, offset_mib):
    big = {"x": HostTensor("U8", (3 << 20,), random.Random(7).randbytes(3 << 20))}
    write(store, key(7), big)
    assert as_bytes(store.get(SCOPE, "blocks", key(7)).tensors) == as_bytes(big)
    path = path_of(tmp_path, key(7))
    data_start = path.stat().st_size - (3 << 20)
    _flip(path, data_start + int(offset_mib * (1 << 20)))
    assert store.get(SCOPE, "blocks", key(7)) is None
    assert store.stats().quarantined == 1


def test_files_are_plain_safetensors_any_reader_opens(store, tmp_path):
    from safetensors.numpy import load_file

    t = {k: v for k, v in tensors(3).items() if v.dtype != "BF16"}  # numpy has no bfloat16
    write(store, key(3), t)
    loaded = load_file(path_of(tmp_path, key(3)))
    assert {name: (arr.shape, arr.tobytes()) for name, arr in loaded.items()} == {
        name: (x.shape, bytes(x.data)) for name, x in t.items()
    }


def test_layout_and_permissions(store, tmp_path):
    write(store, key(4), tensors(4))
    path = path_of(tmp_path, key(4))
    h = key(4).hex()
    assert path.relative_to(tmp_path).parts == (
        "model-a",
        "default",
        "blocks",
        h[:2],
        f"{h}.safetensors",
    )
    assert path.stat().st_mode & 0o777 == 0o600
    for folder in list(path.relative_to(tmp_path).parents)[:-1]:
        assert (tmp_path / folder).stat().st_mode & 0o777 == 0o700, folder
    assert (tmp_path / "index.sqlite3").stat().st_mode & 0o777 == 0o600


@settings(max_examples=40, deadline=None)
@given(
    st.dictionaries(
        st.text(min_size=1, max_size=12).filter(lambda s: s != "__metadata__"),
        st.tuples(
            st.sampled_from(sorted(DTYPE_SIZES)),
            st.lists(st.integers(0, 5), max_size=3),
        ),
        max_size=5,
    ),
    st.dictionaries(st.text(max_size=8).filter(lambda s: not s.startswith("mpc.")), st.text()),
)
def test_encode_then_read_is_identity(tmp_path_factory, specs, meta):
    rng = random.Random(0)
    t = {}
    for name, (dtype, shape) in specs.items():
        n = DTYPE_SIZES[dtype]
        for d in shape:
            n *= d
        t[name] = HostTensor(dtype, tuple(shape), rng.randbytes(n))
    head, chunks = encode(key(0), t, meta, tokens=5, tags="x", created=1.0)
    path = tmp_path_factory.mktemp("enc") / "e"
    path.write_bytes(head + b"".join(bytes(c) for c in chunks))
    fd = os.open(path, os.O_RDONLY)
    try:
        header, got = read_entry(fd, path.stat().st_size, key(0))
    finally:
        os.close(fd)
    assert as_bytes(got) == as_bytes(t)
    assert header.meta == meta
    assert (header.tokens, header.tags, header.created) == (5, "x", 1.0)
    assert header.data_start % 8 == 0


def _header_file(header: dict, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return U64.pack(len(raw)) + raw + data


def _valid_meta() -> dict[str, str]:
    return {
        "mpc.format": "1",
        "mpc.key": key(0).hex(),
        "mpc.tokens": "1",
        "mpc.tags": "",
        "mpc.created": "1.0",
        "mpc.checksum": "sha256t:" + "0" * 64,
    }


@pytest.mark.parametrize(
    "tensor, data",
    [
        ({"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 2**82]}, b""),
        ({"dtype": "F32", "shape": [1], "data_offsets": [0, 2**62]}, b"\0" * 4),
        ({"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}, b"\0" * 12),  # gap
        ({"dtype": "F33", "shape": [1], "data_offsets": [0, 4]}, b"\0" * 4),
        ({"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}, b"\0" * 4),
        ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}, b"\0" * 4),
        ({"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}, b"\0" * 4),
        ({"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, b"\0" * 4),  # past the end
        ("not an object", b""),
    ],
)
def test_header_claims_are_checked_against_the_file(tensor, data):
    blob = _header_file({"__metadata__": _valid_meta(), "t": tensor}, data)
    with pytest.raises(FormatError):
        parse_header(blob, len(blob))


@pytest.mark.parametrize(
    "blob",
    [
        b"",
        b"\x01\x00",
        U64.pack(2**63) + b"{}",  # a header length no file can hold
        U64.pack(4) + b"[1]\n",
        U64.pack(3) + b"\xff\xfe{",
        _header_file({"__metadata__": {**_valid_meta(), "mpc.format": "2"}}),
        _header_file({"__metadata__": {**_valid_meta(), "mpc.key": "ab"}}),
        _header_file({"__metadata__": {**_valid_meta(), "x": 1}}),
        U64.pack(1000) + b"[" * 1000,
    ],
)
def test_malformed_headers_are_refused(blob):
    with pytest.raises(FormatError):
        parse_header(blob, len(blob))


def test_duplicate_header_keys_are_refused():
    raw = b'{"__metadata__":{},"t":{},"t":{}}'
    with pytest.raises(FormatError):
        parse_header(U64.pack(len(raw)) + raw, 8 + len(raw))


# ---- lookup, dedupe, queue ----------------------------------------------------------


def test_contains_many_and_present_prefix_follow_the_disk(store):
    chain = [key(i) for i in range(6)]
    for i in (0, 1, 2, 4):
        store.put(SCOPE, "blocks", chain[i], tensors(i))
    assert store.flush()
    assert store.contains_many(SCOPE, "blocks", chain) == [True, True, True, False, True, False]
    assert store.present_prefix(SCOPE, "blocks", chain) == 3
    assert store.present_prefix(SCOPE, "checkpoints", chain) == 0
    assert store.present_prefix(Scope("model-a", "tenant-2"), "blocks", chain) == 0
    assert store.get(SCOPE, "blocks", chain[3]) is None
    assert (store.stats().hits, store.stats().misses) == (0, 1)


def test_same_entry_is_written_once(store, tmp_path, monkeypatch):
    t = tensors(5)
    gate = threading.Event()
    real = ssd_files.write_atomic
    monkeypatch.setattr(ssd_files, "write_atomic", lambda p, c: (gate.wait(10), real(p, c)))
    assert store.put(SCOPE, "blocks", key(5), t) == "queued"
    assert store.put(SCOPE, "blocks", key(5), t) == "duplicate"  # already queued
    gate.set()
    assert store.flush()
    mtime = path_of(tmp_path, key(5)).stat().st_mtime_ns
    assert store.put(SCOPE, "blocks", key(5), t, reason="spill") == "queued"
    assert store.flush()
    stats = store.stats()
    assert (stats.writes, stats.dedup_skips, stats.entries) == (1, 2, 1)
    assert path_of(tmp_path, key(5)).stat().st_mtime_ns == mtime
    # The same hash under another tenant or kind is a different entry.
    write(store, key(5), t, scope=Scope("model-a", "tenant-2"))
    assert store.stats().writes == 2


def test_full_queue_drops_and_counts_without_blocking(tmp_path, monkeypatch):
    gate = threading.Event()
    real = ssd_files.write_atomic
    monkeypatch.setattr(ssd_files, "write_atomic", lambda p, c: (gate.wait(10), real(p, c)))
    store = open_store(tmp_path, queue_size=2)
    outcomes = []
    # In a thread, so that a put that blocked would fail the join below, not hang the suite.
    worker = threading.Thread(
        target=lambda: outcomes.extend(
            store.put(SCOPE, "blocks", key(i), tensors(i)) for i in range(6)
        )
    )
    worker.start()
    worker.join(5)
    assert not worker.is_alive()
    # The writer holds one job (blocked on the gate), the queue two more; the rest drop.
    assert outcomes.count("queued") in (2, 3)
    assert outcomes.count("dropped") == 6 - outcomes.count("queued")
    assert store.stats().queue_drops == outcomes.count("dropped")
    gate.set()
    assert store.flush()
    assert store.stats().writes == outcomes.count("queued")
    store.close()


def test_queue_byte_bound_drops_large_backlog(tmp_path, monkeypatch):
    gate = threading.Event()
    real = ssd_files.write_atomic
    monkeypatch.setattr(ssd_files, "write_atomic", lambda p, c: (gate.wait(10), real(p, c)))
    store = open_store(tmp_path, queue_max_bytes=10_000)
    got = [store.put(SCOPE, "blocks", key(i), tensors(i, 4096)) for i in range(4)]
    assert got == ["queued", "queued", "dropped", "dropped"]
    gate.set()
    store.close()


def test_spills_and_write_throughs_are_counted_apart(store):
    write(store, key(1), tensors(1), reason="spill")
    write(store, key(2), tensors(2), reason="write_through")
    write(store, key(3), tensors(3), reason="spill")
    s = store.stats()
    assert (s.spills, s.write_throughs, s.writes) == (2, 1, 3)
    assert (
        s.bytes
        == s.bytes_written
        == sum(path_of(store.root, key(i)).stat().st_size for i in (1, 2, 3))
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
    assert store.contains_many(SCOPE, "blocks", [key(i) for i in range(4)]) == [
        False, True, True, True,
    ]  # fmt: skip
    assert not dead_temp.exists() and live_temp.exists()
    adopted = store.get(SCOPE, "blocks", key(1))
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
    assert all(store.get(SCOPE, "blocks", key(i)) is not None for i in range(5))
    store.close()


def test_background_reconcile_serves_at_once_and_adopts_later(tmp_path):
    store = open_store(tmp_path)
    write(store, key(1), tensors(1))
    store.close()
    _drop_row(tmp_path, key(1))
    store = open_store(tmp_path, reconcile="background")
    assert store.wait_reconciled(10)
    assert store.contains_many(SCOPE, "blocks", [key(1)]) == [True]
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


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def _damage(path: Path, how: str, other: Path) -> None:
    blob = path.read_bytes()
    n = U64.unpack_from(blob)[0]
    if how == "flip_data":
        _flip(path, len(blob) - 1)
    elif how == "flip_meta":  # "layers":"2" -> "3": still valid JSON, still a valid header
        _flip(path, blob.index(b'"layers":"2"') + len('"layers":"'))
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
    assert store.get(SCOPE, "blocks", key(1)) is None
    assert store.contains_many(SCOPE, "blocks", [key(1)]) == [False]
    assert not path_of(tmp_path, key(1)).exists()
    expect = 0 if how == "delete" else 1
    assert (store.stats().quarantined, len(quarantined(tmp_path))) == (expect, expect)
    assert store.get(SCOPE, "blocks", key(1)) is None  # a second read is a plain miss
    # The entry can be written again, and then reads fine.
    write(store, key(1), tensors(1))
    assert as_bytes(store.get(SCOPE, "blocks", key(1)).tensors) == as_bytes(tensors(1))


@pytest.mark.parametrize("how", [d for d in DAMAGES if d not in ("delete", "other_entrys_file")])
def test_damaged_orphan_is_quarantined_at_startup(tmp_path, how):
    store = open_store(tmp_path)
    write(store, key(1), tensors(1))
    store.close()
    _drop_row(tmp_path, key(1))
    _damage(path_of(tmp_path, key(1)), how, other=tmp_path)
    store = open_store(tmp_path)
    assert store.stats().quarantined == 1 and store.stats().entries == 0
    assert store.get(SCOPE, "blocks", key(1)) is None
    store.close()


def test_failed_read_hands_the_reservation_back(store, tmp_path):
    write(store, key(1), tensors(1))
    _flip(path_of(tmp_path, key(1)), 100)
    ledger = []
    got = store.get(
        SCOPE,
        "blocks",
        key(1),
        reserve=lambda n: ledger.append(n) or True,
        release=lambda n: ledger.append(-n),
    )
    assert got is None
    assert len(ledger) == 2 and sum(ledger) == 0


# ---- promotion reservation ----------------------------------------------------------


class Budget:
    def __init__(self, limit: int) -> None:
        self.limit, self.used, self.peak = limit, 0, 0
        self._lock = threading.Lock()

    def reserve(self, n: int) -> bool:
        with self._lock:
            if self.used + n > self.limit:
                return False
            self.used += n
            self.peak = max(self.peak, self.used)
            return True


def test_concurrent_promotions_never_exceed_the_budget(store):
    for i in range(8):
        store.put(SCOPE, "blocks", key(i), tensors(i, 64 * 1024))
    assert store.flush()
    sizes = [path_of(store.root, key(i)).stat().st_size for i in range(8)]
    budget = Budget(3 * max(sizes) + min(sizes) // 2)
    barrier = threading.Barrier(8)
    results = [None] * 8

    def promote(i: int) -> None:
        barrier.wait()
        results[i] = store.get(SCOPE, "blocks", key(i), reserve=budget.reserve)

    threads = [threading.Thread(target=promote, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    loaded = [i for i, r in enumerate(results) if r is not None]
    assert len(loaded) == 3
    assert budget.peak <= budget.limit
    assert budget.used == sum(sizes[i] for i in loaded)
    for i in loaded:
        assert as_bytes(results[i].tensors) == as_bytes(tensors(i, 64 * 1024))
    stats = store.stats()
    assert (stats.hits, stats.promotion_failures, stats.misses) == (3, 5, 0)


def test_refused_reservation_reads_nothing(store, tmp_path, monkeypatch):
    write(store, key(1), tensors(1))
    opened = []
    real_open = os.open

    def spy(path, *args, **kw):
        opened.append(path)
        return real_open(path, *args, **kw)

    monkeypatch.setattr(os, "open", spy)
    assert store.get(SCOPE, "blocks", key(1), reserve=lambda n: False) is None
    assert opened == [] and store.stats().promotion_failures == 1


# ---- capacity and retention ---------------------------------------------------------


def test_capacity_evicts_least_recently_used(tmp_path):
    probe = open_store(tmp_path / "probe")
    write(probe, key(0), tensors(0))
    size = probe.stats().bytes
    probe.close()
    store = open_store(tmp_path / "c", max_bytes=3 * size + size // 2)
    for name in "abc":
        write(store, key(name), tensors(1))
    assert store.get(SCOPE, "blocks", key("a")) is not None  # a is now fresher than b
    write(store, key("d"), tensors(1))
    assert store.contains_many(SCOPE, "blocks", [key(n) for n in "abcd"]) == [
        True,
        False,
        True,
        True,
    ]
    stats = store.stats()
    assert (stats.evictions, stats.entries) == (1, 3)
    assert stats.bytes <= 3 * size + size // 2
    assert not path_of(store.root, key("b")).exists()
    store.close()


def _age(root: Path, k: bytes, seconds: float) -> None:
    with sqlite3.connect(root / "index.sqlite3") as conn:
        conn.execute("UPDATE entries SET last_access = last_access - ? WHERE key = ?", (seconds, k))


def test_ttl_expires_unused_entries_at_startup(tmp_path):
    store = open_store(tmp_path)
    write(store, key(1), tensors(1))
    write(store, key(2), tensors(2))
    store.close()
    _age(tmp_path, key(1), 7200)
    store = open_store(tmp_path, ttl_s=3600, reconcile="off")
    report = store.reconcile()
    assert report.expired == 1
    assert store.contains_many(SCOPE, "blocks", [key(1), key(2)]) == [False, True]
    assert not path_of(tmp_path, key(1)).exists()
    store.close()


def test_ttl_is_enforced_periodically(tmp_path):
    store = open_store(tmp_path, ttl_s=3600, maintenance_interval_s=0.05)
    write(store, key(1), tensors(1))
    _age(tmp_path, key(1), 7200)
    deadline = time.monotonic() + 10
    while store.contains_many(SCOPE, "blocks", [key(1)])[0] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert store.stats().expired == 1 and not path_of(tmp_path, key(1)).exists()
    store.close()


# ---- faults: disk full, read-only -----------------------------------------------------


def test_disk_full_disables_writes_with_one_warning(store, tmp_path, monkeypatch, caplog):
    write(store, key(0), tensors(0))
    real_write = os.write

    def disk_full(fd, data):
        if threading.current_thread().name == "ssd-writer":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", disk_full)
    with caplog.at_level(logging.WARNING, logger="engine_bridge.cache.ssd"):
        assert store.put(SCOPE, "blocks", key(1), tensors(1)) == "queued"
        assert store.put(SCOPE, "blocks", key(2), tensors(2)) == "queued"
        assert store.flush()
        assert store.put(SCOPE, "blocks", key(3), tensors(3)) == "disabled"
    stats = store.stats()
    assert stats.disabled and "No space left" in stats.disabled_reason
    assert (stats.writes, stats.disabled_drops) == (1, 2)
    assert [r.levelname for r in caplog.records if "disabled" in r.message] == ["WARNING"]
    assert temp_files(tmp_path) == []
    assert store.get(SCOPE, "blocks", key(0)) is not None  # reads still served


def test_read_only_folder_disables_writes_reads_still_work(store, tmp_path, monkeypatch, caplog):
    write(store, key(0), tensors(0))
    real_open, real_mkdir = os.open, os.mkdir
    root = str(tmp_path)

    # As root, chmod 0500 does not stop writes, so fail the calls as a read-only mount would.
    def ro_open(path, flags, *a, **k):
        if str(path).startswith(root) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *a, **k)

    def ro_mkdir(path, *a, **k):
        if str(path).startswith(root):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_mkdir(path, *a, **k)

    monkeypatch.setattr(os, "open", ro_open)
    monkeypatch.setattr(os, "mkdir", ro_mkdir)
    with caplog.at_level(logging.WARNING, logger="engine_bridge.cache.ssd"):
        assert store.put(SCOPE, "blocks", key(1), tensors(1)) == "queued"
        assert store.flush()
    stats = store.stats()
    assert stats.disabled and "Read-only file system" in stats.disabled_reason
    assert len([r for r in caplog.records if "disabled" in r.message]) == 1
    assert store.get(SCOPE, "blocks", key(0)) is not None
    assert store.put(SCOPE, "blocks", key(2), tensors(2)) == "disabled"


def test_unusable_root_starts_disabled_and_never_raises(tmp_path, caplog):
    (tmp_path / "a-file").write_text("not a folder")
    with caplog.at_level(logging.WARNING, logger="engine_bridge.cache.ssd"):
        store = open_store(tmp_path / "a-file" / "cache")
    assert store.stats().disabled
    assert store.put(SCOPE, "blocks", key(1), tensors(1)) == "disabled"
    assert store.get(SCOPE, "blocks", key(1)) is None
    assert store.contains_many(SCOPE, "blocks", [key(1)]) == [False]
    assert store.reconcile().adopted == 0
    store.close()
    assert len([r for r in caplog.records if "disabled" in r.message]) == 1


# ---- shutdown -----------------------------------------------------------------------


def test_close_drains_the_queue(tmp_path):
    store = open_store(tmp_path, queue_size=64)
    for i in range(20):
        assert store.put(SCOPE, "blocks", key(i), tensors(i)) == "queued"
    store.close(timeout_s=30)
    store = open_store(tmp_path)
    assert store.stats().entries == 20
    store.close()


def test_close_is_bounded_when_the_disk_stalls(tmp_path, monkeypatch):
    gate = threading.Event()
    real = ssd_files.write_atomic
    monkeypatch.setattr(ssd_files, "write_atomic", lambda p, c: (gate.wait(10), real(p, c)))
    store = open_store(tmp_path)
    for i in range(5):
        store.put(SCOPE, "blocks", key(i), tensors(i))
    start = time.monotonic()
    store.close(timeout_s=0.2)
    assert time.monotonic() - start < 5  # generous: the point is that it returns at all
    gate.set()
    store._writer.join(10)
    stats = store.stats()
    assert (stats.writes, stats.queue_drops, stats.queued) == (1, 4, 0)
    assert store.put(SCOPE, "blocks", key(9), tensors(9)) == "disabled"


# ---- offline helpers ----------------------------------------------------------------


def _populate(root: Path) -> None:
    store = open_store(root)
    write(store, key(1), tensors(1), tokens=64)
    write(store, key(2), tensors(2), tokens=128)
    write(store, key(3), tensors(3), scope=Scope("model-a", "t2"), tokens=64)
    assert store.put(Scope("model-b"), "checkpoints", key(4), tensors(4), tokens=7) == "queued"
    store.close()


def test_offline_ls_and_stats(tmp_path):
    _populate(tmp_path)
    (tmp_path / "quarantine").mkdir()
    (tmp_path / "quarantine" / "bad").write_bytes(b"12345")
    rows = offline_ls(tmp_path)
    assert [
        (r["model"], r["tenant"], r["entries"], r["blocks"], r["checkpoints"], r["tokens"])
        for r in rows
    ] == [
        ("model-a", "default", 2, 2, 0, 192),
        ("model-a", "t2", 1, 1, 0, 64),
        ("model-b", "default", 1, 0, 1, 7),
    ]
    stats = offline_stats(tmp_path)
    assert (stats["entries"], stats["models"], stats["tenants"]) == (4, 2, 3)
    assert stats["bytes"] == sum(p.stat().st_size for p in tmp_path.rglob("*.safetensors"))
    assert (stats["blocks"], stats["checkpoints"], stats["quarantined_files"]) == (3, 1, 1)
    assert stats["quarantined_bytes"] == 5
    assert offline_ls(tmp_path / "nothing-here") == []
    assert offline_stats(tmp_path / "nothing-here")["entries"] == 0


def test_offline_clear_keeps_other_files(tmp_path):
    _populate(tmp_path)
    demo = tmp_path / "models" / "demo-llama"
    demo.mkdir(parents=True)
    (demo / "config.json").write_text("{}")
    assert offline_clear(tmp_path, model="model-b") == 1
    assert [r["model"] for r in offline_ls(tmp_path)] == ["model-a", "model-a"]
    assert not (tmp_path / "model-b").exists()
    (tmp_path / "quarantine").mkdir()
    (tmp_path / "quarantine" / "bad").write_bytes(b"x")
    assert offline_clear(tmp_path) == 3
    assert offline_ls(tmp_path) == [] and list(tmp_path.rglob("*.safetensors")) == []
    assert (demo / "config.json").read_text() == "{}"
    assert quarantined(tmp_path) == []
    assert offline_clear(tmp_path / "nothing-here") == 0


def test_offline_clear_beside_a_running_store(tmp_path):
    store = open_store(tmp_path)
    write(store, key(1), tensors(1))
    write(store, key(2), tensors(2))
    assert offline_clear(tmp_path) == 2
    assert store.get(SCOPE, "blocks", key(1)) is None  # a miss, not an error
    assert store.stats().entries == 0
    write(store, key(3), tensors(3))  # and the store keeps working
    assert store.get(SCOPE, "blocks", key(3)) is not None
    assert offline_stats(tmp_path)["entries"] == 1
    store.close()


# ---- crash safety -------------------------------------------------------------------

CHILD = """
import sys
from pathlib import Path
sys.path.insert(0, {repo!r})
from engine_bridge.cache.index import Scope
from engine_bridge.cache.ssd import SSDConfig, SSDStore
{helpers}
SCOPE = Scope("model-a")
store = SSDStore(SSDConfig(root=Path(sys.argv[1])))
start = int(sys.argv[2])
for i in range(start, start + 100_000):
    n = i if i % 3 else i - 7  # every third put repeats an older entry
    store.put(SCOPE, "blocks", key(n), crash_payload(n), {{"i": str(n)}}, tokens=n)
    if i == start + 2:
        store.flush()
        print("ready", flush=True)
    if i % 2:
        store.flush()
"""


def crash_payload(n: int) -> dict[str, HostTensor]:
    """Sizes from 1 KB to 256 KB, so that some kills land inside a write."""
    return tensors(n, 1024 << (n % 9))


def test_kill_9_never_leaves_a_torn_or_unindexed_entry(tmp_path):
    import inspect

    helpers = "".join(inspect.getsource(f) for f in (key, tensors, crash_payload))
    child = CHILD.format(
        repo=str(REPO),
        helpers=f"import hashlib, random\nfrom engine_bridge.cache.tensors import HostTensor\n{helpers}",
    )
    root = tmp_path / "root"
    rng = random.Random(20240601)
    fixed = {"rows_dropped": 0, "adopted": 0, "temps_removed": 0}
    for round_ in range(10):
        with open(tmp_path / "child.err", "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-c", child, str(root), str(1000 * round_ + 10)],
                stdout=subprocess.PIPE,
                stderr=err,
            )
            if round_ % 3:  # else kill during import, startup or its background reconcile
                assert proc.stdout.readline() == b"ready\n", (tmp_path / "child.err").read_text()
            time.sleep(rng.uniform(0.0, 0.25))
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            proc.stdout.close()

        store = open_store(root)
        for name in fixed:
            fixed[name] += getattr(store.last_reconcile, name)
        rows = index_rows(root)
        on_disk = {f.rid for f in ssd_files.walk_entries(root)}
        assert {r.rid for r in rows} == on_disk  # index and files agree exactly
        assert temp_files(root) == [] and quarantined(root) == []
        for row in rows:
            entry = store.get(SCOPE, "blocks", row.key)
            assert entry is not None, row.key.hex()
            n = int(entry.meta["i"])
            assert row.key == key(n) and row.tokens == n
            assert as_bytes(entry.tensors) == as_bytes(crash_payload(n))
        assert store.stats().quarantined == 0
        store.close()
    assert rows
    print(f"{len(rows)} entries after 10 kills; reconcile fixed {fixed}")


# ---- startup benchmark ----------------------------------------------------------------


def build_cache(root: Path, n: int, nbytes: int = 256) -> None:
    """n valid entries written straight to disk (no fsync) plus their index rows: fast."""
    from engine_bridge.cache.index import EntryRow

    ssd_files.makedirs_private(root)
    index = Index.open(root)
    rows, now = [], time.time()
    payload = {"x": HostTensor("U8", (nbytes,), bytes(nbytes))}
    for i in range(n):
        k = key(i)
        head, chunks = encode(k, payload, {}, tokens=64, tags="", created=now)
        path = path_of(root, k)
        if not path.parent.is_dir():
            ssd_files.makedirs_private(path.parent)
        with open(path, "wb") as f:
            f.write(head)
            f.writelines(chunks)
        rows.append(EntryRow(SCOPE, "blocks", k, len(head) + nbytes, 64, now, now - i, ""))
        if len(rows) == 10_000:
            index.add(rows)
            rows = []
    index.add(rows)
    index.close()


def bench_startup(root: Path, n: int) -> dict[str, float]:
    if not (root / "index.sqlite3").exists():
        t = time.perf_counter()
        build_cache(root, n)
        print(f"built {n} entries in {time.perf_counter() - t:.1f}s", file=sys.stderr)
    t = time.perf_counter()
    store = open_store(root, reconcile="background")
    first = store.contains_many(SCOPE, "blocks", [key(i) for i in range(64)])
    ready = time.perf_counter() - t
    store.wait_reconciled(120)
    background = time.perf_counter() - t
    store.close()
    store = open_store(root, reconcile="off")
    report = store.reconcile()
    store.close()
    assert all(first) and report.rows_dropped == report.adopted == 0
    return {
        "entries": n,
        "ready_s": ready,
        "background_reconcile_s": background,
        "sync_reconcile_s": report.seconds,
    }


def test_startup_benchmark_helper_runs(tmp_path):
    result = bench_startup(tmp_path, 300)
    assert result["entries"] == 300
    print(result)


def bench_reload(root: Path, entries: int = 16, mb: int = 64) -> dict:
    """Write entries through the store, drop them from the page cache, read them back."""
    store = open_store(root, queue_size=entries + 1)
    for i in range(entries):
        store.put(
            SCOPE, "blocks", key(i), {"x": HostTensor("U8", (mb << 20,), os.urandom(mb << 20))}
        )
        assert store.flush(120)
    out = {}
    for label in ("cold", "warm"):
        if label == "cold":
            for p in root.rglob("*.safetensors"):
                fd = os.open(p, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
        t = time.perf_counter()
        for i in range(entries):
            assert store.get(SCOPE, "blocks", key(i)) is not None
        out[f"{label}_MBps"] = entries * mb / (time.perf_counter() - t)
    store.close()
    return out


if __name__ == "__main__":
    import tempfile

    if sys.argv[1:2] == ["bench"]:
        n = int(sys.argv[2]) if len(sys.argv) > 2 else 100_000
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as d:
            print(bench_startup(Path(d) / "startup", n))
            print(bench_reload(Path(d) / "reload"))
