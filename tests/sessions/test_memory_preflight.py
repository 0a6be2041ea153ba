"""The memory preflight before every load, on a simulated machine.

The engine, the demo models and the HTTP app are real; only what the preflight reads is
simulated: the machine's RAM, and how large each model's weights are (a 20 GB model on a
32 GB Mac). The simulated free memory falls by a model's weights while it is loaded, so an
unload gives room back as it would.
"""

from __future__ import annotations

import asyncio
import logging

import anthropic
import openai
import pytest

from engine_bridge.engine import Engine, EngineSettings
from engine_bridge.models.loading import ModelRef
from engine_bridge.models.preflight import Machine, RamReading, Usage, plan
from engine_bridge.types import EngineError, GenerationRequest, Message, Sampling
from proxy.app import create_app
from proxy.config.model import UpstreamConfig
from proxy.state import ProxySettings
from tests.conftest import fresh_cache_dir

GB = 1 << 30
USER = [{"role": "user", "content": "hi"}]


class SimulatedMachine(Machine):
    """`total` bytes of RAM, `others` of it used by the system and other apps, and the
    weights of each model the engine has loaded."""

    def __init__(self, engine: Engine, total: int, others: int, sizes: dict[str, int]):
        self.engine = engine
        self.total = total
        self.others = others
        self.sizes = sizes
        self.readings: list[RamReading] = []

    def ram(self) -> RamReading:
        loaded = sum(s for m, s in self.sizes.items() if self.engine.models.loaded(m) is not None)
        reading = RamReading(self.total, self.total - self.others - loaded)
        self.readings.append(reading)
        return reading

    def weights(self, ref: ModelRef) -> int:
        return self.sizes[ref.id]


