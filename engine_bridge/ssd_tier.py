"""The SSD tier as the prompt cache sees it: write-through, spill, and promotion to RAM.

Payloads cross as host bytes (converted on the model's thread, so the writer thread never
touches a lazy MLX graph). Promotion reserves RAM budget before it reads, so parallel
promotions cannot overrun memory; a refused reservation degrades to a shorter hit.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from . import kv
from .cache.hashing import BlockHash, checkpoint_key
from .cache.index import RESERVED_NAMES, Scope
from .cache.manager import CacheManager, EntryKind
from .cache.ssd import PutReason, SSDStore

log = logging.getLogger("engine_bridge.ssd_tier")

_SAFE_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


@dataclass(slots=True)
class Stored:
    """What the RAM tier holds: a kv payload plus where it lives on SSD."""

    payload: kv.Payload
    scope: Scope
    key: BlockHash
    reason: str = ""
    on_ssd: bool = False

    @property
    def nbytes(self) -> int:
        return self.payload.nbytes


def scope_for(fingerprint: str, tenant: str) -> Scope:
    """Tenant names come from clients: anything not plainly safe as a folder is hashed."""
    if not _SAFE_TENANT.fullmatch(tenant) or tenant in RESERVED_NAMES:
        tenant = "t-" + hashlib.sha256(tenant.encode()).hexdigest()[:24]
    return Scope(model=fingerprint, tenant=tenant)


def kind_dir(kind: EntryKind) -> str:
    return "blocks" if kind == "block" else "checkpoints"


class SSDTier:
    def __init__(self, store: SSDStore, write_through: bool = True):
        self.store = store
        self.write_through = write_through

    def write(self, stored: Stored, kind: EntryKind, tokens: int, reason: PutReason) -> None:
        if stored.on_ssd:
            return
        tensors, meta = kv.payload_to_host(stored.payload)
        meta = {**meta, "cache.reason": stored.reason, "cache.tokens": str(tokens)}
        outcome = self.store.put(
            stored.scope, kind_dir(kind), stored.key, tensors, meta, tokens=tokens, reason=reason
        )
        stored.on_ssd = outcome in ("queued", "duplicate")

    def on_evict(
        self, kind: EntryKind, hash_: BlockHash, tokens: tuple[int, ...], obj: object
    ) -> None:
        """RAM eviction hook: spill what is not on disk yet instead of losing it."""
        if isinstance(obj, Stored) and not obj.on_ssd:
            self.write(obj, kind, len(tokens), "spill")

    def present_blocks(
        self, scope: Scope, chain: Sequence[BlockHash], in_ram: Callable[[BlockHash], bool]
    ) -> int:
        """How many leading blocks of the chain are on disk or in RAM.

        Both count: a hot prefix stays in RAM and is never spilled (so it is not on disk
        without write-through), while the tail behind it was evicted and spilled.
        """
        on_disk = self.store.contains_many(scope, "blocks", chain)
        for i, (key, disk) in enumerate(zip(chain, on_disk, strict=True)):
            if not disk and not in_ram(key):
                return i
        return len(chain)

    def find_checkpoint(
        self,
        scope: Scope,
        root: BlockHash,
        chain: Sequence[BlockHash],
        tokens: Sequence[int],
        bs: int,
        lo: int,
        hi: int,
    ) -> tuple[int, BlockHash] | None:
        """The deepest on-disk checkpoint at a position in (lo, hi], on the request's path."""
        for a in range(hi // bs, -1, -1):
            start = a * bs
            if start + bs - 1 <= lo:
                break
            anchor = root if a == 0 else chain[a - 1]
            positions = [p for p in range(min(hi, start + bs - 1), max(lo, start - 1), -1) if p > 0]
            if not positions:
                continue
            keys = [checkpoint_key(anchor, tokens[start:p]) for p in positions]
            for p, key, present in zip(
                positions, keys, self.store.contains_many(scope, "checkpoints", keys), strict=True
            ):
                if present:
                    return p, key
        return None

    def read(
        self, ram: CacheManager, scope: Scope, kind: EntryKind, key: BlockHash
    ) -> Stored | None:
        """Promote one entry: reserve its RAM budget, read, convert; None degrades the hit."""
        held: list[int] = []

        def reserve(n: int) -> bool:
            ok = ram.reserve(n)
            if ok:
                held.append(n)
            return ok

        def release(n: int) -> None:
            ram.unreserve(n)
            held.remove(n)

        entry = self.store.get(scope, kind_dir(kind), key, reserve=reserve, release=release)
        try:
            if entry is None:
                return None
            payload = kv.payload_from_host(entry.tensors, entry.meta)
        except (kv.PayloadFormatError, ValueError, AssertionError) as e:
            log.warning("ssd entry %s is unreadable as a payload: %s", key.hex()[:16], e)
            return None
        finally:
            # The caller inserts the entry right away: hand the reservation back first so
            # its bytes are not counted twice.
            for n in held:
                ram.unreserve(n)
        return Stored(payload, scope, key, entry.meta.get("cache.reason", ""), on_ssd=True)

    def close(self, timeout_s: float) -> None:
        self.store.close(timeout_s)
