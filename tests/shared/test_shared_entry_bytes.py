"""Shared tier, entry bytes: a value is exactly an SSD file's bytes, and `decode` checks it
in memory with the same header and checksum rules as a file read."""

from __future__ import annotations

import os
import random

import pytest

from engine_bridge.cache.ssd.format import FormatError, decode, encode, read_entry
from engine_bridge.cache.tensors import HostTensor

KEY = bytes(range(32))


def entry_bytes(tensors: dict[str, HostTensor], key: bytes = KEY) -> bytes:
    head, chunks = encode(key, tensors, {"layers": "2"}, tokens=64, tags="", created=1.0)
    return b"".join([head, *map(bytes, chunks)])


def big() -> dict[str, HostTensor]:
    # Three 1 MiB leaves and a short fourth: every leaf boundary is crossed.
    data = random.Random(3).randbytes((3 << 20) + 1000)
    return {"x": HostTensor("U8", (len(data),), data), "e": HostTensor("F32", (0,), b"")}


def test_decode_reads_back_what_a_file_read_returns(tmp_path):
    value = entry_bytes(big())
    path = tmp_path / "entry.safetensors"
    path.write_bytes(value)
    fd = os.open(path, os.O_RDONLY)
    try:
        from_file = read_entry(fd, len(value), KEY)
    finally:
        os.close(fd)
    from_bytes = decode(value, KEY)
    assert from_bytes[0] == from_file[0]
    assert {n: bytes(t.data) for n, t in from_bytes[1].items()} == {
        n: bytes(t.data) for n, t in from_file[1].items()
    }
    assert all(t.data.readonly for t in from_bytes[1].values())


@pytest.mark.parametrize("where", ["length", "header", "leaf0", "leaf2", "last"])
def test_decode_refuses_a_flipped_byte_anywhere(where):
    value = bytearray(entry_bytes(big()))
    data_start = len(value) - ((3 << 20) + 1000)
    at = {
        "length": 1,
        "header": 40,
        "leaf0": data_start + 5,
        "leaf2": data_start + (2 << 20) + 7,
        "last": len(value) - 1,
    }[where]
    value[at] ^= 0x10
    with pytest.raises(FormatError):
        decode(bytes(value), KEY)


@pytest.mark.parametrize("cut", [0, 7, 8, 100, -1])
def test_decode_refuses_a_truncated_value(cut):
    value = entry_bytes(big())
    with pytest.raises(FormatError):
        decode(value[:cut], KEY)


def test_decode_refuses_another_key():
    with pytest.raises(FormatError, match="expected"):
        decode(entry_bytes(big()), bytes(32))
