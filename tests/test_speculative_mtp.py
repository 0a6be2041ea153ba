"""The multi-token-prediction drafter: the head read from a checkpoint's `mtp.*` tensors as
Qwen stores them (offset-free norms, fused or per-expert experts, quantized or not), and
on demo-hybrid's head, greedy output identical to plain decode alone, in batches and after
a cache hit, with the head's cache primed along the prompt and kept in step with what the
sequence commits."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.qwen3_5 import TextModelArgs

from engine_bridge.speculation import mtp

# A tiny Qwen3.5-MoE text config: what the head's layer is built from.
MOE = {
    "model_type": "qwen3_5_moe",
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 4,
    "full_attention_interval": 2,
    "vocab_size": 128,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "rms_norm_eps": 1e-6,
    "mtp_num_hidden_layers": 1,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
}


def _reference_head(config: dict, seed: int = 0) -> mtp.MTPHead:
    """A head with random weights everywhere, norms included (as mlx applies them)."""
    args, n = mtp.head_args({"model_type": config["model_type"], "text_config": config})
    head = mtp.MTPHead(args, n)
    named = tree_flatten(head.parameters())
    keys = mx.random.split(mx.random.key(seed), len(named))
    params = []
    for i, (name, value) in enumerate(named):
        noise = mx.random.normal(value.shape, key=keys[i]) * 0.1
        params.append((name, (1.0 + noise) if value.ndim == 1 else noise))
    head.load_weights(params)
    mx.eval(head.parameters())
    return head


def _as_qwen_stores_it(head: mtp.MTPHead, fused: bool) -> dict[str, mx.array]:
    """The head's tensors under Qwen's names: `mtp.` keys, norms without the +1, experts
    fused (gate and up stacked on axis -2) or one tensor each."""
    out = {}
    for name, value in tree_flatten(head.parameters()):
        if value.ndim == 1 and name.split(".")[-2] in mtp._NORMS:
            out[f"mtp.{name}"] = value - 1.0
        elif ".switch_mlp." in name:
            mlp, proj = name.split(".switch_mlp.")[0], name.split(".")[-2]
            if fused and proj == "down_proj":
                out[f"mtp.{mlp}.experts.down_proj"] = value
            elif fused:
                continue  # gate and up go together, below
            else:
                for e in range(value.shape[0]):
                    out[f"mtp.{mlp}.experts.{e}.{proj}.weight"] = value[e]
        else:
            out[f"mtp.{name}"] = value
    if fused:
        params = dict(tree_flatten(head.parameters()))
        for name in [n for n in params if n.endswith("switch_mlp.gate_proj.weight")]:
            mlp = name.split(".switch_mlp.")[0]
            up = params[f"{mlp}.switch_mlp.up_proj.weight"]
            out[f"mtp.{mlp}.experts.gate_up_proj"] = mx.concatenate([params[name], up], axis=-2)
    return out


def _same_parameters(a: nn.Module, b: nn.Module) -> None:
    pa, pb = dict(tree_flatten(a.parameters())), dict(tree_flatten(b.parameters()))
    assert sorted(pa) == sorted(pb)
    for name in pa:
        np.testing.assert_allclose(np.array(pa[name]), np.array(pb[name]), atol=1e-6, err_msg=name)


def _write_checkpoint(folder, tensors: dict[str, mx.array], config: dict, raw: bool) -> None:
    """A checkpoint folder: the head's tensors plus one main-model conv1d weight, in
    Hugging Face's layout (kernel last) when `raw`, else mlx's (converted)."""
    folder.mkdir()
    conv = mx.zeros((8, 1, 4)) if raw else mx.zeros((8, 4, 1))
    mx.save_safetensors(str(folder / "model-00001.safetensors"),
                        {"model.language_model.layers.0.linear_attn.conv1d.weight": conv})  # fmt: skip
    mx.save_safetensors(str(folder / "model-00002.safetensors"), tensors)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe",
                                                     "text_config": config}))  # fmt: skip


@pytest.mark.parametrize("fused", [True, False], ids=["fused-experts", "per-expert"])
def test_the_loader_shifts_offset_free_norms_and_stacks_the_experts(tmp_path, fused):
    ref = _reference_head(MOE)
    _write_checkpoint(tmp_path / "ckpt", _as_qwen_stores_it(ref, fused), MOE, raw=True)
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    head = mtp.load_head(tmp_path / "ckpt", config)
    assert head is not None
    _same_parameters(head, ref)


def test_a_converted_checkpoint_keeps_shifted_norms_and_shifts_offset_free_ones(tmp_path):
    ref = _reference_head(MOE)
    stored = _as_qwen_stores_it(ref, fused=True)
    shifted = {k: (v + 1.0 if v.ndim == 1 else v) for k, v in stored.items()}
    tensors = {k.removeprefix("mtp."): v for k, v in stored.items()}
    # Converted layout (no raw conv1d): the values say which form the norms are in.
    assert mtp.norms_offset_free(tensors, raw_layout=False)
    assert not mtp.norms_offset_free({k.removeprefix("mtp."): v for k, v in shifted.items()},
                                     raw_layout=False)  # fmt: skip
    for name, tensors in [("offset-free", stored), ("shifted", shifted)]:
        _write_checkpoint(tmp_path / name, tensors, MOE, raw=False)
        head = mtp.load_head(tmp_path / name, {"model_type": "qwen3_5_moe", "text_config": MOE})
        _same_parameters(head, ref)


def test_a_quantized_head_loads_quantized_with_its_own_bits(tmp_path):
    ref = _reference_head(MOE)

    # The router at 8 bits, the rest at 4 (mlx-lm's MoE default): bits are read per module.
    def eight_bit_router(path: str, module: nn.Module) -> bool | dict:
        if not hasattr(module, "to_quantized"):
            return False
        return {"group_size": 32, "bits": 8} if path.endswith("mlp.gate") else True

    nn.quantize(ref, group_size=32, bits=4, class_predicate=eight_bit_router)
    mx.eval(ref.parameters())
    tensors = {f"mtp.{k}": v for k, v in tree_flatten(ref.parameters())}
    _write_checkpoint(tmp_path / "q", tensors, MOE, raw=False)
    head = mtp.load_head(tmp_path / "q", {"model_type": "qwen3_5_moe", "text_config": MOE})
    _same_parameters(head, ref)
    assert isinstance(head.fc, nn.QuantizedLinear) and head.fc.bits == 4
    assert head.layers[0].mlp.gate.bits == 8
    # And it computes what the reference computes.
    x = mx.random.normal((1, 3, 64), key=mx.random.key(1))
    a, b = head(x, x, head.make_cache()), ref(x, x, ref.make_cache())
    np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5)


def test_no_head_without_its_tensors_or_its_config_key(tmp_path):
    ref = _reference_head(MOE)
    # The config key without the tensors (mlx-community conversions drop them).
    _write_checkpoint(tmp_path / "none", {"lm_head.weight": mx.zeros((4, 4))}, MOE, raw=False)
    assert not mtp.has_head(tmp_path / "none", {"model_type": "qwen3_5_moe", "text_config": MOE})
    # The tensors without the config key.
    _write_checkpoint(tmp_path / "nokey", _as_qwen_stores_it(ref, True), MOE, raw=False)
    no_key = {k: v for k, v in MOE.items() if k != "mtp_num_hidden_layers"}
    assert (
        mtp.load_head(tmp_path / "nokey", {"model_type": "qwen3_5_moe", "text_config": no_key})
        is None
    )
    # Not a Qwen3.5 model.
    assert mtp.head_args({**MOE, "model_type": "llama"}) is None
    assert isinstance(mtp.head_args(MOE)[0], TextModelArgs)
