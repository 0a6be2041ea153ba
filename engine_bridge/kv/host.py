"""Payloads ⇄ named host tensors and string metadata, for the SSD tier.

Every tensor crosses as raw bits through an unsigned carrier of its width (bfloat16 has no
numpy dtype), so a round trip is bit-exact for every dtype, NaN payloads and -0.0 included.
The metadata is flat strings: a format tag, the payload kind and positions, and one
descriptor per paged layer and per snapshot.
"""

from __future__ import annotations

from collections.abc import Mapping

import mlx.core as mx
import numpy as np

from engine_bridge.cache.tensors import HostTensor
from engine_bridge.kv.payloads import (
    ArraysState,
    BlockPayload,
    CheckpointPayload,
    DenseKV,
    PagedKV,
    Payload,
    PayloadKind,
    QuantKV,
    RotatingState,
    Snapshot,
)

FORMAT = "mlx-prompt-cache/kv/1"

_CODES: dict[mx.Dtype, str] = {
    mx.float32: "F32",
    mx.float16: "F16",
    mx.bfloat16: "BF16",
    mx.float64: "F64",
    mx.uint8: "U8",
    mx.uint16: "U16",
    mx.uint32: "U32",
    mx.uint64: "U64",
    mx.int8: "I8",
    mx.int16: "I16",
    mx.int32: "I32",
    mx.int64: "I64",
    mx.bool_: "BOOL",
}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}
_CARRIERS = {
    1: (mx.uint8, np.uint8),
    2: (mx.uint16, np.uint16),
    4: (mx.uint32, np.uint32),
    8: (mx.uint64, np.uint64),
}
_QUANT_PARTS = ("q", "scales", "biases")


class PayloadFormatError(ValueError):
    """Host tensors and metadata that do not describe a payload this module wrote."""


def tensor_to_host(x: mx.array) -> HostTensor:
    """The bits of `x` in host memory (evaluates `x`)."""
    carrier = _CARRIERS[x.itemsize][0]
    bits = np.asarray(x if x.dtype == carrier else x.view(carrier))
    flat = np.ascontiguousarray(bits).reshape(-1).view(np.uint8)
    return HostTensor(_CODES[x.dtype], tuple(x.shape), memoryview(flat))


def tensor_from_host(t: HostTensor) -> mx.array:
    """An MLX array holding its own copy of `t`'s bits."""
    dtype = _DTYPES.get(t.dtype)
    if dtype is None:
        raise PayloadFormatError(f"no MLX dtype for {t.dtype!r}")
    carrier, np_carrier = _CARRIERS[dtype.size]
    x = mx.array(np.frombuffer(t.data, dtype=np_carrier).reshape(t.shape))
    return x if dtype == carrier else x.view(dtype)


# --- payload → host -------------------------------------------------------------------------


def _put_kv(prefix: str, p: PagedKV, out: dict[str, mx.array], meta: dict[str, str]) -> None:
    if isinstance(p, DenseKV):
        meta[prefix] = "dense"
        out[f"{prefix}.keys"], out[f"{prefix}.values"] = p.keys, p.values
        return
    meta[prefix] = f"quant.{p.group_size}.{p.bits}"
    for name, parts in (("keys", p.keys), ("values", p.values)):
        for part, x in zip(_QUANT_PARTS, parts, strict=True):
            out[f"{prefix}.{name}.{part}"] = x


def _put_snapshot(prefix: str, s: Snapshot, out: dict[str, mx.array], meta: dict[str, str]) -> None:
    if isinstance(s, RotatingState):
        meta[prefix] = f"rotating.{s.offset}.{s.idx}.{s.keep}.{s.max_size}"
        out[f"{prefix}.keys"], out[f"{prefix}.values"] = s.keys, s.values
        return
    present = "".join("0" if a is None else "1" for a in s.arrays)
    meta[prefix] = f"arrays.{present}"
    for i, a in enumerate(s.arrays):
        if a is not None:
            out[f"{prefix}.{i}"] = a


def payload_to_host(payload: Payload) -> tuple[dict[str, HostTensor], dict[str, str]]:
    """Named host tensors and string metadata; evaluates, so call it off the writer thread."""
    arrays: dict[str, mx.array] = {}
    meta = {"format": FORMAT}
    if isinstance(payload, BlockPayload):
        meta |= {"kind": PayloadKind.BLOCK.value, "start": str(payload.start), "tokens": str(payload.tokens)}
        kv: tuple[PagedKV, ...] = payload.kv
    else:
        meta |= {
            "kind": PayloadKind.CHECKPOINT.value,
            "position": str(payload.position),
            "block_size": str(payload.block_size),
            "snapshots": str(len(payload.snapshots)),
        }
        kv = payload.tail
        for j, s in enumerate(payload.snapshots):
            _put_snapshot(f"snap.{j}", s, arrays, meta)
    meta["kv"] = str(len(kv))
    for i, p in enumerate(kv):
        _put_kv(f"kv.{i}", p, arrays, meta)
    mx.eval(list(arrays.values()))
    return {name: tensor_to_host(x) for name, x in arrays.items()}, meta


