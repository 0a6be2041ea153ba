"""The vision feature cache in the tiers (issue 13 item 4), on demo-vision.

Encoder output is charged to the RAM tier's budget (blocks are evicted for it, and it is let
go when the budget cannot hold it), written to the SSD store as an entry of its own kind,
and read back, verified, by another process or once RAM has dropped it: a turn that needs
an image's features past the cached prefix does not run the encoder again. Reading back is
a request's read-ahead (`read_ahead` below does what its cache session does): the MLX
thread, which asks the feature cache, does no tier I/O.
"""

from __future__ import annotations

import asyncio
import io

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_vlm")

import anthropic  # noqa: E402
import httpx  # noqa: E402
from PIL import Image  # noqa: E402

from engine_bridge.cache.hashing import Chain  # noqa: E402
from engine_bridge.cache.kinds import EntryKind  # noqa: E402
from engine_bridge.cache.ram.manager import CacheManager  # noqa: E402
from engine_bridge.cache.shared.config import SharedConfig, SharedWritePolicy  # noqa: E402
from engine_bridge.cache.shared.store import SharedStore  # noqa: E402
from engine_bridge.cache.shared.tier import SharedTier  # noqa: E402
from engine_bridge.cache.ssd.index import Scope  # noqa: E402
from engine_bridge.cache.ssd.store import SSDConfig, SSDStore  # noqa: E402
from engine_bridge.cache.tier_reads import TierReads  # noqa: E402
from engine_bridge.types import ImageInput  # noqa: E402
from engine_bridge.vision import model as vision  # noqa: E402
from engine_bridge.vision import prompt as vp  # noqa: E402
from engine_bridge.vision.features import FeatureCache  # noqa: E402
from tests.conftest import fresh_cache_dir, start_server  # noqa: E402
from tests.support.redis_helpers import redis_server_fixture  # noqa: E402, F401

MODEL = "demo-vision"


def png(seed: int, width: int = 120, height: int = 90) -> bytes:
    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def vision_root(tmp_path_factory):
    from engine_bridge.models.demo import ensure_demo_model

    root = tmp_path_factory.mktemp("vision-features")
    ensure_demo_model(MODEL, root)
    return root


@pytest.fixture(scope="module")
def model(vision_root):
    return vision.load(vision_root / "models" / MODEL)[0]


def image(model, seed: int) -> vp.PreparedImage:
    raw = ImageInput(png(seed), "image/png", f"img{seed}")
    return vp.preprocess(raw, model.spec, vp.VisionLimits())


def encode_uncached(model, img) -> mx.array:
    model.feature_cache = FeatureCache()
    return model.features(img)


def read_ahead(cache: FeatureCache, tenant: str, img, ssd, shared=None, ram=None) -> None:
    """What a request with `img` does before its prefill (prompt_cache.CacheSession): its
    read-ahead reads the features RAM lacks on the tiers' I/O threads (tier_reads.py), and
    its restore, on the MLX thread, hands them to the feature cache."""
    reads = TierReads(ram or CacheManager(1 << 30), ssd, shared, lambda *a: None)
    try:
        digests = cache.missing(tenant, [img.digest])
        pre = asyncio.run(reads.prefetch(Chain([0], 4), Scope("fp", tenant), False, (), digests))
        got = pre.take(EntryKind.FEATURES, img.digest)
        if got is not None:
            cache.adopt(tenant, img.digest, got[0].tensors, got[1])
        pre.close()
    finally:
        reads.close()


