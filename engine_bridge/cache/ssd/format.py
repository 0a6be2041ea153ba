"""On-disk entry format of the SSD tier: one safetensors file per entry, checked before trusted.

Layout is plain safetensors (any safetensors reader can open our files): a u64 little-endian
header length N, N bytes of JSON (space padded so the data section starts 8-byte aligned),
then the tensors back to back. Our own fields ride in `__metadata__` under `mpc.` keys:
format version, entry key, token count, tags, creation time and a checksum, so that a
file alone is enough to rebuild its index row.

The checksum covers the whole file: the header as written, with the digest itself zeroed,
then the data. Covering only the data would let a flipped digit in the caller's metadata
(a layer count, a token count) pass as valid. It is a tree (see `_Digest`): CRC-32 per
1 MiB leaf, SHA-256 over the leaves, so that reads verify at memory speed on several cores.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
import zlib
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from math import prod

from engine_bridge.cache.tensors import DTYPE_SIZES, HostTensor

FORMAT_VERSION = "1"
RESERVED_PREFIX = "mpc."
# A header is JSON for a few hundred tensors plus the caller's metadata; anything larger is
# garbage or hostile, and is refused before it is read.
MAX_HEADER_BYTES = 16 << 20
READ_CHUNK = 8 << 20
CHECKSUM = "crc32t"  # the tree of `_Digest`
LEAF_BYTES = 1 << 20
_PARALLEL_MIN = 256 << 10  # smaller leaves are hashed inline: a thread hop costs more

_K_VERSION = "mpc.format"
_K_KEY = "mpc.key"
_K_TOKENS = "mpc.tokens"
_K_TAGS = "mpc.tags"
_K_CREATED = "mpc.created"
_K_CHECKSUM = "mpc.checksum"
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")


class FormatError(ValueError):
    """A file that is not a valid entry: torn, truncated, corrupt or foreign."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # offsets into the data section
    end: int


@dataclass(frozen=True, slots=True)
class EntryHeader:
    """A parsed, structurally validated header; the checksum is verified separately."""

    key: bytes
    tokens: int
    tags: str
    created: float
    checksum: str  # "<algo>:<hex>"
    signed_head: bytes  # the header bytes as hashed: length prefix, JSON, digest zeroed
    meta: dict[str, str]  # the caller's metadata, `mpc.` keys removed
    tensors: dict[str, TensorSpec]
    data_start: int  # file offset of the data section
    file_size: int


