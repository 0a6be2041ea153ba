"""demo-qwen36 and demo-qwen36-4bit: Qwen3.6-35B-A3B's layout at toy size (nested config,
3 Gated DeltaNet layers to 1 attention, 8 experts top-2 beside a shared expert, the real
vocabulary, an MTP head with experts stored per expert) and its `mlx_lm.convert -q` copy,
loaded by plain mlx-lm and by our MTP loader."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.models.qwen3_next import Qwen3NextSparseMoeBlock
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU, SwitchLinear
from mlx_lm.utils import load

from engine_bridge.models import mtp_head as mtp
from engine_bridge.models.demo import DEMO_MODEL_IDS, build, ensure_demo_model, is_demo_model
from engine_bridge.models.demo import qwen36_vocab as vocab
from engine_bridge.scheduling.speculation.mtp import MTPDrafter

FLOAT, QUANT = "demo-qwen36", "demo-qwen36-4bit"
IM_END, END_OF_TEXT = vocab.SPECIAL_TOKENS["<|im_end|>"], vocab.SPECIAL_TOKENS["<|endoftext|>"]
# Two prompts of one length (a batch without padding), different from their first token on.
PROMPTS = (
    [9707, 11, 1246, 525, 498, 30, 358, 1079],
    [785, 3974, 13876, 38835, 34208, 916, 279, 15678],
)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("qwen36")
    for name in (FLOAT, QUANT):
        ensure_demo_model(name, root)
    return root


@pytest.fixture(scope="module")
def loaded(root):
    """name -> (model, tokenizer, config) as mlx_lm.load gives them."""
    return {name: load(str(root / "models" / name), return_config=True) for name in (FLOAT, QUANT)}


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    steps = generate_step(mx.array(prompt), model, max_tokens=n, sampler=lambda x: mx.argmax(x, -1))
    return [int(token) for token, _ in steps]


def _muted() -> set[int]:
    specials = sorted(vocab.SPECIAL_TOKENS.values())
    return set(specials) | set(range(specials[-1] + 1, vocab.VOCAB_ROWS))


def test_the_qwen36_demos_are_named_but_not_served_by_default():
    for name in (FLOAT, QUANT):
        assert is_demo_model(name)
        # A server with no models named serves DEMO_MODEL_IDS: 128 MB builds stay out.
        assert name not in DEMO_MODEL_IDS
    assert build.recipe_digest(FLOAT) == build.recipe_digest(FLOAT)
    assert build.recipe_digest(FLOAT) != build.recipe_digest(QUANT)


def test_config_is_qwen36s_nested_layout_with_the_real_vocabulary(loaded):
    _, tokenizer, config = loaded[FLOAT]
    assert config["model_type"] == "qwen3_5_moe"
    assert config["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    assert "vision_config" not in config and "vocab_size" not in config
    text = config["text_config"]
    assert text["model_type"] == "qwen3_5_moe_text"
    assert (text["hidden_size"], text["vocab_size"], text["tie_word_embeddings"]) == (
        64,
        248320,
        False,
    )
    assert (text["num_experts"], text["num_experts_per_tok"], text["mtp_num_hidden_layers"]) == (
        8,
        2,
        1,
    )
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    # generation_config.json's two stop ids, as Qwen ships them.
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_ids == {IM_END, END_OF_TEXT}
    assert tokenizer.encode("<think>", add_special_tokens=False) == [248068]


def test_caches_are_three_deltanet_layers_to_one_attention_layer(loaded):
    for name in (FLOAT, QUANT):
        model = loaded[name][0]
        assert [type(c).__name__ for c in make_prompt_cache(model)] == [
            "ArraysCache",
            "ArraysCache",
            "ArraysCache",
            "KVCache",
        ], name


def test_every_layer_routes_two_of_eight_experts_beside_a_shared_expert(loaded):
    model = loaded[FLOAT][0]
    for layer in model.layers:
        moe = layer.mlp
        assert isinstance(moe, Qwen3NextSparseMoeBlock)
        assert isinstance(moe.switch_mlp, SwitchGLU)
        assert (moe.num_experts, moe.top_k) == (8, 2)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert getattr(moe.switch_mlp, proj).weight.shape == (8, 64, 64), proj
        assert moe.shared_expert.down_proj.weight.shape == (64, 64)
        assert moe.shared_expert_gate.weight.shape == (1, 64)


def test_a_batch_of_two_prompts_gives_each_row_its_own_logits(loaded):
    model = loaded[FLOAT][0]
    batch = model(mx.array(PROMPTS), cache=make_prompt_cache(model))
    for row, prompt in enumerate(PROMPTS):
        alone = model(mx.array([prompt]), cache=make_prompt_cache(model))
        np.testing.assert_allclose(np.array(batch[row]), np.array(alone[0]), atol=1e-5, rtol=1e-5)
    # Different prompts route differently: the rows are not one row twice.
    assert not np.allclose(np.array(batch[0]), np.array(batch[1]))


def test_greedy_decoding_depends_on_context_and_never_picks_a_muted_row(loaded):
    model = loaded[FLOAT][0]
    first, second = (_greedy(model, p, 16) for p in PROMPTS)
    assert first != second
    for tokens in (first, second):
        assert len(set(tokens)) >= 8, tokens
        assert not set(tokens) & _muted(), tokens


def test_the_mtp_head_is_stored_per_expert_and_loads_with_its_experts(root, loaded):
    model, _, config = loaded[FLOAT]
    path = root / "models" / FLOAT
    stored = {k: v for k, v in mx.load(str(path / "model.safetensors")).items() if "mtp." in k}
    experts = {f"mtp.layers.0.mlp.experts.{e}.{p}.weight" for e in range(8)
               for p in ("gate_proj", "up_proj", "down_proj")}  # fmt: skip
    others = {"fc", "norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden"} | {
        f"layers.0.{m}"
        for m in ("input_layernorm", "post_attention_layernorm", "mlp.gate",
                  "mlp.shared_expert_gate", "self_attn.q_norm", "self_attn.k_norm")
        + tuple(f"mlp.shared_expert.{p}" for p in ("gate_proj", "up_proj", "down_proj"))
        + tuple(f"self_attn.{p}_proj" for p in "qkvo")
    }  # fmt: skip
    assert set(stored) == experts | {f"mtp.{m}.weight" for m in others}
    # Norms offset-free, as Qwen stores them; the loader shifts them back to 1.
    for norm in ("norm", "pre_fc_norm_hidden", "layers.0.self_attn.q_norm"):
        assert float(mx.abs(stored[f"mtp.{norm}.weight"]).max()) == 0.0, norm
    assert mtp.has_head(path, config)
    head = mtp.load_head(path, config)
    assert float(mx.abs(head.norm.weight - 1).max()) == 0.0
    moe = head.layers[0].mlp
    assert isinstance(moe.switch_mlp.up_proj, SwitchLinear) and moe.top_k == 2
    for e in range(8):
        up = stored[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"]
        assert mx.array_equal(moe.switch_mlp.up_proj.weight[e], up).item(), e
    _drafts_finite(head, model)


def _drafts_finite(head: mtp.MTPHead, model) -> None:
    """The head primed along a prompt drafts two tokens, from finite outputs."""
    drafter = MTPDrafter(head, model, depth=2)
    prompt = PROMPTS[0]
    logits, hidden = drafter.forward(mx.array([prompt]), make_prompt_cache(model))
    nxt = int(mx.argmax(logits[0, -1]).item())
    ahead = mx.array([prompt[1:] + [nxt]])
    out = head(hidden, model.model.embed_tokens(ahead), head.make_cache())
    assert out.shape == (1, len(prompt), 64) and mx.all(mx.isfinite(out)).item()
    drafter.feed(hidden, prompt[1:] + [nxt], at=0)
    drafts = drafter.propose([nxt], 2)
    assert len(drafts) == 2 and not set(drafts) & _muted(), drafts
    # The deeper draft's position is trimmed off again: the head holds the prompt only.
    assert drafter.position == len(prompt)


def test_the_4bit_copy_is_quantized_as_mlx_lm_convert_does(loaded):
    model, _, config = loaded[QUANT]
    quant = config["quantization"]
    assert (quant["group_size"], quant["bits"], quant["mode"]) == (64, 4, "affine")
    assert config["quantization_config"] == quant
    quantized = {}
    for path, module in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module):
        assert not isinstance(module, nn.Linear | SwitchLinear | nn.Embedding), path
        if isinstance(module, nn.QuantizedLinear | QuantizedSwitchLinear | nn.QuantizedEmbedding):
            quantized[path] = (module.bits, module.group_size)
    # Every matrix, the embedding and the head included; the router and the shared expert's
    # gate at 8 bits by qwen3_5's own predicate, recorded per layer.
    # Per layer: the router, 3 stacked expert and 3 shared-expert matrices, its gate; plus
    # 5 projections in each Gated DeltaNet layer, 4 in the attention layer; embedding, head.
    assert len(quantized) == 3 * (8 + 5) + (8 + 4) + 2
    eight = {p for p, bits in quantized.items() if bits == (8, 64)}
    assert eight == {p for p in quantized if p.endswith(("mlp.gate", "shared_expert_gate"))}
    assert eight == {p for p in quant if p.startswith("language_model.")}
    assert set(quantized.values()) == {(4, 64), (8, 64)}


def test_the_4bit_copy_keeps_its_mtp_head_at_8_bits(root, loaded):
    model, _, config = loaded[QUANT]
    path = root / "models" / QUANT
    head = mtp.load_head(path, config)
    assert isinstance(head.fc, nn.QuantizedLinear) and head.fc.bits == 8
    moe = head.layers[0].mlp
    assert isinstance(moe.switch_mlp.gate_proj, QuantizedSwitchLinear)
    assert (moe.switch_mlp.gate_proj.bits, moe.switch_mlp.gate_proj.group_size) == (8, 64)
    assert head.layers[0].self_attn.q_proj.bits == 8
    # Recorded as mlx-lm records per-layer overrides, under the names the tensors are stored by.
    overrides = {p: v for p, v in config["quantization"].items() if p.startswith("mtp.")}
    assert overrides["mtp.fc"] == {"group_size": 64, "bits": 8}
    assert overrides["mtp.layers.0.mlp.experts.7.down_proj"] == {"group_size": 64, "bits": 8}
    assert len(overrides) == 10 + 3 * 8
    _drafts_finite(head, model)


def test_the_4bit_copy_generates_greedily(loaded):
    model, tokenizer, _ = loaded[QUANT]
    messages = [{"role": "user", "content": "Tell me about caching in local language models."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    tokens = _greedy(model, prompt, 8)
    assert len(tokens) == 8 and not set(tokens) & _muted(), tokens
    assert len(set(tokens)) >= 4, tokens


def test_a_second_build_is_byte_identical(root, tmp_path):
    # The 4-bit build draws the same random weights as the float one, then quantizes.
    again = ensure_demo_model(QUANT, tmp_path)
    first = root / "models" / QUANT
    assert sorted(p.name for p in again.iterdir()) == sorted(p.name for p in first.iterdir())
    for p in first.iterdir():
        digest = hashlib.sha256(p.read_bytes()).hexdigest()
        assert hashlib.sha256((again / p.name).read_bytes()).hexdigest() == digest, p.name
    assert json.loads((again / "config.json").read_text())["quantization"]["bits"] == 4
