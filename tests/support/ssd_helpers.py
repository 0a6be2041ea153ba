"""Helpers and the `store` fixture shared by the tests/ssd/test_ssd_*.py files."""

from __future__ import annotations

import hashlib
import random
import struct
from pathlib import Path

import pytest

from engine_bridge.cache.kinds import EntryKind
from engine_bridge.cache.ssd import files as ssd_files
from engine_bridge.cache.ssd.index import Index, Scope
from engine_bridge.cache.ssd.store import SSDConfig, SSDStore
from engine_bridge.cache.tensors import HostTensor

REPO = Path(__file__).resolve().parents[2]
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
    assert store.put(scope, EntryKind.BLOCK, k, t, {"layers": "2"}, **kw) == "queued"
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


def flip(path: Path, offset: int) -> None:
    """Flip the low bit of one byte in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


@pytest.fixture(name="store")
def store_fixture(tmp_path):
    """An open store on an empty tmp_path; import `store_fixture` to use it as `store`."""
    s = open_store(tmp_path)
    yield s
    s.close()