def test_features_count_in_the_ram_budget_and_come_back_from_ssd(model, tmp_path):
    first, second = image(model, 1), image(model, 2)
    want1, want2 = encode_uncached(model, first), encode_uncached(model, second)
    size = want1.nbytes
    assert want2.nbytes == size
    # Room for one image's features and a little more: blocks, then older features, go.
    ram = CacheManager(size + size // 2, block_size=4)
    payload = np.zeros(size // 2, dtype=np.uint8)
    ram.insert_blocks(Chain(list(range(8)), 4), {0: payload, 1: payload})
    assert ram.stats().blocks == 2
    ssd = SSDStore(SSDConfig(tmp_path / "ssd", reconcile="sync"))
    cache = model.feature_cache = FeatureCache()
    cache.bind(ram, ssd, "fp")
    got = model.features(first, "alice")
    stats = ram.stats()
    assert stats.charged_bytes == size
    assert stats.evicted_blocks >= 1 and stats.block_bytes + size <= stats.budget_bytes
    assert model.features(first, "alice") is got and cache.stats.feature_hits_ram == 1
    model.features(second, "alice")  # the first image's features leave RAM for these
    assert ram.stats().charged_bytes == size and cache.snapshot().feature_entries == 1
    assert cache.stats.encoder_runs == 2
    assert ssd.flush()
    assert ssd.holds(Scope("fp", "alice"), EntryKind.FEATURES, first.digest)
    read_ahead(cache, "alice", first, ssd, ram=ram)
    again = model.features(first, "alice")
    assert cache.stats.encoder_runs == 2 and cache.stats.feature_hits_ssd == 1
    assert cache.stats.feature_hits_ram == 1  # the read back is the SSD's hit, not RAM's
    assert mx.array_equal(again, want1) and again.dtype == want1.dtype
    # Another tenant's request does not read alice's entry: scoped like blocks.
    read_ahead(cache, "bob", first, ssd, ram=ram)
    model.features(first, "bob")
    assert cache.stats.encoder_runs == 3
    # A model unloaded hands its bytes back to the budget.
    cache.clear()
    assert ram.stats().charged_bytes == 0
    ssd.close()

    # Another process (a new store on the same folder) reads them back, verified.
    reopened = SSDStore(SSDConfig(tmp_path / "ssd", reconcile="sync"))
    cache = model.feature_cache = FeatureCache()
    cache.bind(CacheManager(1 << 30), reopened, "fp")
    read_ahead(cache, "alice", second, reopened)
    assert mx.array_equal(model.features(second, "alice"), want2)
    assert cache.stats.encoder_runs == 0 and cache.stats.feature_hits_ssd == 1
    reopened.close()


def test_a_budget_shrunk_under_pressure_lets_features_go_to_ssd_after_the_blocks(model, tmp_path):
    first, second = image(model, 3), image(model, 4)
    size = encode_uncached(model, first).nbytes
    ram = CacheManager(4 * size, block_size=4)
    ssd = SSDStore(SSDConfig(tmp_path / "ssd", reconcile="sync"))
    cache = model.feature_cache = FeatureCache()
    cache.bind(ram, ssd, "fp")
    model.features(first, "alice")
    model.features(second, "alice")
    payload = np.zeros(size // 2, dtype=np.uint8)
    ram.insert_blocks(Chain(list(range(8)), 4), {0: payload, 1: payload})
    assert ram.stats().charged_bytes == 2 * size and ram.stats().blocks == 2
    # The memory guard's shrink: the unpinned blocks go, then the oldest features.
    freed = ram.set_budget(size + size // 4)
    stats = ram.stats()
    assert stats.blocks == 0 and stats.charged_bytes == size and freed == 2 * size
    assert cache.snapshot().feature_entries == 1 and cache.stats.feature_bytes == size
    assert ssd.flush()
    read_ahead(cache, "alice", first, ssd, ram=ram)  # the newer one leaves RAM for it
    model.features(first, "alice")
    assert cache.stats.encoder_runs == 2 and cache.stats.feature_hits_ssd == 1
    ram.set_budget(0)
    assert ram.stats().charged_bytes == 0 and cache.snapshot().feature_entries == 0
    # Unloaded: it leaves the tier, which no longer asks it for bytes.
    ram.set_budget(4 * size)
    model.features(second, "alice")
    cache.unbind()
    assert ram.stats().charged_bytes == 0 and cache.snapshot().feature_entries == 0
    assert ram.set_budget(0) == 0
    ssd.close()


class Machine:
    """One proxy's feature cache: its own RAM tier and SSD folder, the shared store."""

    def __init__(self, tmp_path, name: str, url: str, policy: SharedWritePolicy) -> None:
        self.store = SharedStore(SharedConfig(url=url, write_policy=policy, timeout_s=2.0))
        self.ssd = SSDStore(SSDConfig(tmp_path / name, reconcile="sync"))
        self.cache = FeatureCache()
        self.shared = SharedTier(self.store)
        self.cache.bind(CacheManager(1 << 30), self.ssd, "fp", self.shared)

    def features(self, model, img, tenant: str) -> mx.array:
        """A request's: read ahead, then asked for on the MLX thread."""
        model.feature_cache = self.cache
        read_ahead(self.cache, tenant, img, self.ssd, self.shared)
        return model.features(img, tenant)

    def close(self) -> None:
        self.ssd.close()
        self.store.close()


@pytest.mark.parametrize("policy", [SharedWritePolicy.ALL, SharedWritePolicy.SECOND_USE])
def test_features_encoded_on_one_machine_are_read_on_another_from_the_shared_store(
    model, tmp_path, redis_server, policy
):
    img = image(model, 5)
    want = encode_uncached(model, img)
    a, b, c = (Machine(tmp_path, name, redis_server.url, policy) for name in "abc")
    try:
        model.feature_cache = a.cache
        model.features(img, "alice")
        assert a.store.flush(10)
        if policy is SharedWritePolicy.SECOND_USE:  # sent when read again, once
            assert a.cache.stats.feature_shared_writes == 0
            model.features(img, "alice")
            model.features(img, "alice")
            assert a.store.flush(10)
        assert a.cache.stats.feature_shared_writes == 1
        got = b.features(model, img, "alice")
        stats = b.cache.stats
        assert (stats.encoder_runs, stats.feature_hits_shared) == (0, 1)
        assert mx.array_equal(got, want) and got.dtype == want.dtype
        # B keeps a copy on its own SSD, for its restarts.
        assert b.ssd.flush() and b.ssd.holds(Scope("fp", "alice"), EntryKind.FEATURES, img.digest)
        b.features(model, img, "bob")  # alice's entry is not bob's, on any machine
        assert b.cache.stats.encoder_runs == 1
        # A corrupt value in the store is a miss: the encoder runs, the answer is its own.
        client = redis_server.client()
        for name in client.keys("mlx-prompt-cache:fp:alice:f:*"):
            value = bytearray(client.get(name))
            value[-1] ^= 0x01
            client.set(name, bytes(value))
        assert mx.array_equal(c.features(model, img, "alice"), want)
        assert (c.cache.stats.encoder_runs, c.cache.stats.feature_hits_shared) == (1, 0)
        assert c.store.stats().errors["corrupt"] == 1
    finally:
        for m in (a, b, c):
            m.close()


def test_a_corrupt_feature_file_is_a_miss_and_the_encoder_runs(model, tmp_path):
    img = image(model, 3)
    want = encode_uncached(model, img)
    ssd = SSDStore(SSDConfig(tmp_path / "ssd", reconcile="sync"))
    cache = model.feature_cache = FeatureCache()
    cache.bind(None, ssd, "fp")
    model.features(img, "alice")
    assert ssd.flush()
    ssd.close()
    (path,) = (tmp_path / "ssd").rglob(f"*{img.digest.hex()}*")
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    reopened = SSDStore(SSDConfig(tmp_path / "ssd", reconcile="sync"))
    cache = model.feature_cache = FeatureCache()
    cache.bind(None, reopened, "fp")
    read_ahead(cache, "alice", img, reopened)
    assert mx.array_equal(model.features(img, "alice"), want)
    assert cache.stats.encoder_runs == 1 and cache.stats.feature_hits_ssd == 0
    reopened.close()


@pytest.mark.parametrize("source", ["ssd", "shared"])
def test_a_new_conversation_with_the_image_reads_its_features_not_the_encoder(
    vision_root, tmp_path, request, source
):
    """The second server (the first restarted on its folder, or another machine on its own
    folder sharing a Redis) misses its prefix before the image (another system prompt), so
    its tokens are prefilled again, from the encoder output the first server stored."""
    cache = fresh_cache_dir(vision_root, tmp_path / "cache")
    other, env = cache, {}
    if source == "shared":
        other = fresh_cache_dir(vision_root, tmp_path / "cache-b")
        env = {
            "MLX_PROMPT_CACHE_CACHE_SHARED_URL": request.getfixturevalue("redis_server").url,
            "MLX_PROMPT_CACHE_CACHE_SHARED_WRITE_POLICY": "all",
        }
    args = ("--model", MODEL, "--upstream", "http://127.0.0.1:9")
    data = __import__("base64").b64encode(png(40, 200, 150)).decode()
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
    messages = [{"role": "user", "content": [block, {"type": "text", "text": "What is it?"}]}]

    def ask(server, system: str, bypass: bool = False) -> tuple[str, int]:
        client = anthropic.Anthropic(base_url=server.url, api_key="t", max_retries=0, timeout=120)
        headers = {"x-tenant": "features"} | ({"x-prompt-cache": "bypass"} if bypass else {})
        raw = client.messages.with_raw_response.create(
            model=MODEL,
            system=system,
            messages=messages,
            max_tokens=12,
            extra_body={"temperature": 0},
            extra_headers=headers,
        )
        return raw.parse().content[0].text, int(raw.headers["x-prompt-cache-hit-tokens"])

    def vision_stats(server) -> dict:
        return httpx.get(f"{server.url}/v1/cache/stats", timeout=30).json()["vision"]

    first = start_server(cache, *args, env=env, log_path=tmp_path / "first.log")
    try:
        ask(first, "You read screenshots.")
        assert vision_stats(first)["encoder_runs"] == 1
        assert vision_stats(first)[f"feature_{source}_writes"] == 1
    finally:
        assert first.stop() == 0  # drains its SSD and shared-store writers
    second = start_server(other, *args, env=env, log_path=tmp_path / "second.log")
    try:
        text, hit = ask(second, "You explain what a screenshot shows, briefly.")
        assert hit == 0
        stats = vision_stats(second)
        assert stats["encoder_runs"] == 0, stats
        assert stats[f"feature_hits_{source}"] == 1, stats
        assert stats["prepared_entries"] == 1 and stats["prepared_bytes"] > 0
        assert text == ask(second, "You explain what a screenshot shows, briefly.", True)[0]
    finally:
        second.stop()


def test_clearing_the_cache_drops_the_features_in_ram_and_on_ssd(vision_root, tmp_path):
    cache = fresh_cache_dir(vision_root, tmp_path / "cache")
    server = start_server(cache, "--model", MODEL, "--upstream", "http://127.0.0.1:9")
    data = __import__("base64").b64encode(png(40, 200, 150)).decode()
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
    client = anthropic.Anthropic(base_url=server.url, api_key="t", max_retries=0, timeout=120)

    def ask(system: str) -> dict:
        client.messages.create(
            model=MODEL,
            system=system,
            messages=[{"role": "user", "content": [block, {"type": "text", "text": "Hm?"}]}],
            max_tokens=4,
            extra_body={"temperature": 0},
        )
        return httpx.get(f"{server.url}/v1/cache/stats", timeout=30).json()["vision"]

    try:
        assert ask("First.")["feature_bytes"] > 0
        cleared = httpx.delete(f"{server.url}/v1/cache", timeout=60)
        assert cleared.status_code == 200, cleared.text
        stats = httpx.get(f"{server.url}/v1/cache/stats", timeout=30).json()
        assert stats["vision"]["feature_bytes"] == 0 and stats["vision"]["feature_entries"] == 0
        assert stats["ram"].get("charged_bytes", 0) == 0
        # Another prompt with the same image: nothing left to read, the encoder runs again.
        after = ask("Second.")
        assert after["encoder_runs"] == 2 and after["feature_hits_ssd"] == 0, after
    finally:
        server.stop()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_memo_keeps_pixels_in_the_towers_dtype_and_the_features_are_the_same(
    vision_root, dtype
):
    """A half-precision tower rounds the float32 pixels anyway: the memo keeps them rounded
    (half the bytes), and the tower's output is exactly what float32 pixels give."""
    from dataclasses import replace
    from types import SimpleNamespace

    loaded, config = vision.load(vision_root / "models" / MODEL)
    loaded.vlm.vision_tower.set_dtype(getattr(mx, dtype))
    processor = SimpleNamespace(image_processor=loaded.spec.image_processor)
    narrow = vision.VisionModel(loaded.vlm, processor, config)
    assert narrow.spec.pixel_dtype == dtype
    wide_spec = replace(narrow.spec, pixel_dtype="float32", prepared=vp.PreparedCache())
    raw = ImageInput(png(5, 200, 150), "image/png", "img")
    wide = vp.preprocess(raw, wide_spec, vp.VisionLimits())
    kept = vp.preprocess(raw, narrow.spec, vp.VisionLimits())
    assert kept.digest == wide.digest
    assert kept.pixel_values.nbytes * 2 == wide.pixel_values.nbytes
    assert narrow.spec.prepared.stats()["prepared_bytes"] == kept.pixel_values.nbytes
    # The rounding is MLX's own, bit for bit.
    ref = mx.array(wide.pixel_values).astype(getattr(mx, dtype))
    got = mx.array(kept.pixel_values)
    got = got.view(mx.bfloat16) if dtype == "bfloat16" else got
    assert mx.array_equal(got, ref)
    assert mx.array_equal(narrow.features(kept), encode_uncached(narrow, wide))


def test_the_memo_is_bounded_by_bytes_and_counted(model):
    one = image(model, 6)
    memo = vp.PreparedCache(max_bytes=one.pixel_values.nbytes * 2)
    for key in (b"a", b"b", b"c"):
        memo.put(key, one)
    assert memo.get(b"a") is None and memo.get(b"c") is not None
    assert memo.stats() == {
        "prepared_entries": 2,
        "prepared_bytes": 2 * one.pixel_values.nbytes,
        "prepared_hits": 1,
    }
