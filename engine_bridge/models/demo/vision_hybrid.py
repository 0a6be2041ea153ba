"""demo-vision-hybrid: a tiny Qwen3.5 vision-language model (the hybrid layout) for mlx-vlm.

The text model alternates Gated DeltaNet layers (recurrent state: the cache restores at
checkpoints only) with gated full-attention layers using interleaved multimodal RoPE; the
vision tower is Qwen3-VL's. Tokenizer, chat template and weight recipe are demo-vision's;
the preprocessor config (16 px patches merged 2x2) is written here, with no network.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from .vision import (
    IMAGE_PAD,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    preprocessor_json,
    random_params,
    recipe_of,
    write_files,
)

NAME = "demo-vision-hybrid"
PATCH = 16
MERGE = 2

_TEXT = {
    "model_type": "qwen3_5_text",
    "hidden_size": 64,
    "intermediate_size": 128,
    # Layers 0 and 2 are Gated DeltaNet, 1 and 3 full attention.
    "num_hidden_layers": 4,
    "full_attention_interval": 2,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
    # Half of each head rotates: eight dims, four frequencies over (time, height, width).
    "rope_parameters": {
        "type": "default",
        "mrope_section": [2, 1, 1],
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
    },
}
_VISION = {
    "model_type": "qwen3_5",
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "out_hidden_size": 64,
    "num_heads": 2,
    "in_channels": 3,
    "patch_size": PATCH,
    "spatial_patch_size": PATCH,
    "spatial_merge_size": MERGE,
    "temporal_patch_size": 2,
    # An 8x8 table of learned positions, interpolated to each image's patch grid.
    "num_position_embeddings": 64,
    "deepstack_visual_indexes": [],
}


def model_config(vocab_size: int, eos_token_id: int, token_ids: dict[str, int]) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": {**_TEXT, "vocab_size": vocab_size, "eos_token_id": eos_token_id},
        "vision_config": dict(_VISION),
        "image_token_id": token_ids[IMAGE_PAD],
        "video_token_id": token_ids[VIDEO_PAD],
        "vision_start_token_id": token_ids[VISION_START],
        "vision_end_token_id": token_ids[VISION_END],
        "vocab_size": vocab_size,
        "eos_token_id": eos_token_id,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def recipe_inputs() -> bytes:
    """Everything besides the shared corpus that a build depends on, for its digest."""
    return recipe_of(model_config, _preprocessor_json())


def write_model_files(out: Path) -> None:
    """Write config, weights, tokenizer and preprocessor config into `out`."""
    write_files(out, model_config, random_weights, _preprocessor_json())


def random_weights(config: dict[str, Any], muted_token_ids: list[int]) -> dict[str, np.ndarray]:
    """Every parameter of mlx-vlm's Qwen3.5 for `config`, seeded per name, as float32."""
    from mlx_vlm.models import qwen3_5

    args = qwen3_5.ModelConfig.from_dict(json.loads(json.dumps(config)))
    return random_params(qwen3_5.Model(args), muted_token_ids)


def _preprocessor_json() -> str:
    return preprocessor_json(PATCH, [0.5, 0.5, 0.5], [0.5, 0.5, 0.5])
