"""Deterministic random weights for a demo model, saved as MLX safetensors."""

from __future__ import annotations

import copy
import hashlib
import importlib
import math
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from safetensors.numpy import save_file

SEED = 20240611
# Residual branches a little louder than their fan-in scale, so attention and MLP move
# the residual stream enough that greedy decoding depends on context, not just the last
# token (otherwise a random model falls into a one-token loop).
BRANCH_GAIN = 2.0
# Read out, not added to the residual: the head's logits, a MoE router's (softmax over the
# experts) and its shared expert's gate (a sigmoid) stay at unit scale, so routing varies
# with context instead of saturating on one expert.
_UNIT_GAIN = ("lm_head.weight", "mlp.gate.weight", "shared_expert_gate.weight")


def build_model(config: dict[str, Any]):
    """Instantiate the mlx-lm Model class that `config["model_type"]` names."""
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    # ModelArgs may edit nested dicts in place; keep the caller's config as written.
    return arch.Model(arch.ModelArgs.from_dict(copy.deepcopy(config)))


def _key(name: str) -> mx.array:
    # One key per parameter name, so values never depend on the global RNG, on the
    # order parameters are visited, or on anything else the process drew before.
    digest = hashlib.sha256(f"{SEED}/{name}".encode()).digest()
    return mx.random.key(int.from_bytes(digest[:4], "little"))


def _init(name: str, value: mx.array, muted_rows: list[int]) -> mx.array:
    key = _key(name)
    if name.endswith("A_log"):
        # Gated DeltaNet decay rates: mlx-lm draws from (0, 16); start at 1 so log is finite.
        return mx.log(mx.random.uniform(1.0, 16.0, value.shape, key=key))
    if value.ndim == 1:
        # Norm scales and dt_bias: constructed as constants, kept as they are.
        assert mx.all(value == value[0]).item(), f"{name} is not constant at construction"
        return value
    if name.endswith("embed_tokens.weight"):
        return mx.random.normal(value.shape, key=key)
    # Stacked experts are [experts, out, in]: each expert's fan-in is its own in-dim.
    fan_in = value.shape[-1] if ".switch_mlp." in name else math.prod(value.shape[1:])
    gain = 1.0 if name.endswith(_UNIT_GAIN) else BRANCH_GAIN
    weight = mx.random.normal(value.shape, key=key) * (gain / math.sqrt(fan_in))
    if name.endswith("lm_head.weight") and muted_rows:
        # Zero logits for control/markup tokens: a random model that emitted EOS or
        # <|im_start|> at random would make generation length arbitrary in tests.
        rows = mx.zeros((value.shape[0], 1)).at[mx.array(muted_rows)].add(1.0)
        weight = weight * (1.0 - rows)
    return weight


def random_weights(config: dict[str, Any], muted_token_ids: list[int]) -> dict[str, np.ndarray]:
    """All parameters of the model `config` describes, as float32 numpy arrays."""
    named = tree_flatten(build_model(config).parameters())
    head = _mtp_head(config)
    if head is not None:
        # Under the checkpoint's own names, beside the model's (mlx-lm drops them on load).
        named += [(f"mtp.{name}", value) for name, value in tree_flatten(head.parameters())]
    params = {}
    for name, value in named:
        new = _init(name, value, muted_token_ids).astype(mx.float32)
        mx.eval(new)
        params[name] = np.array(new)
    return params


def _mtp_head(config: dict[str, Any]):
    """The multi-token-prediction head `config` declares (Qwen3.5's `mtp.*`), or None."""
    from .. import mtp_head as mtp

    declared = mtp.head_args(copy.deepcopy(config))
    return None if declared is None else mtp.MTPHead(*declared)


def save_weights(params: dict[str, np.ndarray], path: Path) -> None:
    # safetensors writes tensors sorted by name, so the file is byte-stable.
    save_file(params, str(path), metadata={"format": "mlx"})
