"""Tiny random-weight mlx-lm models, one per cache kind, and how the kv tests feed them.

Import `models_fixture` and `tokens_fixture` to use them as the `models` and `tokens`
fixtures (built once per test module).
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import falcon_h1, gemma3_text, llama, qwen3_5
from mlx_lm.models.cache import ArraysCache, CacheList, make_prompt_cache

BS = 16
N = 80
WINDOW = 32


def _build(module, **args):
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(args))
    mx.eval(model.parameters())
    return model


def _llama(dtype=mx.float32):
    model = _build(
        llama,
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        rms_norm_eps=1e-5,
        vocab_size=256,
    )
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


@pytest.fixture(name="models", scope="module")
def models_fixture() -> dict[str, object]:
    """Tiny models, one per cache kind; head dim 32 so 8-bit KV quantization (group 32) fits."""
    return {
        "llama": _llama(),
        "llama-bf16": _llama(mx.bfloat16),
        "llama-f16": _llama(mx.float16),
        # Gated DeltaNet (ArraysCache) then full attention (KVCache).
        "hybrid": _build(
            qwen3_5,
            model_type="qwen3_5",
            hidden_size=64,
            num_hidden_layers=2,
            intermediate_size=128,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            vocab_size=256,
            linear_num_value_heads=2,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            full_attention_interval=2,
        ),
        # Sliding window (RotatingKVCache) then global attention (KVCache).
        "swa": _build(
            gemma3_text,
            model_type="gemma3_text",
            hidden_size=64,
            num_hidden_layers=2,
            intermediate_size=128,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            query_pre_attn_scalar=32,
            vocab_size=256,
            sliding_window=WINDOW,
            sliding_window_pattern=2,
        ),
        # Every layer is CacheList(ArraysCache (Mamba2), KVCache).
        "cachelist": _build(
            falcon_h1,
            model_type="falcon_h1",
            hidden_size=64,
            num_hidden_layers=2,
            intermediate_size=128,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            vocab_size=256,
            mamba_d_ssm=64,
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_d_state=16,
            mamba_chunk_size=16,
            mamba_expand=1,
        ),
    }


@pytest.fixture(name="tokens", scope="module")
def tokens_fixture() -> mx.array:
    mx.random.seed(1)
    return mx.random.randint(0, 256, (N,))


def quantized_cache(model) -> list:
    return [c.to_quantized(group_size=32, bits=8) for c in make_prompt_cache(model)]


def feed(model, cache: list, toks: mx.array, step: int | None = None) -> mx.array:
    """Logits for every token in `toks`, fed `step` at a time (None: one call)."""
    step = step or toks.size
    out = []
    for s in range(0, toks.size, step):
        logits = model(toks[None, s : s + step], cache=cache)
        mx.eval(logits, [a for c in cache for a in state_arrays(c)])
        out.append(logits)
    return mx.concatenate(out, axis=1)


def state_arrays(c) -> list[mx.array]:
    if isinstance(c, CacheList):
        return [a for sub in c.caches for a in state_arrays(sub)]
    if isinstance(c, ArraysCache):
        return [a for a in c.cache if a is not None]
    keys = c.keys if isinstance(c.keys, tuple) else (c.keys,)
    values = c.values if isinstance(c.values, tuple) else (c.values,)
    return [a for a in (*keys, *values) if a is not None]
