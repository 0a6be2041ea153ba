"""Optional 8/4-bit KV quantization of stored blocks: smaller entries that still hit."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from engine_bridge.engine import Engine, EngineSettings
from engine_bridge.prompt_cache import CachePolicy
from engine_bridge.types import GenerationRequest, GenerationResult, Message, Sampling

SYSTEM = "You are a patient assistant who explains storage and caching. " * 30


@pytest.fixture(scope="module")
def wide_llama(demo_root, tmp_path_factory):
    """demo-llama with head_dim 32: mx.quantize groups need at least 32 values per row."""
    from engine_bridge.models.demo.weights import random_weights, save_weights

    src = demo_root / "models" / "demo-llama"
    out = tmp_path_factory.mktemp("wide") / "wide-llama"
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors", "demo_build.json"))
    config = json.loads((src / "config.json").read_text())
    config.update(hidden_size=128, head_dim=32, intermediate_size=256)
    (out / "config.json").write_text(json.dumps(config))
    save_weights(random_weights(config, []), out / "model.safetensors")
    return out


async def _ask(engine: Engine, question: str) -> GenerationResult:
    req = GenerationRequest(
        model="wide-llama",
        messages=[Message("system", SYSTEM), Message("user", question)],
        max_tokens=4,
        sampling=Sampling(temperature=0.0),
    )
    stream = await engine.start(req)
    async for _ in stream:
        pass
    return stream.result


def _run(model_dir, bits: int) -> tuple[GenerationResult, int, int]:
    async def scenario():
        engine = Engine(
            EngineSettings(
                cache_dir=model_dir.parent,
                model_specs=[str(model_dir)],
                ssd_enabled=False,
                cache_policy=CachePolicy(quantize_bits=bits),
            )
        )
        try:
            await _ask(engine, "What is a block?")
            second = await _ask(engine, "What is a checkpoint?")
            ram = engine.tiers.ram.stats()
            return second, ram.block_bytes, ram.blocks
        finally:
            await engine.close()

    return asyncio.run(scenario())


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_blocks_are_smaller_and_still_hit(wide_llama, bits):
    dense, dense_bytes, dense_blocks = _run(wide_llama, 0)
    quant, quant_bytes, quant_blocks = _run(wide_llama, bits)
    assert quant_blocks == dense_blocks > 0
    assert quant.cached_tokens == dense.cached_tokens > 0
    # f32 K/V → `bits`-bit values plus per-group scales and biases.
    assert quant_bytes < dense_bytes * (bits / 32 + 0.2)
