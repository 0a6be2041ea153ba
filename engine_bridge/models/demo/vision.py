"""demo-vision: a tiny Qwen2-VL (vision tower + Qwen2 text model) that mlx-vlm loads.

It shares the other demos' tokenizer, with Qwen-VL's four vision tokens appended after
the trained ids, and their chat template, taught to render an image part as Qwen-VL
does. Weights are random and deterministic; the preprocessor config is written here, so
the build needs no network. mlx-lm loads the same directory text-only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from . import tokenizer

NAME = "demo-vision"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
# Patches are 14 px and merged 2x2, so each image token covers 28x28 pixels; at most 64
# tokens per image keeps a screenshot cheap to encode on a CPU while still several blocks.
PATCH = 14
MERGE = 2

_TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
    # head_dim 16: eight rotary frequencies split over (time, height, width).
    "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
    "torch_dtype": "float32",
}
_VISION = {
    "model_type": "qwen2_vl",
    "depth": 2,
    "embed_dim": 32,
    "hidden_size": 64,
    "num_heads": 2,
    "mlp_ratio": 2,
    "in_channels": 3,
    "patch_size": PATCH,
    "spatial_patch_size": PATCH,
    "spatial_merge_size": MERGE,
    "temporal_patch_size": 2,
}
_IMAGE_LINE = (
    "{%- elif part.type is defined and part.type == 'text' -%}\n                {{- part.text -}}\n"
)
_IMAGE_BRANCH = (
    "{%- elif part.type is defined and part.type == 'image' -%}\n"
    "                {{- '" + VISION_START + IMAGE_PAD + VISION_END + "' -}}\n"
)


def chat_template() -> str:
    """The demos' template, with an image part rendered as Qwen-VL renders it."""
    base = tokenizer.chat_template()
    assert _IMAGE_LINE in base, "demo chat template no longer has the text-part branch"
    return base.replace(_IMAGE_LINE, _IMAGE_LINE + "            " + _IMAGE_BRANCH, 1)


def model_config(vocab_size: int, eos_token_id: int, token_ids: dict[str, int]) -> dict[str, Any]:
    return {
        **_TEXT,
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "vision_config": dict(_VISION),
        "image_token_id": token_ids[IMAGE_PAD],
        "video_token_id": token_ids[VIDEO_PAD],
        "vision_start_token_id": token_ids[VISION_START],
        "vision_end_token_id": token_ids[VISION_END],
        "vocab_size": vocab_size,
        "eos_token_id": eos_token_id,
        # Qwen2-VL's default BOS id is outside this vocabulary; the template uses none.
        "bos_token_id": None,
    }


def recipe_inputs() -> bytes:
    """Everything besides the shared corpus that a build depends on, for its digest."""
    return recipe_of(model_config, _preprocessor_json())


def write_model_files(out: Path) -> None:
    """Write config, weights, tokenizer and preprocessor config of demo-vision into `out`."""
    write_files(out, model_config, random_weights, _preprocessor_json())


def recipe_of(make_config: Callable[..., dict[str, Any]], preprocessor: str) -> bytes:
    """A vision demo's recipe bytes: its config over the shared tokenizer plus the vision
    tokens, the chat template and its preprocessor config (demo-vision-hybrid uses it too)."""
    ids = {t: tokenizer.VOCAB_SIZE + i for i, t in enumerate(VISION_TOKENS)}
    config = make_config(tokenizer.VOCAB_SIZE + len(VISION_TOKENS), 0, ids)
    return (json.dumps(config, sort_keys=True) + chat_template() + preprocessor).encode()


