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
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

import mlx.core as mx

from .cache.index import Scope
from .cache.kinds import EntryKind
from .cache.manager import CacheManager
from .cache.ssd import SSDStore
from .kv.host import PayloadFormatError, tensor_from_host, tensor_to_host

log = logging.getLogger("engine_bridge.vision")

# The most RAM one model's features take, whatever the budget leaves them.
FEATURE_CACHE_BYTES = 256 << 20
_TENSOR = "features"


@dataclass(slots=True)
class FeatureStats:
    encoder_runs: int = 0  # images the vision tower encoded (misses in every tier)
    feature_hits_ram: int = 0
    feature_hits_ssd: int = 0
    feature_ssd_writes: int = 0  # entries queued to the SSD writer
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
        self._model = ""
        self.stats = FeatureStats()

    def bind(self, tier: CacheManager | None, ssd: SSDStore | None, model: str) -> None:
        """Keep features within `tier`'s budget and on `ssd`, scoped by `model` (the
        model's fingerprint, as blocks are)."""
        self.unbind()
        self._tier, self._ssd, self._model = tier, ssd, model
        if tier is not None:
            tier.add_reclaimer(self.reclaim)

    def unbind(self) -> None:
        """Let every entry go and leave the tiers (the model is unloaded)."""
        self.clear()
        if self._tier is not None:
            self._tier.remove_reclaimer(self.reclaim)
        self._tier = self._ssd = None

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
        key = (tenant, digest)
        with self._lock:
            hit = self._ram.get(key)
            if hit is not None:
                self._ram.move_to_end(key)
                self.stats.feature_hits_ram += 1
                return hit
        if self._ssd is None:
            return None
        entry = self._ssd.get(Scope.of(self._model, tenant), EntryKind.FEATURES, digest)
        if entry is None or _TENSOR not in entry.tensors:
            return None
        try:
            feats = tensor_from_host(entry.tensors[_TENSOR])
        except PayloadFormatError:
            log.warning("unreadable feature entry %s; encoding again", digest.hex()[:12])
            return None
        self.stats.feature_hits_ssd += 1
        self._keep(key, feats)
        return feats

    def put(self, tenant: str, digest: bytes, feats: mx.array) -> None:
        """A fresh encoder output: keep it in RAM and queue it to the SSD writer."""
        self.stats.encoder_runs += 1
        self._keep((tenant, digest), feats)
        if self._ssd is not None:
            host = {_TENSOR: tensor_to_host(feats)}
            scope = Scope.of(self._model, tenant)
            outcome = self._ssd.put(
                scope, EntryKind.FEATURES, digest, host, tokens=int(feats.shape[0])
            )
            if outcome != "dropped":
                self.stats.feature_ssd_writes += 1

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

    def _keep(self, key: tuple[str, bytes], feats: mx.array) -> None:
        nbytes = feats.nbytes
        if nbytes > self.max_bytes:
            return
        with self._lock:
            if key in self._ram:
                return
            while self._ram and self.stats.feature_bytes + nbytes > self.max_bytes:
                self._drop_oldest()
            # Blocks are evicted to make room; if pinned data leaves none, older features go
            # first, and with none left this one lives on SSD only.
            while self._tier is not None and not self._tier.charge(nbytes):
                if not self._ram:
                    return
                self._drop_oldest()
            self._ram[key] = feats
            self.stats.feature_bytes += nbytes

    def _drop_oldest(self) -> int:
        return self._drop(next(iter(self._ram)))

    def _drop(self, key: tuple[str, bytes]) -> int:
        old = self._ram.pop(key)
        self.stats.feature_bytes -= old.nbytes
        if self._tier is not None:
            self._tier.credit(old.nbytes)
        return old.nbytes
