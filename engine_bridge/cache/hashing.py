"""Chained block hashes: SHA-256 over canonical bytes, equal for equal prefixes in any process.

A chain starts at a root derived from a fixed seed and the request's extra keys (model
fingerprint, tenant salt, image digests); block i hashes block i-1's hash and its own token
ids. So the extra keys reach the chain through the first block only, and two chains that
differ in any extra key share no block.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from functools import lru_cache
from hashlib import sha256
from struct import Struct

BLOCK_SIZE = 64
HASH_BYTES = 32

BlockHash = bytes
ExtraKeys = tuple[tuple[str, str | bytes], ...]

# Any change to the byte layout below must change this seed: caches persisted under the old
# layout then miss instead of matching blocks whose bytes meant something else.
ROOT_SEED: BlockHash = sha256(b"mlx-prompt-cache/block-hash/v1").digest()

_U32 = Struct("<I")
_NO_EXTRA = _U32.pack(0)
_CHECKPOINT_TAG = b"checkpoint"
assert array("I").itemsize == 4, f"array('I') is {array('I').itemsize} bytes on this platform"


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32; raises OverflowError for ids outside [0, 2**32)."""
    packed = array("I", tokens)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def encode_extra_keys(extra_keys: ExtraKeys) -> bytes:
    """Canonical bytes for tagged extra keys, every field length-prefixed.

    Pairs are sorted by tag (stably): the order callers list different tags in does not
    matter, while repeated tags (several images) keep their order, which does.
    """
    parts = [_U32.pack(len(extra_keys))]
    for tag, value in sorted(extra_keys, key=lambda pair: pair[0]):
        assert isinstance(tag, str), f"extra key tag {tag!r} is not a str"
        if isinstance(value, str):
            kind, raw = b"s", value.encode()
        else:
            assert isinstance(value, bytes), f"extra key {tag!r} has a {type(value).__name__} value"
            kind, raw = b"b", value
        name = tag.encode()
        parts += [_U32.pack(len(name)), name, kind, _U32.pack(len(raw)), raw]
    return b"".join(parts)


def _digest(
    parent: bytes, count: bytes, packed: bytes | memoryview, extra_len: bytes, extra: bytes
) -> bytes:
    # parent is fixed-width, the token count fixes the token bytes and the extra length the
    # rest, so no two inputs share a byte string.
    h = sha256(parent)
    h.update(count)
    h.update(packed)
    h.update(extra_len)
    h.update(extra)
    return h.digest()


def hash_block(parent: bytes, tokens: Sequence[int], extra: bytes = b"") -> BlockHash:
    """SHA-256 of (parent hash, token count, uint32 tokens, extra length, extra)."""
    assert len(parent) == HASH_BYTES, f"parent hash is {len(parent)} bytes, not {HASH_BYTES}"
    packed = pack_tokens(tokens)
    return _digest(parent, _U32.pack(len(tokens)), packed, _U32.pack(len(extra)), extra)


@lru_cache(maxsize=1024)
def chain_root(extra_keys: ExtraKeys = ()) -> BlockHash:
    """The anchor a chain's first block hangs from: seed plus extra keys, zero tokens."""
    return hash_block(ROOT_SEED, (), encode_extra_keys(extra_keys))


def hash_chain(
    tokens: Sequence[int], block_size: int = BLOCK_SIZE, extra_keys: ExtraKeys = ()
) -> list[BlockHash]:
    """One hash per full block of `tokens`; a trailing partial block gets none."""
    return _hash_blocks(chain_root(extra_keys), tokens, block_size)


def _hash_blocks(parent: BlockHash, tokens: Sequence[int], block_size: int) -> list[BlockHash]:
    """The hashes of the full blocks of `tokens`, chained from `parent`."""
    assert block_size > 0, f"block_size {block_size}"
    view = memoryview(pack_tokens(tokens))
    step = block_size * 4
    count = _U32.pack(block_size)
    chain = []
    for start in range(0, len(tokens) // block_size * step, step):
        parent = _digest(parent, count, view[start : start + step], _NO_EXTRA, b"")
        chain.append(parent)
    return chain


def checkpoint_key(anchor: BlockHash, tail: Sequence[int]) -> BlockHash:
    """Identity of a checkpoint at `tail` tokens past `anchor`; never equal to a block hash."""
    return hash_block(anchor, tail, _CHECKPOINT_TAG)


class Chain:
    """A request's tokens and the hashes of their full blocks, computed once per request.

    Every tier looks up and stores by these hashes (vLLM's `request.block_hashes`); `extend`
    hashes only the blocks that new tokens complete, so a generation's save stays linear.
    """

    # Weakly referable: where a request's prefill resumed is remembered by its chain
    # (resume_points.py) without keeping a long prompt's tokens and hashes alive.
    __slots__ = ("tokens", "hashes", "root", "block_size", "extra_keys", "__weakref__")

    def __init__(
        self, tokens: Sequence[int], block_size: int = BLOCK_SIZE, extra_keys: ExtraKeys = ()
    ) -> None:
        self.tokens: tuple[int, ...] = tuple(tokens)
        self.block_size = block_size
        self.extra_keys = extra_keys
        self.root = chain_root(extra_keys)
        self.hashes: list[BlockHash] = hash_chain(self.tokens, block_size, extra_keys)

    def __len__(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        return f"Chain(tokens={len(self.tokens)}, blocks={len(self.hashes)}, bs={self.block_size})"

    def extend(self, tokens: Sequence[int]) -> None:
        """Append `tokens`, hashing the blocks they complete."""
        if not tokens:
            return
        done = len(self.hashes)
        self.tokens += tuple(tokens)
        pending = self.tokens[done * self.block_size :]
        self.hashes += _hash_blocks(self.anchor(done), pending, self.block_size)

    def prefix(self, n: int) -> Chain:
        """The chain of the first `n` tokens, its hashes taken from this one's."""
        out = Chain.__new__(Chain)
        out.tokens, out.block_size, out.extra_keys = (
            self.tokens[:n],
            self.block_size,
            self.extra_keys,
        )
        out.root, out.hashes = self.root, self.hashes[: n // self.block_size]
        return out

    def anchor(self, block: int) -> BlockHash:
        """What positions inside block `block` hang from: the previous block's hash, or the root."""
        assert 0 <= block <= len(self.hashes), f"anchor of block {block} of {len(self.hashes)}"
        return self.root if block == 0 else self.hashes[block - 1]

    def anchors(self, n: int) -> list[BlockHash]:
        """The anchors of blocks 0..n."""
        assert 0 <= n <= len(self.hashes), f"{n} anchors asked of {len(self.hashes)} blocks"
        return [self.root, *self.hashes[:n]]

    def tail(self, position: int) -> tuple[int, ...]:
        """The tokens from the start of `position`'s block up to `position`."""
        return self.tokens[position - position % self.block_size : position]

    def checkpoint_key(self, position: int) -> BlockHash:
        """The key a checkpoint at `position` of this chain is stored under."""
        return checkpoint_key(self.anchor(position // self.block_size), self.tail(position))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens two sequences share from the start. Slices are compared (C speed)
    in shrinking steps; sequences of different types are compared as lists."""
    if type(a) is not type(b):
        a, b = list(a), list(b)
    n = min(len(a), len(b))
    lo = 0
    for step in (4096, 256, 16, 1):
        while lo + step <= n and a[lo : lo + step] == b[lo : lo + step]:
            lo += step
    return lo
