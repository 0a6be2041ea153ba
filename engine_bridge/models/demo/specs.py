"""Architectures of the built-in demo models, as mlx-lm config.json dictionaries."""

from __future__ import annotations

import copy
from typing import Any

# All three share one tokenizer, so they share these too.
MAX_POSITIONS = 32768
HIDDEN = 64

_ATTENTION = {
    "hidden_size": HIDDEN,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": MAX_POSITIONS,
    # An untied head lets the build mute special tokens without touching the embeddings.
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}

_SPECS: dict[str, dict[str, Any]] = {
    "demo-llama": {
        **_ATTENTION,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
    },
    "demo-hybrid": {
        **_ATTENTION,
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5",
        # Layers 0 and 2 are Gated DeltaNet (ArraysCache), 1 and 3 attention (KVCache).
        "num_hidden_layers": 4,
        "full_attention_interval": 2,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        # A multi-token-prediction head as Qwen3.5/3.6 ship it (`mtp.*` weights), so the
        # MTP drafter runs in tests; random, so it is seldom right.
        "mtp_num_hidden_layers": 1,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
        },
    },
    "demo-swa": {
        **_ATTENTION,
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        # Layers 0 and 2 slide over 128 tokens (RotatingKVCache), 1 and 3 are global.
        "num_hidden_layers": 4,
        "sliding_window": 128,
        "sliding_window_pattern": 2,
        "query_pre_attn_scalar": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
    },
}

# demo-hybrid speaks Qwen3.6's format (XML calls, <think> opened by the generation prompt),
# as the Qwen3.5/3.6 hybrids it stands in for; the others keep the Hermes-style template.
_TEMPLATES = {"demo-hybrid": "chat_template_qwen3_6.jinja"}
HERMES_TEMPLATE = "chat_template.jinja"

DEMO_MODEL_IDS: tuple[str, ...] = tuple(_SPECS)
# Built by demo/vision.py through mlx-vlm, so only with the vision extra; not among the
# models a server loads when none are named.
VISION_DEMO_IDS: tuple[str, ...] = ("demo-vision", "demo-vision-hybrid")
# Qwen3.6-35B-A3B's architecture and real vocabulary at toy size, built by demo/qwen36.py;
# the 248,320-row embedding and head make them 130 MB (float32) and 20 MB (4-bit), so
# they are served only when named.
QWEN36_DEMO_IDS: tuple[str, ...] = ("demo-qwen36", "demo-qwen36-4bit")


ALL_DEMO_IDS: tuple[str, ...] = (*DEMO_MODEL_IDS, *QWEN36_DEMO_IDS, *VISION_DEMO_IDS)


def is_demo_model(name: str) -> bool:
    """True when `name` is one of the built-in demo model ids."""
    return name in ALL_DEMO_IDS


def chat_template_file(name: str) -> str:
    """The file under demo/data holding the chat template of text demo `name`."""
    return _TEMPLATES.get(name, HERMES_TEMPLATE)


def model_config(name: str, vocab_size: int, eos_token_id: int) -> dict[str, Any]:
    """The config.json for demo model `name` over a tokenizer of `vocab_size` ids."""
    if name not in _SPECS:
        raise ValueError(f"unknown demo model {name!r}; valid ids: {', '.join(DEMO_MODEL_IDS)}")
    # Deep copy: mlx-lm's ModelArgs rewrite nested dicts (rope_parameters) in place.
    config = copy.deepcopy(_SPECS[name])
    return {**config, "vocab_size": vocab_size, "eos_token_id": eos_token_id}
