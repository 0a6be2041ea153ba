"""SSD tier, file format: bit-exact round trips, plain safetensors files, layout and modes,
and headers validated before their sizes are trusted."""

from __future__ import annotations

import json
import os
import random
import struct
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_bridge.cache.kinds import EntryKind
from engine_bridge.cache.ssd.format import FormatError, encode, parse_header, read_entry
from engine_bridge.cache.tensors import DTYPE_SIZES, HostTensor
from tests.support.ssd_helpers import (
    SCOPE,
    U64,
    as_bytes,
    flip,
    key,
    path_of,
    store_fixture,  # noqa: F401 (the `store` fixture)
    tensors,
    write,
)

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
    entry = store.get(SCOPE, EntryKind.BLOCK, key(1))
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
    assert as_bytes(store.get(SCOPE, EntryKind.BLOCK, key(7)).tensors) == as_bytes(big)
    path = path_of(tmp_path, key(7))
    data_start = path.stat().st_size - (3 << 20)
    flip(path, data_start + int(offset_mib * (1 << 20)))
    assert store.get(SCOPE, EntryKind.BLOCK, key(7)) is None
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