class _Digest:
    """SHA-256 of [SHA-256(header), CRC-32(leaf 0), CRC-32(leaf 1), ...], where the
    leaves are the data section cut every LEAF_BYTES.

    Leaves are independent, so a reader checks them on a few threads while it keeps
    reading. A SHA-256 stream (~1 GB/s per core without SHA instructions) was slower than
    the SSD it checks; CRC-32 leaves keep verification off the read path's critical time. Feed it with `update` (any chunking, in order) or
    `submit` (whole leaves of a buffer that stays put); call `hexdigest` once, at the end.
    """

    def __init__(self, signed_head: bytes) -> None:
        self._parts: list[bytes | Future[bytes]] = [_sha256(signed_head)]
        self._leaf = 0
        self._room = LEAF_BYTES

    def update(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view.nbytes:
            take = min(self._room, view.nbytes)
            self._leaf = zlib.crc32(view[:take], self._leaf)
            view = view[take:]
            self._room -= take
            if self._room == 0:
                self._end_leaf()

    def submit(self, leaf: memoryview) -> None:
        assert self._room == LEAF_BYTES and 0 < leaf.nbytes <= LEAF_BYTES, leaf.nbytes
        small = leaf.nbytes < _PARALLEL_MIN
        self._parts.append(_crc32(leaf) if small else _hash_pool().submit(_crc32, leaf))

    def hexdigest(self) -> str:
        if self._room != LEAF_BYTES:
            self._end_leaf()
        parts = [p if isinstance(p, bytes) else p.result() for p in self._parts]
        return hashlib.sha256(b"".join(parts)).hexdigest()

    def _end_leaf(self) -> None:
        self._parts.append(_U32.pack(self._leaf))
        self._leaf = 0
        self._room = LEAF_BYTES


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _hash_pool() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        with _pool_lock:
            if _pool is None:
                workers = min(4, os.cpu_count() or 1)
                _pool = ThreadPoolExecutor(workers, thread_name_prefix="ssd-hash")
    return _pool


def _sha256(data: bytes | memoryview) -> bytes:
    return hashlib.sha256(data).digest()


def _crc32(data: bytes | memoryview) -> bytes:
    # CRC-32 runs at several GB/s and releases the GIL for large inputs; it guards against
    # torn writes and bit rot, not against someone who can write the cache folder anyway.
    return _U32.pack(zlib.crc32(data))


def encode(
    key: bytes,
    tensors: Mapping[str, HostTensor],
    meta: Mapping[str, str],
    *,
    tokens: int,
    tags: str,
    created: float,
) -> tuple[bytes, list[bytes | memoryview]]:
    """Header bytes (length prefix included) and the data chunks to write after it, in order."""
    assert len(key) == 32, f"entry key must be 32 bytes, got {len(key)}"
    bad = [k for k in meta if k.startswith(RESERVED_PREFIX)]
    assert not bad, f"metadata keys {bad} use the reserved prefix {RESERVED_PREFIX!r}"
    assert "__metadata__" not in tensors, "tensor name __metadata__ is reserved"
    names = sorted(tensors)
    chunks = [_flat(tensors[n].data) for n in names]
    zeroed = f"{CHECKSUM}:{'0' * 64}"
    header: dict[str, object] = {
        "__metadata__": {
            **{str(k): str(v) for k, v in meta.items()},
            _K_VERSION: FORMAT_VERSION,
            _K_KEY: key.hex(),
            _K_TOKENS: str(int(tokens)),
            _K_TAGS: tags,
            _K_CREATED: repr(float(created)),
            _K_CHECKSUM: zeroed,
        }
    }
    offset = 0
    for name in names:
        t = tensors[name]
        header[name] = {
            "dtype": t.dtype,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % 8)
    head = _U64.pack(len(raw)) + raw
    digest = _Digest(head)
    for chunk in chunks:
        digest.update(chunk)
    # Same length as the zeroes it replaces, so no offset moves.
    head = head.replace(_field(zeroed), _field(f"{CHECKSUM}:{digest.hexdigest()}"), 1)
    return head, chunks


def header_length(prefix: bytes | memoryview, file_size: int) -> int:
    """The JSON header length from a file's first 8 bytes, refused if it cannot fit the file."""
    if file_size < 8 or len(prefix) < 8:
        raise FormatError(f"file of {file_size} bytes has no header length")
    (n,) = _U64.unpack_from(prefix)
    if n < 2 or n > MAX_HEADER_BYTES or 8 + n > file_size:
        raise FormatError(f"header length {n} impossible for a {file_size} byte file")
    return n


def parse_header(head: bytes | memoryview, file_size: int) -> EntryHeader:
    """Validate everything the header claims against the file size; no allocation sized by it."""
    n = header_length(head, file_size)
    if len(head) < 8 + n:
        raise FormatError(f"need {8 + n} header bytes, got {len(head)}")
    try:
        doc = json.loads(bytes(head[8 : 8 + n]), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise FormatError(f"header is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise FormatError("header is not a JSON object")
    meta = doc.pop("__metadata__", None)
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise FormatError("__metadata__ missing or not a string map")
    if meta.get(_K_VERSION) != FORMAT_VERSION:
        raise FormatError(f"format version {meta.get(_K_VERSION)!r}, want {FORMAT_VERSION}")
    data_len = file_size - 8 - n
    specs = {name: _tensor_spec(name, spec) for name, spec in doc.items()}
    expected = 0
    for spec in sorted(specs.values(), key=lambda s: (s.begin, s.end)):
        if spec.begin != expected:
            raise FormatError(f"tensor data not contiguous at offset {spec.begin}")
        expected = spec.end
    if expected != data_len:
        raise FormatError(f"tensors cover {expected} bytes, data section is {data_len}")
    try:
        key = bytes.fromhex(meta[_K_KEY])
        tokens = int(meta[_K_TOKENS])
        created = float(meta[_K_CREATED])
        tags = meta[_K_TAGS]
        algo, _, digest = meta[_K_CHECKSUM].partition(":")
    except (KeyError, ValueError) as e:
        raise FormatError(f"bad entry metadata: {e!r}") from None
    if len(key) != 32 or tokens < 0 or algo != CHECKSUM or len(digest) != 64:
        raise FormatError("bad entry key, token count or checksum field")
    signed_head = bytes(head[: 8 + n])
    field = _field(meta[_K_CHECKSUM])
    if signed_head.count(field) != 1:
        raise FormatError("checksum field not found verbatim in the header")
    signed_head = signed_head.replace(field, _field(f"{algo}:{'0' * len(digest)}"))
    return EntryHeader(
        key=key,
        tokens=tokens,
        tags=tags,
        created=created,
        checksum=meta[_K_CHECKSUM],
        signed_head=signed_head,
        meta={k: v for k, v in meta.items() if not k.startswith(RESERVED_PREFIX)},
        tensors=specs,
        data_start=8 + n,
        file_size=file_size,
    )


def check_digest(header: EntryHeader, digest: _Digest) -> None:
    got = f"{CHECKSUM}:{digest.hexdigest()}"
    if got != header.checksum:
        raise FormatError(f"checksum mismatch: header says {header.checksum}, file is {got}")


def read_entry(fd: int, size: int, expect_key: bytes) -> tuple[EntryHeader, dict]:
    """Read a whole `size`-byte file into one buffer, validate it; tensors are views into it.

    The buffer is sized by the file (which the caller has already reserved), never by what
    the header claims. Leaves are handed to the hash threads as soon as they are read,
    so verifying overlaps reading.
    """
    view = memoryview(bytearray(size))
    filled = _fill(fd, view, 0, min(size, READ_CHUNK))
    n = header_length(view[:filled], size)
    if filled < 8 + n:
        filled = _fill(fd, view, filled, 8 + n)
    header = _parse_for(view[:filled], size, expect_key)
    digest = _Digest(header.signed_head)
    leaf = header.data_start  # start of the next leaf not yet handed over
    while True:
        while leaf < filled and (filled - leaf >= LEAF_BYTES or filled == size):
            end = min(leaf + LEAF_BYTES, filled)
            digest.submit(view[leaf:end])
            leaf = end
        if filled == size:
            break
        filled = _fill(fd, view, filled, min(size, filled + READ_CHUNK))
    check_digest(header, digest)
    return header, _views(header, view.toreadonly())


def decode(buf: bytes | memoryview, expect_key: bytes) -> tuple[EntryHeader, dict]:
    """Validate a whole entry held in memory (a shared-store value), exactly as `read_entry`
    validates a file; tensors are views into `buf`."""
    view = memoryview(buf).toreadonly()
    size = view.nbytes
    n = header_length(view[:8], size)
    header = _parse_for(view[: 8 + n], size, expect_key)
    digest = _Digest(header.signed_head)
    for leaf in range(header.data_start, size, LEAF_BYTES):
        digest.submit(view[leaf : min(leaf + LEAF_BYTES, size)])
    check_digest(header, digest)
    return header, _views(header, view)


def _views(header: EntryHeader, ro: memoryview) -> dict[str, HostTensor]:
    base = header.data_start
    return {
        name: HostTensor(s.dtype, s.shape, ro[base + s.begin : base + s.end])
        for name, s in header.tensors.items()
    }


def verify_file(fd: int, size: int, expect_key: bytes | None = None) -> EntryHeader:
    """Validate a file in bounded memory (header, then the data through a scratch buffer)."""
    head = memoryview(bytearray(8))
    _fill(fd, head, 0, min(size, 8))
    n = header_length(head, size)
    head = memoryview(bytearray(8 + n))
    _fill(fd, head, 8, 8 + n, at=8)
    head[:8] = _U64.pack(n)
    header = _parse_for(head, size, expect_key)
    digest = _Digest(header.signed_head)
    scratch = memoryview(bytearray(min(READ_CHUNK, max(size - header.data_start, 1))))
    pos = header.data_start
    while pos < size:
        k = min(len(scratch), size - pos)
        _fill(fd, scratch, 0, k, at=pos)
        digest.update(scratch[:k])
        pos += k
    check_digest(header, digest)
    return header


def _parse_for(head: memoryview, size: int, expect_key: bytes | None) -> EntryHeader:
    header = parse_header(head, size)
    if expect_key is not None and header.key != expect_key:
        raise FormatError(f"file holds entry {header.key.hex()}, expected {expect_key.hex()}")
    return header


def _fill(fd: int, view: memoryview, start: int, end: int, at: int | None = None) -> int:
    """Read bytes [start, end) of `view` from file offset `at` (default `start`).

    A file that ends early is a format error (it shrank or lied about its size).
    """
    offset = start if at is None else at
    os.lseek(fd, offset, os.SEEK_SET)
    pos = start
    while pos < end:
        # Capped per call: macOS readv refuses more than INT_MAX bytes at once.
        got = os.readv(fd, [view[pos : min(end, pos + (1 << 30))]])
        if got == 0:
            raise FormatError(f"file ended at byte {offset + pos - start}, expected more")
        pos += got
    return end


def _tensor_spec(name: str, spec: object) -> TensorSpec:
    if not isinstance(spec, dict):
        raise FormatError(f"tensor {name!r}: not an object")
    dtype, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
    if dtype not in DTYPE_SIZES:
        raise FormatError(f"tensor {name!r}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise FormatError(f"tensor {name!r}: bad shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_count(o) for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise FormatError(f"tensor {name!r}: bad data_offsets {offsets!r}")
    # Python ints do not overflow, so a shape claiming 2**80 elements just fails this check.
    if prod(shape) * DTYPE_SIZES[dtype] != offsets[1] - offsets[0]:
        raise FormatError(f"tensor {name!r}: shape {shape} {dtype} != {offsets} span")
    return TensorSpec(dtype, tuple(shape), offsets[0], offsets[1])


def _field(value: str) -> bytes:
    return f'"{_K_CHECKSUM}":"{value}"'.encode()


def _flat(data: bytes | memoryview) -> bytes | memoryview:
    """A byte view of a tensor's data, whatever the memoryview's format and rank."""
    if isinstance(data, memoryview) and (data.ndim != 1 or data.format != "B"):
        return data.cast("B")
    return data


def _is_count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in pairs:
        if k in out:
            raise FormatError(f"duplicate header key {k!r}")
        out[k] = v
    return out