# --- host → payload -------------------------------------------------------------------------


class _Reader:
    """Takes tensors and metadata by name, raising PayloadFormatError on anything missing."""

    def __init__(self, tensors: Mapping[str, HostTensor], meta: Mapping[str, str]) -> None:
        self.tensors, self.meta, self.taken = tensors, meta, set[str]()

    def text(self, key: str) -> str:
        if key not in self.meta:
            raise PayloadFormatError(f"metadata {key!r} missing")
        return self.meta[key]

    def ints(self, key: str, parts: str, count: int) -> list[int]:
        fields = parts.split(".")
        try:
            values = [int(f) for f in fields]
        except ValueError:
            values = []
        if len(values) != count or min(values) < 0:
            raise PayloadFormatError(f"metadata {key!r}: {parts!r} is not {count} integers")
        return values

    def array(self, name: str) -> mx.array:
        if name not in self.tensors:
            raise PayloadFormatError(f"tensor {name!r} missing")
        self.taken.add(name)
        return tensor_from_host(self.tensors[name])

    def kv(self, prefix: str, tokens: int) -> PagedKV:
        desc = self.text(prefix)
        if desc == "dense":
            p: PagedKV = DenseKV(self.array(f"{prefix}.keys"), self.array(f"{prefix}.values"))
        elif desc.startswith("quant."):
            group_size, bits = self.ints(prefix, desc.removeprefix("quant."), 2)
            k, v = (
                tuple(self.array(f"{prefix}.{name}.{part}") for part in _QUANT_PARTS)
                for name in ("keys", "values")
            )
            p = QuantKV(k, v, group_size, bits)  # type: ignore[arg-type]
        else:
            raise PayloadFormatError(f"metadata {prefix!r}: unknown layer form {desc!r}")
        if p.tokens != tokens:
            raise PayloadFormatError(f"{prefix} holds {p.tokens} tokens, expected {tokens}")
        return p

    def snapshot(self, prefix: str) -> Snapshot:
        desc = self.text(prefix)
        kind, _, rest = desc.partition(".")
        if kind == "rotating":
            offset, idx, keep, max_size = self.ints(prefix, rest, 4)
            keys, values = self.array(f"{prefix}.keys"), self.array(f"{prefix}.values")
            return RotatingState(keys, values, offset, idx, keep, max_size)
        if kind == "arrays" and set(rest) <= {"0", "1"}:
            return ArraysState(
                tuple(self.array(f"{prefix}.{i}") if f == "1" else None for i, f in enumerate(rest))
            )
        raise PayloadFormatError(f"metadata {prefix!r}: unknown snapshot form {desc!r}")


def payload_from_host(tensors: Mapping[str, HostTensor], meta: Mapping[str, str]) -> Payload:
    """The payload `payload_to_host` described; PayloadFormatError if anything disagrees."""
    try:
        return _read_payload(tensors, meta)
    except (IndexError, TypeError) as e:  # tensor shapes that describe no payload
        raise PayloadFormatError(f"tensors do not form a payload: {e}") from e


class HostCodec:
    """The tiers' `Codec` (engine_bridge.cache.tiers): payloads ⇄ host tensors."""

    def to_host(self, payload: Payload) -> tuple[dict[str, HostTensor], dict[str, str]]:
        return payload_to_host(payload)

    def from_host(self, tensors: Mapping[str, HostTensor], meta: Mapping[str, str]) -> Payload:
        return payload_from_host(tensors, meta)


def _read_payload(tensors: Mapping[str, HostTensor], meta: Mapping[str, str]) -> Payload:
    r = _Reader(tensors, meta)
    if r.text("format") != FORMAT:
        raise PayloadFormatError(f"format {meta['format']!r}, expected {FORMAT!r}")
    kind = r.text("kind")
    (n_kv,) = r.ints("kv", r.text("kv"), 1)
    payload: Payload
    if kind == PayloadKind.BLOCK:
        (start,) = r.ints("start", r.text("start"), 1)
        (tokens,) = r.ints("tokens", r.text("tokens"), 1)
        kv = tuple(r.kv(f"kv.{i}", tokens) for i in range(n_kv))
        payload = BlockPayload(start, tokens, kv)
    elif kind == PayloadKind.CHECKPOINT:
        (position,) = r.ints("position", r.text("position"), 1)
        (block_size,) = r.ints("block_size", r.text("block_size"), 1)
        (n_snap,) = r.ints("snapshots", r.text("snapshots"), 1)
        if block_size == 0:
            raise PayloadFormatError("checkpoint block_size is 0")
        tail = tuple(r.kv(f"kv.{i}", position % block_size) for i in range(n_kv))
        snaps = tuple(r.snapshot(f"snap.{j}") for j in range(n_snap))
        payload = CheckpointPayload(position, block_size, tail, snaps)
    else:
        raise PayloadFormatError(f"unknown payload kind {kind!r}")
    extra = set(tensors) - r.taken
    if extra:
        raise PayloadFormatError(f"unexpected tensors {sorted(extra)}")
    return payload
