"""POST /v1/cache/warm on a model with no prompt cache is refused before any prefill runs
(it used to prefill the whole prompt, then answer 409)."""

from __future__ import annotations

import asyncio

import pytest

from engine_bridge import kv
from engine_bridge import served as served_module
from engine_bridge.engine import Engine, EngineSettings
from engine_bridge.types import EngineError, GenerationRequest, Message
from tests.conftest import fresh_cache_dir


def test_warming_a_model_without_a_prompt_cache_prefills_nothing(demo_root, tmp_path, monkeypatch):
    def unsupported(*args, **kwargs):
        raise kv.UnsupportedCacheError("a cache layer this test cannot store")

    monkeypatch.setattr(served_module, "ModelCache", unsupported)  # where loads make caches
    engine = Engine(
        EngineSettings(
            cache_dir=fresh_cache_dir(demo_root, tmp_path), model_specs=["demo-llama"],
            ssd_enabled=False,
        )
    )  # fmt: skip
    req = GenerationRequest(
        model="demo-llama", messages=[Message("user", "Warm me up. " * 40)], max_tokens=4
    )

    async def scenario():
        try:
            with pytest.raises(EngineError) as err:
                await engine.warm(req)
            return err.value, engine.scheduler.stats.prefill_tokens
        finally:
            await engine.close()

    error, prefilled = asyncio.run(scenario())
    assert error.status == 409 and "has no prompt cache to warm" in str(error)
    assert prefilled == 0
