"""Under memory pressure the RAM tier shrinks (spilling to SSD) instead of the process dying.

The guard reads the system's available memory from psutil; these tests set the floor
above what this machine has, so the pressure is real as far as the guard can tell.
"""

from __future__ import annotations

import asyncio
import contextlib

import psutil
import pytest

from engine_bridge.engine import Engine, EngineSettings
from engine_bridge.types import GenerationRequest, Message, Sampling, TokenEvent
from tests.conftest import fresh_cache_dir

MODEL = "demo-llama"
SYSTEM = " ".join(f"rule{i}" for i in range(400))


def _req(i: int, use_cache: bool = True) -> GenerationRequest:
    return GenerationRequest(
        model=MODEL,
        messages=[Message("system", SYSTEM), Message("user", f"question {i}")],
        max_tokens=6,
        sampling=Sampling(temperature=0.0),
        use_cache=use_cache,
    )


async def _run(engine: Engine, req: GenerationRequest):
    stream = await engine.start(req)
    tokens = [e.token async for e in stream if isinstance(e, TokenEvent)]
    return tokens, stream.result


@pytest.mark.parametrize("write_through", [True, False], ids=["write-through", "spill-only"])
def test_pressure_shrinks_the_ram_tier_to_ssd_and_answers_stay_equal(
    demo_root, tmp_path, write_through
):
    # Spill-only is the case where eviction itself writes: the janitor must run it on the
    # MLX thread, or turning not-yet-computed arrays into bytes fails and the entry is lost.
    total = psutil.virtual_memory().total
    budget = 256 << 20
    engine = Engine(
        EngineSettings(
            cache_dir=fresh_cache_dir(demo_root, tmp_path / "c"),
            model_specs=[MODEL],
            ram_budget_bytes=budget,
            ram_min_available_bytes=2 * total,  # more than this machine has: always pressure
            memory_preflight=False,  # which would rightly refuse to load under that floor
            ram_pressure_min_budget_bytes=0,
            memory_check_s=0.05,
            ssd_write_through=write_through,
        )
    )
    loop = asyncio.Runner()
    try:
        for i in range(3):
            loop.run(_run(engine, _req(i)))
        held = engine.tiers.ram.stats().bytes
        assert held > 0

        async def janitor_for_a_while():
            task = asyncio.get_running_loop().create_task(engine.janitor())
            await asyncio.sleep(0.5)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

        loop.run(janitor_for_a_while())
        ram = engine.tiers.ram.stats()
        assert ram.budget_bytes == 0 and ram.bytes == 0, ram
        assert ram.spill_errors == 0, ram
        memory = engine.stats()["memory"]
        assert memory["active"] and memory["shrinks"] >= 1 and memory["freed_bytes"] >= held
        assert engine.tiers.ssd is not None
        assert engine.tiers.ssd.flush(30.0)
        assert engine.tiers.ssd.stats().entries > 0

        # Pressure over: the budget grows back, a quarter per check.
        for _ in range(4):
            engine.models.memory.check(available=4 * total)
        assert engine.tiers.ram.stats().budget_bytes == budget
        assert not engine.stats()["memory"]["active"]
        # Nothing was lost: what RAM let go comes back from SSD, and equals bypass.
        tokens, result = loop.run(_run(engine, _req(7)))
        assert result.cached_tokens > 0 and result.source == "ssd", result
        assert tokens == loop.run(_run(engine, _req(7, use_cache=False)))[0]
    finally:
        loop.run(engine.close())
        loop.close()


def test_a_shrink_evicts_to_ssd_when_the_tier_holds_more_than_the_shortfall(demo_root, tmp_path):
    engine = Engine(
        EngineSettings(
            cache_dir=fresh_cache_dir(demo_root, tmp_path / "c"),
            model_specs=[MODEL],
            ram_budget_bytes=256 << 20,
            ram_min_available_bytes=1 << 40,
            ram_pressure_min_budget_bytes=0,
            memory_preflight=False,  # the floor is beyond any machine: no load would fit
        )
    )
    loop = asyncio.Runner()
    try:
        for i in range(3):
            loop.run(_run(engine, _req(i)))
        before = engine.tiers.ram.stats()
        # Pretend available memory is just under the floor by half of what the tier holds.
        engine.settings.ram_min_available_bytes = floor = 1 << 30
        engine.models.memory.check(available=floor - before.bytes // 2)
        after = engine.tiers.ram.stats()
        assert after.budget_bytes == before.bytes - before.bytes // 2
        assert 0 < after.bytes <= after.budget_bytes
        assert after.evicted_bytes > before.evicted_bytes
    finally:
        loop.run(engine.close())
        loop.close()
