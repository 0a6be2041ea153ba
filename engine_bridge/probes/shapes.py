"""The benchmark's in-process measurements, the only part of it that needs mlx.

Run as `python -m engine_bridge.probes.shapes COMMAND ... --json-out FILE` by the bench package,
so the benchmark's own process never holds a model or mlx's threads while it times servers:
- `demo NAME ROOT`: build a demo model, report its directory;
- `shape NAME ROOT`: build a random-weight model with a real model's configuration;
- `overhead MODEL PROMPTS`: bare mlx-lm TTFT on the same prompts, hashing and lookup time,
  and what rendering a 201-message agent session costs (render_probe);
- `kv-bytes MODEL TOKENS...`: bytes of one uncached copy of a prompt's cache state.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SHAPE_SEED = 20250101

# Real models' configurations (from their config.json), text part only. `bits` is the
# quantization the shape is saved with: what people run locally, and what fits a disk.
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        "bits": 4,
        "config": {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
        },
    },
    "qwen3.6-35b-a3b": {
        "bits": 4,
        "config": {
            # mlx-lm 0.32.2's qwen3_5_moe reads a flat config as its text_config.
            "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "model_type": "qwen3_5_moe",
            "hidden_size": 2048,
            "num_hidden_layers": 40,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "full_attention_interval": 4,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "num_experts": 256,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512,
            "norm_topk_prob": True,
            "max_position_embeddings": 262144,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000000.0,
                "partial_rotary_factor": 0.25,
                "mrope_section": [11, 11, 10],
                "mrope_interleaved": True,
            },
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
        },
    },
    "qwen3-0.6b": {
        "bits": None,
        "config": {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": True,
            "torch_dtype": "bfloat16",
        },
    },
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def build_shape(
    name: str, root: Path, overrides: dict[str, Any] | None = None, bits: int | None = -1
) -> Path:
    """Build `root/models/shape-NAME` once: random bf16 weights, the demo tokenizer.

    The vocabulary is cut to the demo tokenizer's ids (a random model could otherwise emit
    ids no tokenizer can decode); prefill never evaluates the head, so TTFT barely moves.
    """
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.utils import quantize_model, save_config, save_model

    from ..models.demo import ensure_demo_model
    from ..models.demo.weights import build_model

    if name not in SHAPES:
        raise SystemExit(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    spec = SHAPES[name]
    bits = spec["bits"] if bits == -1 else bits
    suffix = "" if not overrides else "-small"
    out = root / "models" / f"shape-{name}{suffix}"
    if (out / "config.json").is_file():
        return out
    demo = ensure_demo_model("demo-llama", root)
    demo_config = json.loads((demo / "config.json").read_text())
    config = copy.deepcopy(spec["config"]) | (overrides or {})
    config |= {"vocab_size": demo_config["vocab_size"], "eos_token_id": demo_config["eos_token_id"]}
    mx.random.seed(SHAPE_SEED)
    model = build_model(config)
    model.set_dtype(mx.bfloat16)
    # Gated DeltaNet decay rates must stay finite and in float32, as mlx-lm keeps them.
    fixes = [
        (k, mx.log(mx.random.uniform(1.0, 16.0, v.shape)).astype(mx.float32))
        for k, v in tree_flatten(model.parameters())
        if k.endswith("A_log")
    ]
    if fixes:
        model.load_weights(fixes, strict=False)
    if bits:
        model, config = quantize_model(model, config, group_size=64, bits=bits)
    # Evaluate layer by layer: all of a 35B model's float32 init at once would not fit.
    for _, module in model.named_modules():
        if isinstance(module, nn.Module) and not module.children():
            mx.eval(module.parameters())
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(tmp, model)
    save_config(config, tmp / "config.json")
    for f in _TOKENIZER_FILES:
        shutil.copy(demo / f, tmp / f)
    tmp.rename(out)
    return out


@dataclass(slots=True)
class BareTTFT:
    prompt_tokens: int
    ttft_s: list[float]

    @property
    def median_s(self) -> float:
        return statistics.median(self.ttft_s)


def bare_ttft(model_dir: Path, prompts: list[list[dict]], repeats: int) -> list[BareTTFT]:
    """Seconds to the first token of mlx_lm.stream_generate on a fresh cache, per prompt."""
    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_sampler

    from ..prompting.render import render_chat
    from ..types import Message

    model, tokenizer = load(str(model_dir))
    greedy = make_sampler(temp=0.0)
    rendered = [
        render_chat(tokenizer, [Message.from_template(m) for m in p]).tokens for p in prompts
    ]
    # One untimed run: the first call pays for kernel compilation and allocation.
    for _ in stream_generate(model, tokenizer, rendered[0][:64], max_tokens=1, sampler=greedy):
        pass
    out = []
    for tokens in rendered:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in stream_generate(model, tokenizer, tokens, max_tokens=1, sampler=greedy):
                times.append(time.perf_counter() - start)
                break
        out.append(BareTTFT(len(tokens), times))
    return out


def kv_bytes(model_dir: Path, token_counts: list[int]) -> dict[str, Any]:
    """Bytes of one copy of the cache state after prefilling N tokens, for each N.

    `bytes` counts what holds tokens; `held_bytes` what mlx-lm has allocated for them.
    """
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(str(model_dir))
    out: dict[str, Any] = {"tokens": [], "bytes": [], "held_bytes": [], "cache_types": []}
    for n in token_counts:
        cache = make_prompt_cache(model)
        # The ids do not change the state's size; any below 256 exist in every vocabulary.
        ids = mx.array([[(i * 7919) % 256 for i in range(n)]])
        for start in range(0, n, 512):
            model(ids[:, start : start + 512], cache=cache)
            mx.eval([c.state for c in cache])
        out["tokens"].append(n)
        out["held_bytes"].append(int(sum(c.nbytes for c in cache)))
        out["bytes"].append(int(sum(_used_bytes(c, mx) for c in cache)))
        out["cache_types"] = sorted({type(c).__name__ for c in cache})
    return out


def _used_bytes(cache: Any, mx: Any) -> int:
    """Bytes of a cache's state that hold tokens: a KVCache allocates in steps of 256."""
    keys = getattr(cache, "keys", None)
    offset = getattr(cache, "offset", None)
    if isinstance(keys, mx.array) and isinstance(offset, int) and 0 < offset < keys.shape[-2]:
        return cache.nbytes * offset // keys.shape[-2]
    return cache.nbytes