def write_files(
    out: Path,
    make_config: Callable[..., dict[str, Any]],
    make_weights: Callable[[dict[str, Any], list[int]], dict[str, np.ndarray]],
    preprocessor: str,
) -> None:
    """Write a vision demo into `out`: the shared tokenizer with the vision tokens added,
    `make_config`'s config, `make_weights`' random weights and the preprocessor config."""
    from tokenizers import AddedToken

    tok = tokenizer.train_tokenizer()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    ids = {t: tok.token_to_id(t) for t in VISION_TOKENS}
    eos_id = tok.token_to_id(tokenizer.EOS_TOKEN)
    config = make_config(tok.get_vocab_size(with_added_tokens=True), eos_id, ids)
    muted = sorted(tok.token_to_id(t) for t in tokenizer.SPECIAL_TOKENS + VISION_TOKENS)
    _save(make_weights(config, muted), out / "model.safetensors")
    tokenizer.write_tokenizer_files(tok, out)
    _patch_tokenizer_config(out / "tokenizer_config.json", ids)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "preprocessor_config.json").write_text(preprocessor)


def _patch_tokenizer_config(path: Path, ids: dict[str, int]) -> None:
    config = json.loads(path.read_text(encoding="utf-8"))
    for token, token_id in ids.items():
        config["added_tokens_decoder"][str(token_id)] = {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
    config["chat_template"] = chat_template()
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _preprocessor_json() -> str:
    return preprocessor_json(
        PATCH, [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
    )


def preprocessor_json(patch: int, mean: list[float], std: list[float]) -> str:
    """A Qwen2-VL image processor config: `patch`-pixel patches merged 2×2, 4 to 64 merged
    tokens per image, normalized by `mean` and `std` (demo-vision-hybrid uses it too)."""
    merged = (patch * MERGE) ** 2
    config = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
        "patch_size": patch,
        "temporal_patch_size": 2,
        "merge_size": MERGE,
        "min_pixels": merged * 4,
        "max_pixels": merged * 64,
        "image_mean": mean,
        "image_std": std,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
    }
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


def random_weights(config: dict[str, Any], muted_token_ids: list[int]) -> dict[str, np.ndarray]:
    """Every parameter of mlx-vlm's Qwen2-VL for `config`, seeded per name, as float32."""
    from mlx_vlm.models import qwen2_vl

    # As mlx-vlm's loader does: the top config, then each tower's own config class.
    args = qwen2_vl.ModelConfig.from_dict(json.loads(json.dumps(config)))
    args.text_config = qwen2_vl.TextConfig.from_dict(args.text_config)
    args.vision_config = qwen2_vl.VisionConfig.from_dict(config["vision_config"])
    return random_params(qwen2_vl.Model(args), muted_token_ids)


def random_params(model: Any, muted_token_ids: list[int]) -> dict[str, np.ndarray]:
    """Every parameter of an mlx-vlm model, drawn from its name's own key, as float32."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from .weights import BRANCH_GAIN, _key

    params = {}
    for name, value in tree_flatten(model.parameters()):
        key = _key(name)
        if value.ndim == 1:
            # Norm scales stay as constructed; biases (random in mlx) become small draws
            # from this name's own key, so the file does not depend on the global RNG.
            new = (
                value if name.endswith(".weight") else mx.random.normal(value.shape, key=key) * 0.02
            )
        elif name.endswith("embed_tokens.weight"):
            new = mx.random.normal(value.shape, key=key)
        else:
            fan_in = math.prod(value.shape[1:])
            gain = 1.0 if name.endswith("lm_head.weight") else BRANCH_GAIN
            new = mx.random.normal(value.shape, key=key) * (gain / math.sqrt(fan_in))
            if name.endswith("lm_head.weight"):
                # As in the text demos: special tokens never win a greedy step.
                rows = mx.zeros((value.shape[0], 1)).at[mx.array(muted_token_ids)].add(1.0)
                new = new * (1.0 - rows)
        new = new.astype(mx.float32)
        mx.eval(new)
        params[name] = np.array(new)
    return params


def _save(params: dict[str, np.ndarray], path: Path) -> None:
    from safetensors.numpy import save_file

    save_file(params, str(path), metadata={"format": "mlx"})
