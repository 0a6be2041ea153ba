"""The vision encoder's output by image digest: in RAM within the RAM tier's budget, and on
SSD in the same safetensors store as K/V blocks.

A conversation resends its screenshot every turn, and a turn that must recompute past the
image (the prefix evicted, a restart, a new conversation with the same picture) needs its
features again. They are kept per model fingerprint and tenant, like blocks: in RAM the
bytes are charged to the RAM tier (`CacheManager.charge`), so blocks are evicted to make
room for them and they count in `ram.charged_bytes`; each new entry is also queued to the
SSD writer (header, checksums, verified reads) and read back from there after a restart or
once RAM let it go. Without the tiers bound (the cache off) RAM holds them by the fixed cap
alone, so a prefill in chunks still encodes an image once.

The MLX thread, which asks for features (`get`), does no tier I/O: a request's read-ahead
(cache/tier_reads.py, on the tiers' I/O threads, each under its deadline, before the
request is queued) reads what RAM lacks (`missing`) from the SSD or the shared store, and
its restore hands what its prefill needs over (`adopt`). A slow disk or store costs only
that request: past the deadline those features are a miss, and the encoder runs.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx

from ..cache.kinds import EntryKind
from ..cache.ram.manager import CacheManager
from ..cache.shared.config import SharedWritePolicy
from ..cache.ssd.index import Scope
from ..cache.ssd.store import SSDStore
from ..kv.host import PayloadFormatError, tensor_from_host, tensor_to_host

if TYPE_CHECKING:
    from ..cache.shared.tier import SharedTier

log = logging.getLogger("engine_bridge.vision.features")

# The most RAM one model's features take, whatever the budget leaves them.
FEATURE_CACHE_BYTES = 256 << 20
_TENSOR = "features"


@dataclass(slots=True)
class FeatureStats:
    encoder_runs: int = 0  # images the vision tower encoded (misses in every tier)
    feature_hits_ram: int = 0
    feature_hits_ssd: int = 0
    feature_hits_shared: int = 0  # read from the shared store ([cache.shared])
    feature_ssd_writes: int = 0  # entries queued to the SSD writer
    feature_shared_writes: int = 0  # entries queued to the shared store's writer
    feature_entries: int = 0  # in RAM now
    feature_bytes: int = 0  # in RAM now, charged to the RAM tier when it is bound


class FeatureCache:
    """One model's encoder outputs, by (tenant, image digest)."""

    def __init__(self, max_bytes: int = FEATURE_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._ram: OrderedDict[tuple[str, bytes], mx.array] = OrderedDict()
        self._lock = threading.Lock()
        self._tier: CacheManager | None = None
        self._ssd: SSDStore | None = None
        self._shared: SharedTier | None = None
        self._sent: set[tuple[str, bytes]] = set()  # entries in RAM the store was sent
        self._fresh: set[tuple[str, bytes]] = set()  # adopted, not asked for since
        self._model = ""
        self.stats = FeatureStats()

    def bind(
        self,
        tier: CacheManager | None,
        ssd: SSDStore | None,
        model: str,
        shared: SharedTier | None = None,
    ) -> None:
        """Keep features within `tier`'s budget, on `ssd` and in the `shared` store, scoped
        by `model` (the model's fingerprint, as blocks are)."""
        self.unbind()
        self._tier, self._ssd, self._model, self._shared = tier, ssd, model, shared
        if tier is not None:
            tier.add_reclaimer(self.reclaim)

    def unbind(self) -> None:
        """Let every entry go and leave the tiers (the model is unloaded)."""
        self.clear()
        if self._tier is not None:
            self._tier.remove_reclaimer(self.reclaim)
        self._tier = self._ssd = self._shared = None

    def reclaim(self, nbytes: int) -> int:
        """Let the oldest entries go until `nbytes` are handed back to the RAM tier (the
        memory guard shrank its budget below what pinned data and features hold); they
        stay on SSD. Returns the bytes let go."""
        freed = 0
        with self._lock:
            while self._ram and freed < nbytes:
                freed += self._drop_oldest()
        return freed

    def get(self, tenant: str, digest: bytes) -> mx.array | None:
        """From RAM, where features read ahead from the SSD or the shared store were put
        (`adopt`); None when the encoder must run. No tier I/O: the MLX thread asks."""
        key = (tenant, digest)
        with self._lock:
            hit = self._ram.get(key)
            if hit is None:
                return None
            self._ram.move_to_end(key)
            adopted = key in self._fresh  # its first use: counted as its tier's hit
            self._fresh.discard(key)
            if not adopted:
                self.stats.feature_hits_ram += 1
        if not adopted:
            self._reused(key, hit)
        return hit

    def missing(self, tenant: str, digests: list[bytes]) -> list[bytes]:
        """Of `digests`, those RAM lacks: what a request reads ahead from the SSD and the
        shared store (none unless bound to one)."""
        if self._ssd is None and self._shared is None:
            return []
        with self._lock:
            return [d for d in dict.fromkeys(digests) if (tenant, d) not in self._ram]

    def adopt(self, tenant: str, digest: bytes, host: Mapping, shared: bool) -> bool:
        """Features a request read ahead from the SSD (or the `shared` store) and its
        prefill needs: into RAM, counted as that tier's hit. On the MLX thread (it makes an
        array); False when they do not decode, RAM holds them already or cannot keep them
        (then the encoder runs)."""
        key = (tenant, digest)
        with self._lock:
            if key in self._ram:
                return False
        feats = _features_of(host, digest)
        if feats is None or not self._keep(key, feats):
            return False
        with self._lock:
            self._fresh.add(key)
        if shared:
            self.stats.feature_hits_shared += 1
            self._mark_sent(key)
            scope = Scope.of(self._model, tenant)
            self._write_ssd(scope, digest, host, len(feats))  # a copy for a restart
        else:
            self.stats.feature_hits_ssd += 1
            self._reused(key, feats)
        return True

    def put(self, tenant: str, digest: bytes, feats: mx.array) -> None:
        """A fresh encoder output: keep it in RAM and queue it to the SSD writer and, by its
        write policy, the shared store's."""
        self.stats.encoder_runs += 1
        self._keep((tenant, digest), feats)
        if self._ssd is None and self._shared is None:
            return
        host = {_TENSOR: tensor_to_host(feats)}
        scope = Scope.of(self._model, tenant)
        self._write_ssd(scope, digest, host, len(feats))
        if self._shared is not None and self._shared.policy is not SharedWritePolicy.SECOND_USE:
            self._share((tenant, digest), scope, host, len(feats))

    def _write_ssd(self, scope: Scope, digest: bytes, host: Mapping, tokens: int) -> None:
        if self._ssd is None:
            return
        if self._ssd.put(scope, EntryKind.FEATURES, digest, host, tokens=tokens) != "dropped":
            self.stats.feature_ssd_writes += 1

    def _reused(self, key: tuple[str, bytes], feats: mx.array) -> None:
        """Features read again: under the second-use policy, now they go to the shared
        store, once while RAM holds them (its writer skips what the store already has)."""
        shared = self._shared
        if shared is None or shared.policy is not SharedWritePolicy.SECOND_USE:
            return
        if key not in self._sent:
            scope = Scope.of(self._model, key[0])
            self._share(key, scope, {_TENSOR: tensor_to_host(feats)}, len(feats))

    def _share(self, key: tuple[str, bytes], scope: Scope, host: Mapping, tokens: int) -> None:
        assert self._shared is not None
        outcome = self._shared.store.put(scope, EntryKind.FEATURES, key[1], host, {}, tokens=tokens)
        if outcome == "queued":
            self.stats.feature_shared_writes += 1
        if outcome in ("queued", "duplicate"):
            self._mark_sent(key)

    def _mark_sent(self, key: tuple[str, bytes]) -> None:
        """Remember the store has `key` while RAM holds it (forgotten with the entry)."""
        with self._lock:
            if key in self._ram:
                self._sent.add(key)

    def clear(self, tenant: str | None = None) -> tuple[int, int]:
        """Let every entry (of one tenant) go, handing its bytes back to the RAM tier: a
        model unloaded, or DELETE /v1/cache. Returns (entries, bytes)."""
        with self._lock:
            keys = [k for k in self._ram if tenant is None or k[0] == tenant]
            return len(keys), sum(self._drop(k) for k in keys)

    def snapshot(self) -> FeatureStats:
        with self._lock:
            self.stats.feature_entries = len(self._ram)
            return FeatureStats(**{k: getattr(self.stats, k) for k in FeatureStats.__slots__})

    def _keep(self, key: tuple[str, bytes], feats: mx.array) -> bool:
        """Keep `feats` in RAM; False when it does not fit (or RAM has it already)."""
        nbytes = feats.nbytes
        if nbytes > self.max_bytes:
            return False
        with self._lock:
            if key in self._ram:
                return False
            while self._ram and self.stats.feature_bytes + nbytes > self.max_bytes:
                self._drop_oldest()
            # Blocks are evicted to make room; if pinned data leaves none, older features go
            # first, and with none left this one lives on SSD only.
            while self._tier is not None and not self._tier.charge(nbytes):
                if not self._ram:
                    return False
                self._drop_oldest()
            self._ram[key] = feats
            self.stats.feature_bytes += nbytes
            return True

    def _drop_oldest(self) -> int:
        return self._drop(next(iter(self._ram)))

    def _drop(self, key: tuple[str, bytes]) -> int:
        old = self._ram.pop(key)
        self._sent.discard(key)
        self._fresh.discard(key)
        self.stats.feature_bytes -= old.nbytes
        if self._tier is not None:
            self._tier.credit(old.nbytes)
        return old.nbytes


def _features_of(tensors: Mapping, digest: bytes) -> mx.array | None:
    """An entry's features, or None (with a warning) when its payload does not decode."""
    if _TENSOR not in tensors:
        return None
    try:
        return tensor_from_host(tensors[_TENSOR])
    except PayloadFormatError:
        log.warning("unreadable feature entry %s; encoding again", digest.hex()[:12])
        return None
