"""GET /v1/cache/stats reads the engine's stats off the event loop: while the SSD index's
lock is held (as the SSD writer holds it during a write), the stats request waits and
every other route still answers.

The real app on a real engine with its SSD tier; another thread holds the real lock.
"""

from __future__ import annotations

import asyncio
import threading
import time

from engine_bridge.engine import Engine, EngineSettings
from proxy.app import create_app
from proxy.config.model import UpstreamConfig
from proxy.state import ProxySettings
from tests.conftest import fresh_cache_dir

HOLD_S = 3.0  # the longest the lock is held, should the stats route block the loop


async def test_stats_wait_for_the_ssd_index_while_other_routes_answer(
    aiohttp_client, demo_root, tmp_path
):
    engine = Engine(
        EngineSettings(
            cache_dir=fresh_cache_dir(demo_root, tmp_path / "cache"), model_specs=["demo-llama"]
        )
    )
    app = create_app(engine, ProxySettings(), UpstreamConfig(enabled=False))
    client = await aiohttp_client(app)
    index = engine.tiers.ssd._index
    assert index is not None
    held, release = threading.Event(), threading.Event()

    def writer() -> None:
        with index._lock:
            held.set()
            release.wait(HOLD_S)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        assert held.wait(5)
        t0 = time.monotonic()
        stats = asyncio.create_task(client.get("/v1/cache/stats"))
        await asyncio.sleep(0.2)  # the stats request is in and waiting for the lock
        health = await client.get("/health")
        models = await client.get("/v1/models")
        answered_s = time.monotonic() - t0
        assert health.status == 200 and models.status == 200
        assert answered_s < 1.5, answered_s  # before the fix: HOLD_S, the loop was blocked
        assert not stats.done()
    finally:
        release.set()
        thread.join()
    r = await asyncio.wait_for(stats, 10)
    assert r.status == 200
    assert (await r.json())["ssd"]["entries"] == 0