def float32_gather_mm_on_cpu() -> None:
    """MLX's CPU gather_mm (the MoE experts' matmul) takes only float32: run it there in
    float32 and cast back, so activations, and so the cached keys, values and states, stay
    bfloat16 as on a Mac."""
    import mlx.core as mx

    if mx.default_device() != mx.cpu:
        return
    gather_mm = mx.gather_mm

    def f32(a, b, *args, **kw):
        return gather_mm(a.astype(mx.float32), b.astype(mx.float32), *args, **kw).astype(a.dtype)

    mx.gather_mm = f32


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine_bridge.probes.shapes")
    p.add_argument("--json-out", type=Path, required=True)
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo")
    d.add_argument("name")
    d.add_argument("root", type=Path)
    s = sub.add_parser("shape")
    s.add_argument("name")
    s.add_argument("root", type=Path)
    s.add_argument("--bits", type=int, default=-1, help="0 for bf16; default per shape")
    s.add_argument("--overrides", type=json.loads, default=None, help="JSON config overrides")
    o = sub.add_parser("overhead")
    o.add_argument("model", type=Path)
    o.add_argument("prompts", type=Path, help="JSON list of message lists")
    o.add_argument("--repeats", type=int, default=3)
    o.add_argument("--lookup-tokens", type=int, default=32_768)
    k = sub.add_parser("kv-bytes")
    k.add_argument("model", type=Path)
    k.add_argument("tokens", type=int, nargs="+")
    f = sub.add_parser("families", help="family models on real chat templates")
    f.add_argument("root", type=Path)
    f.add_argument("templates", nargs="+", help="template file names (real_templates.py)")
    args = p.parse_args(argv)

    result: dict[str, Any]
    if args.command == "demo":
        from ..models.demo import ensure_demo_model

        result = {"path": str(ensure_demo_model(args.name, args.root))}
    elif args.command == "shape":
        start = time.perf_counter()
        path = build_shape(args.name, args.root, args.overrides, args.bits or None)
        result = {"path": str(path), "build_s": time.perf_counter() - start}
    elif args.command == "overhead":
        from mlx_lm.utils import load_tokenizer

        from . import lookup as lookup_probe
        from . import render as render_probe

        prompts = json.loads(args.prompts.read_text())
        bare = bare_ttft(args.model, prompts, args.repeats)
        result = {
            "bare": [asdict(b) | {"median_s": b.median_s} for b in bare],
            "lookup": lookup_probe.lookup_costs(args.lookup_tokens),
            "render": render_probe.render_costs(load_tokenizer(args.model)),
        }
    elif args.command == "families":
        from . import agent_models

        result = {"models": agent_models.write_models(args.root, tuple(args.templates))}
    else:
        result = kv_bytes(args.model, args.tokens)
    args.json_out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
