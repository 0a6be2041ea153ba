"""How much memory an idle unload gives back: a model with a few hundred MB of weights is
loaded, answers once, and is unloaded; the process's RSS and MLX's allocator are read at
each step.

    .venv/bin/python -m bench.scenarios.unload_memory [--hidden 768] [--layers 6]

The model is demo-llama widened (random weights, float32), so no download is needed.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import shutil
import sys
import tempfile
from pathlib import Path

import psutil

from engine_bridge.engine import Engine, EngineSettings
from engine_bridge.models.demo import ensure_demo_model
from engine_bridge.models.demo.weights import random_weights, save_weights
from engine_bridge.models.preflight import weights_bytes
from engine_bridge.ops.memory import mlx_memory
from engine_bridge.types import GenerationRequest, Message, Sampling

MB = 1 << 20


def build_wide_model(root: Path, hidden: int, layers: int) -> Path:
    """demo-llama's tokenizer and template with a wider, deeper body."""
    base = ensure_demo_model("demo-llama", root)
    out = root / "models" / f"wide-llama-{hidden}x{layers}"
    if out.exists():
        return out
    shutil.copytree(base, out)
    config = json.loads((out / "config.json").read_text())
    config.update(
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
        head_dim=64,
    )
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    # No token muted: what it generates does not matter here, only what it weighs.
    save_weights(random_weights(config, []), out / "model.safetensors")
    return out


def rss() -> int:
    return psutil.Process().memory_info().rss


async def measure(path: Path, cache_dir: Path) -> dict[str, int]:
    engine = Engine(EngineSettings(cache_dir=cache_dir, model_specs=[str(path)], ssd_enabled=False))
    model_id = engine.model_ids[0]
    figures = {"weights": weights_bytes(path)}
    gc.collect()
    figures["rss_before_load"] = rss()
    req = GenerationRequest(
        model=model_id,
        messages=[Message("user", "How much memory comes back? " * 20)],
        max_tokens=8,
        sampling=Sampling(temperature=0.0),
    )
    async for _ in await engine.start(req):
        pass
    figures["rss_loaded"] = rss()
    figures |= {f"{k}_loaded": v for k, v in mlx_memory().items() if k.startswith("mlx_")}
    assert await engine.models.unload_idle(0.0) == [model_id]
    gc.collect()
    figures["rss_after_unload"] = rss()
    figures |= {f"{k}_unloaded": v for k, v in mlx_memory().items() if k.startswith("mlx_")}
    await engine.close()
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        path = build_wide_model(root, args.hidden, args.layers)
        f = asyncio.run(measure(path, root))
    loaded = f["rss_loaded"] - f["rss_before_load"]
    back = f["rss_loaded"] - f["rss_after_unload"]
    print(f"weights on disk:          {f['weights'] / MB:8.1f} MB")
    print(f"RSS grew by on load:      {loaded / MB:8.1f} MB")
    print(
        f"RSS fell by on unload:    {back / MB:8.1f} MB ({back / max(1, loaded):.0%} of the growth)"
    )
    print(
        f"left above the start:     {(f['rss_after_unload'] - f['rss_before_load']) / MB:8.1f} MB"
    )
    print(
        f"MLX active {f['mlx_active_bytes_loaded'] / MB:.1f} -> "
        f"{f['mlx_active_bytes_unloaded'] / MB:.1f} MB, allocator cache "
        f"{f['mlx_cache_bytes_loaded'] / MB:.1f} -> {f['mlx_cache_bytes_unloaded'] / MB:.1f} MB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
