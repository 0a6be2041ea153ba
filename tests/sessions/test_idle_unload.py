"""An idle model is unloaded; its prompt cache survives, so the next request still hits."""

from __future__ import annotations

import asyncio

from engine_bridge.engine import Engine, EngineSettings
from engine_bridge.types import GenerationRequest, GenerationResult, Message, Sampling


async def _generate(engine: Engine, content: str) -> GenerationResult:
    req = GenerationRequest(
        model="demo-llama",
        messages=[
            Message("system", "Be brief. " * 80),
            Message("user", content),
        ],
        max_tokens=8,
        sampling=Sampling(temperature=0.0),
    )
    stream = await engine.start(req)
    async for _ in stream:
        pass
    assert stream.result is not None
    return stream.result


def test_idle_model_unloads_and_reload_keeps_cache_hits(demo_root, tmp_path):
    async def scenario():
        engine = Engine(
            EngineSettings(cache_dir=demo_root, model_specs=["demo-llama"], ssd_enabled=False)
        )
        try:
            first = await _generate(engine, "first question")
            assert engine.models.loaded("demo-llama") is not None
            assert await engine.models.unload_idle(3600.0) == []  # just used: stays loaded
            assert await engine.models.unload_idle(0.0) == ["demo-llama"]
            assert engine.models.loaded("demo-llama") is None
            second = await _generate(engine, "second question")
            assert engine.models.loaded("demo-llama") is not None
            return first, second
        finally:
            await engine.close()

    first, second = asyncio.run(scenario())
    assert first.cached_tokens == 0
    # The shared system prompt was cached before the unload and still is after it.
    assert second.cached_tokens >= 128
    assert second.source == "ram"


def test_an_idle_unload_leaves_no_reference_to_the_model(demo_root):
    """Nothing keeps the weights once a model is unloaded: the ModelCache that held the
    LoadedModel goes with it, while its blocks stay in the RAM tier for the reload."""
    import gc
    import weakref

    async def scenario():
        engine = Engine(
            EngineSettings(cache_dir=demo_root, model_specs=["demo-llama"], ssd_enabled=False)
        )
        try:
            await _generate(engine, "first question")
            loaded = engine.models.loaded("demo-llama")
            refs = weakref.ref(loaded), weakref.ref(loaded.model)
            blocks = engine.tiers.ram.stats().blocks if hasattr(engine.tiers.ram, "stats") else None
            del loaded
            assert await engine.models.unload_idle(0.0) == ["demo-llama"]
            gc.collect()
            assert [r() for r in refs] == [None, None]
            if blocks is not None:
                assert engine.tiers.ram.stats().blocks == blocks
            again = await _generate(engine, "second question")
            assert again.cached_tokens >= 128 and again.source == "ram"
        finally:
            await engine.close()

    asyncio.run(scenario())
