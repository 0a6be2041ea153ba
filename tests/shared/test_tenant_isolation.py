"""Tenants never see each other's cache, in RAM or on SSD, whatever their names.

A property test drives the real tiers (RAM manager, SSD store with its writer thread and
index, host codec) with many tenants storing and looking up overlapping prompts in random
order. The oracle: a tenant's hit never reaches past the blocks that tenant itself stored.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import mlx.core as mx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_bridge.cache.hashing import BLOCK_SIZE, Chain
from engine_bridge.cache.ram.manager import CacheManager
from engine_bridge.cache.ssd.index import Scope, is_valid_name
from engine_bridge.cache.ssd.store import SSDConfig, SSDStore
from engine_bridge.cache.tiers import TieredCache
from engine_bridge.kv import BlockPayload, DenseKV, HostCodec

HOSTILE = [
    "alice",
    "bob",
    "../../etc",
    "..",
    "a/b",
    "nul\x00byte",
    "x" * 5000,
    "ünïcødé-テナント",
    "models",
    "quarantine",
    "C:\\windows",
    "",
]
MODEL = "tenant-test-model"
BASE = [(i * 7919) % 4093 for i in range(BLOCK_SIZE * 6)]


def _prompt(diverge_block: int, salt: int) -> list[int]:
    """The shared base up to a block, then tokens of its own."""
    cut = diverge_block * BLOCK_SIZE
    tail = [(salt * 104_729 + i * 31) % 4093 for i in range(BLOCK_SIZE * 6 - cut)]
    return BASE[:cut] + tail


def _payload(i: int) -> BlockPayload:
    kv = mx.full((1, 1, BLOCK_SIZE, 8), i % 50, dtype=mx.float16)
    mx.eval(kv)
    return BlockPayload(i * BLOCK_SIZE, BLOCK_SIZE, (DenseKV(kv, kv),))


def _chain(tokens: list[int], tenant: str) -> Chain:
    # The engine's extra keys: the model, then the tenant as the client named it.
    return Chain(tokens, BLOCK_SIZE, (("model", MODEL), ("tenant", tenant)))


def _own_prefix(stored: dict[str, list[list[int]]], tenant: str, tokens: list[int]) -> int:
    """The longest common prefix of `tokens` with anything this tenant stored: a paged
    hit may end inside a block, never past what the tenant's own blocks hold."""
    best = 0
    for other in stored.get(tenant, []):
        n = 0
        while n < min(len(tokens), len(other)) and tokens[n] == other[n]:
            n += 1
        best = max(best, n)
    return best


ops = st.lists(
    st.tuples(
        st.sampled_from(HOSTILE[:8]),  # tenants
        st.integers(0, 5),  # where the prompt leaves the shared base, in blocks
        st.integers(0, 2),  # which tail
        st.booleans(),  # store (True) or look up
    ),
    min_size=4,
    max_size=24,
)


@settings(
    max_examples=int(os.environ.get("TENANT_EXAMPLES", 25)),
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(ops)
def test_no_tenant_ever_hits_another_tenants_blocks_in_ram_or_on_ssd(ops):
    codec = HostCodec()
    with tempfile.TemporaryDirectory(prefix="tenants-") as tmp:
        ssd = SSDStore(SSDConfig(root=Path(tmp), queue_size=4096, reconcile="off"))
        try:
            _drive(ssd, codec, ops)
        finally:
            ssd.close()


def _drive(ssd: SSDStore, codec: HostCodec, ops: list) -> None:
    tiers = TieredCache(CacheManager(1 << 30), ssd, codec, write_through=True)
    stored: dict[str, list[list[int]]] = {}
    for tenant, diverge, salt, store in ops:
        tokens = _prompt(diverge, salt)
        chain = _chain(tokens, tenant)
        scope = Scope.of(MODEL, tenant)
        if store:
            tiers.store_blocks(chain, scope, {i: _payload(i) for i in range(6)})
            stored.setdefault(tenant, []).append(tokens)
            continue
        hit = tiers.lookup(chain, scope, needs_checkpoint=False)
        own = _own_prefix(stored, tenant, tokens)
        assert hit.ram.length <= own, (tenant, hit.ram.length, own)
        assert hit.length <= own, (tenant, hit.length, own)
    assert ssd.flush(60.0)

    # A restarted process: RAM empty, everything from the SSD tier.
    fresh = TieredCache(CacheManager(1 << 30), ssd, codec, write_through=True)
    for tenant in HOSTILE[:8]:
        for diverge in range(6):
            for salt in range(3):
                tokens = _prompt(diverge, salt)
                hit = fresh.lookup(
                    _chain(tokens, tenant), Scope.of(MODEL, tenant), needs_checkpoint=False
                )
                own = _own_prefix(stored, tenant, tokens)
                assert hit.length <= own, (tenant, diverge, salt, hit.length, own)
                if own >= 2 * BLOCK_SIZE:
                    assert hit.length > 0, "a tenant's own blocks must still hit from SSD"


def test_hostile_tenant_names_stay_inside_the_cache_folder(tmp_path):
    root = tmp_path / "cache"
    codec = HostCodec()
    ssd = SSDStore(SSDConfig(root=root, queue_size=1024, reconcile="off"))
    tiers = TieredCache(CacheManager(1 << 30), ssd, codec, write_through=True)
    tokens = _prompt(3, 0)
    for tenant in HOSTILE:
        scope = Scope.of(MODEL, tenant)
        assert is_valid_name(scope.tenant), (tenant, scope.tenant)
        tiers.store_blocks(_chain(tokens, tenant), scope, {i: _payload(i) for i in range(6)})
    assert ssd.flush(60.0)
    ssd.close()
    resolved = root.resolve()
    files = [Path(d) / f for d, _, fs in os.walk(tmp_path) for f in fs]
    assert files, "nothing was written"
    for f in files:
        assert f.resolve().is_relative_to(resolved), f"{f} escaped the cache folder"
    tenants = {p.name for p in (root / MODEL).iterdir() if p.is_dir()}
    # Every name became a distinct folder; the unsafe ones by hash, never by their text.
    assert len(tenants) == len(HOSTILE)
    assert {"alice", "bob"} <= tenants
    assert not tenants & {"..", "models", "quarantine", ""}


def test_an_api_keys_tenant_wins_over_the_tenant_header():
    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from proxy.generation import request_options
    from proxy.state import SETTINGS, ProxySettings

    app = web.Application()
    app[SETTINGS] = ProxySettings(tenant_api_keys={"sk-alice": "alice"})

    def tenant(headers: dict[str, str]) -> str:
        return request_options(make_mocked_request("POST", "/v1/messages", headers, app=app))[0]

    # A key holder cannot read another tenant's cache by naming it in the header.
    assert tenant({"x-api-key": "sk-alice", "x-tenant": "bob"}) == "alice"
    assert tenant({"authorization": "Bearer sk-alice", "x-tenant": "bob"}) == "alice"
    # Without a known key (a local, unexposed proxy), the header still chooses.
    assert tenant({"x-tenant": "bob"}) == "bob"
    assert tenant({"x-api-key": "sk-unknown", "x-tenant": "bob"}) == "bob"
    assert tenant({}) == "local"
