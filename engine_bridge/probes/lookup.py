"""What finding a prompt in the cache costs: hashing plus one lookup over RAM and SSD.

Run by the bench's overhead scenario (through `python -m engine_bridge.probes.shapes overhead`)
on one long prompt, with real SSD files and real K/V payloads, so every figure is the code
path a request takes: `Chain` (the hashes), `TieredCache.lookup`, the pin a restore takes,
and for an SSD hit the promotion that reads the files into RAM.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from ..cache.hashing import BLOCK_SIZE, Chain
from ..cache.ram.manager import CacheManager
from ..cache.ssd.index import Scope
from ..cache.ssd.store import SSDConfig, SSDStore
from ..cache.tiers import Stored, TieredCache
from ..kv import BlockPayload, DenseKV, HostCodec

_SCOPE = Scope("lookup-probe")
_EXTRA = (("model", "lookup-probe"), ("tenant", "default"))


def median_s(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of `repeats` calls of `fn` (the probes' one timing rule)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _block(i: int) -> BlockPayload:
    # One small layer (2 heads x 16 dims, float16): 8 KB a block, so reads stay cheap and
    # the figures are the lookup's, not the disk's.
    kv = mx.full((1, 2, BLOCK_SIZE, 16), i % 100, dtype=mx.float16)
    mx.eval(kv)
    return BlockPayload(i * BLOCK_SIZE, BLOCK_SIZE, (DenseKV(kv, kv),))


def lookup_costs(n_tokens: int = 32_768, repeats: int = 10) -> dict[str, float]:
    """Median seconds per step for an `n_tokens` prompt: a cold miss, a RAM hit, an SSD hit."""
    tokens = [(i * 2_654_435_761) % 151_936 for i in range(n_tokens)]
    n_blocks = n_tokens // BLOCK_SIZE
    payloads = {i: _block(i) for i in range(n_blocks)}
    codec = HostCodec()

    def chain() -> Chain:
        return Chain(tokens, BLOCK_SIZE, _EXTRA)

    with tempfile.TemporaryDirectory(prefix="lookup-probe-") as tmp:
        ssd = SSDStore(SSDConfig(root=Path(tmp), queue_size=n_blocks + 16, reconcile="off"))

        def tiers(ssd: SSDStore | None = ssd) -> TieredCache:
            return TieredCache(CacheManager(1 << 40), ssd, codec, write_through=False)

        empty = tiers()
        miss = median_s(lambda: empty.lookup(chain(), _SCOPE, needs_checkpoint=False), repeats)

        warm = tiers()
        warm.ram.insert_blocks(chain(), {i: Stored(p, _SCOPE) for i, p in payloads.items()})

        def ram_hit() -> None:
            hit = warm.lookup(chain(), _SCOPE, needs_checkpoint=False)
            warm.ram.release(warm.pin(hit, promoted=False))

        ram = median_s(ram_hit, repeats)
        ram_length = warm.lookup(chain(), _SCOPE, needs_checkpoint=False).length

        writer = TieredCache(CacheManager(1 << 40), ssd, codec, write_through=True)
        writer.store_blocks(chain(), _SCOPE, payloads)
        assert ssd.flush(120.0), "the probe's SSD writes did not finish"

        plan = median_s(lambda: tiers().lookup(chain(), _SCOPE, needs_checkpoint=False), repeats)

        def ssd_hit() -> int:
            t = tiers()
            hit = t.lookup(chain(), _SCOPE, needs_checkpoint=False)
            assert t.promote(hit), "the SSD hit did not promote"
            return hit.length

        promote = median_s(ssd_hit, repeats)
        ssd_length = ssd_hit()
        entry_bytes = ssd.stats().bytes / max(1, ssd.stats().entries)
        ssd.close()
    return {
        "tokens": n_tokens,
        "hash_chain_s": median_s(chain, repeats),
        "lookup_miss_s": miss,
        "lookup_hit_s": ram,
        "hit_length": ram_length,
        "lookup_ssd_s": plan,
        "promote_ssd_s": promote,
        "ssd_hit_length": ssd_length,
        "ssd_entry_bytes": entry_bytes,
        "ssd_entries_read": n_blocks,
    }