def defaults(total: int) -> Usage:
    """Nothing set: both budgets derived, 5% of RAM kept free."""
    return Usage(0, 0, kv_fixed=None, ram_fixed=None, ram_share=0.2, headroom=total // 20)


def test_a_20_gb_model_fits_a_32_gb_mac_with_the_defaults():
    total = 32 * GB
    reading = RamReading(total, 26 * GB)  # macOS and a few apps use 6 GB
    p = plan("qwen3.6-35b-a3b", 20 * GB, reading, defaults(total))
    assert p.fits, p.figures()
    # The caches share what the weights leave: 26 - 1.6 kept free - 20 = 4.4 GB.
    assert p.ram_budget == int(0.2 * (26 * GB - total // 20 - 20 * GB))
    assert p.kv_budget >= 512 << 20
    assert p.need <= 26 * GB - total // 20
    # The same shares taken of all the memory free at start, as before the preflight
    # (20% for the RAM tier, half the rest for K/V), would not fit beside the weights.
    before = Usage(0, 0, kv_fixed=int(26 * GB * 0.3), ram_fixed=int(26 * GB * 0.2),
                   ram_share=0.2, headroom=total // 20)  # fmt: skip
    assert not plan("qwen3.6-35b-a3b", 20 * GB, reading, before).fits


def test_what_the_caches_hold_now_counts_as_room_for_their_budgets():
    total = 32 * GB
    held = Usage(2 * GB, 3 * GB, kv_fixed=4 * GB, ram_fixed=4 * GB, ram_share=0.2, headroom=0)
    p = plan("m", 10 * GB, RamReading(total, 12 * GB), held)
    # 10 GB of weights + 2 GB more K/V + 1 GB more RAM tier.
    assert p.need == 13 * GB and not p.fits
    assert plan("m", 9 * GB, RamReading(total, 12 * GB), held).fits


def _engine(demo_root, tmp_path, **settings) -> Engine:
    return Engine(
        EngineSettings(
            cache_dir=fresh_cache_dir(demo_root, tmp_path / "cache"),
            model_specs=["demo-llama", "demo-hybrid"],
            ssd_enabled=False,
            ram_budget_share=0.2,
            **settings,
        )
    )


async def _generate(engine: Engine, model: str) -> str:
    req = GenerationRequest(
        model=model,
        messages=[Message("user", "hello there")],
        max_tokens=4,
        sampling=Sampling(temperature=0.0),
    )
    text = ""
    async for event in await engine.start(req):
        text += getattr(event, "text", "") or ""
    return text


def test_the_defaults_are_derived_after_the_weights(demo_root, tmp_path):
    async def scenario():
        engine = _engine(demo_root, tmp_path)
        machine = SimulatedMachine(engine, 32 * GB, 6 * GB, {"demo-llama": 20 * GB})
        engine.models.preflight.machine = machine
        try:
            await _generate(engine, "demo-llama")
            return engine.stats()["memory"], engine.tiers.ram.budget_bytes
        finally:
            await engine.close()

    memory, ram_budget = asyncio.run(scenario())
    left = 26 * GB - 32 * GB // 20 - 20 * GB  # what the weights leave, less 5% kept free
    assert ram_budget == int(left * 0.2)
    assert memory["kv_budget_bytes"] == left // 2 - ram_budget
    assert memory["last_load_weights_bytes"] == 20 * GB
    assert memory["last_load_need_bytes"] <= 26 * GB - 32 * GB // 20


def test_an_idle_model_is_unloaded_to_make_room(demo_root, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="engine_bridge.served")

    async def scenario():
        engine = _engine(demo_root, tmp_path)
        sizes = {"demo-llama": 20 * GB, "demo-hybrid": 12 * GB}
        engine.models.preflight.machine = SimulatedMachine(engine, 32 * GB, 6 * GB, sizes)
        try:
            await _generate(engine, "demo-llama")
            assert engine.models.loaded("demo-llama") is not None
            # 6 GB free with demo-llama in; demo-hybrid needs 12 GB and more.
            await _generate(engine, "demo-hybrid")
            return engine.models.loaded("demo-llama"), engine.models.loaded("demo-hybrid")
        finally:
            await engine.close()

    llama, hybrid = asyncio.run(scenario())
    assert llama is None and hybrid is not None
    assert "unloaded demo-llama" in caplog.text
    assert "loading demo-hybrid: 12.0 GB of weights" in caplog.text


def test_a_load_that_does_not_fit_is_refused_naming_the_figures_and_the_setting(
    demo_root, tmp_path, caplog
):
    async def scenario():
        engine = _engine(demo_root, tmp_path, kv_memory_bytes=16 * GB)
        engine.models.preflight.machine = SimulatedMachine(
            engine, 32 * GB, 6 * GB, {"demo-llama": 20 * GB}
        )
        try:
            with pytest.raises(EngineError) as refused:
                await _generate(engine, "demo-llama")
            return refused.value, engine.models.loaded("demo-llama")
        finally:
            await engine.close()

    e, loaded = asyncio.run(scenario())
    assert loaded is None  # nothing was loaded: no swap
    assert e.status == 503 and e.field == "model"
    assert "[engine] kv_memory" in e.message
    assert "20.0 GB of weights + 16.0 GB K/V budget" in e.message
    assert "26.0 GB of 32.0 GB RAM available" in e.message
    assert "not enough memory to load demo-llama" in caplog.text  # a WARNING too


def test_weights_larger_than_the_machine_are_refused(demo_root, tmp_path):
    async def scenario():
        engine = _engine(demo_root, tmp_path)
        engine.models.preflight.machine = SimulatedMachine(
            engine, 32 * GB, 6 * GB, {"demo-llama": 40 * GB}
        )
        try:
            with pytest.raises(EngineError) as refused:
                await _generate(engine, "demo-llama")
            return refused.value
        finally:
            await engine.close()

    e = asyncio.run(scenario())
    assert e.status == 503 and "more than this machine's RAM" in e.message


async def test_the_refusal_is_a_503_in_each_dialect(aiohttp_client, demo_root, tmp_path):
    engine = _engine(demo_root, tmp_path, kv_memory_bytes=16 * GB)
    engine.models.preflight.machine = SimulatedMachine(
        engine, 32 * GB, 6 * GB, {"demo-llama": 20 * GB}
    )
    client = await aiohttp_client(
        create_app(engine, ProxySettings(), UpstreamConfig(enabled=False))
    )
    url = str(client.make_url("")).rstrip("/")
    oa = openai.AsyncOpenAI(base_url=url + "/v1", api_key="t", max_retries=0)
    with pytest.raises(openai.APIStatusError) as refused:
        await oa.chat.completions.create(model="demo-llama", messages=USER, max_tokens=4)
    assert refused.value.status_code == 503
    error = refused.value.body
    assert error["param"] == "model" and error["type"] == "server_error"
    assert "[engine] kv_memory" in error["message"]
    an = anthropic.AsyncAnthropic(base_url=url, api_key="t", max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as refused:
        await an.messages.create(model="demo-llama", messages=USER, max_tokens=4)
    assert refused.value.status_code == 503
    assert refused.value.body["error"]["type"] == "overloaded_error"
    assert "16.0 GB K/V budget" in refused.value.body["error"]["message"]
    assert engine.models.loaded("demo-llama") is None
