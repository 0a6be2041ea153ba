"""The multi-token-prediction drafter: the head read from a checkpoint's `mtp.*` tensors as
Qwen stores them (offset-free norms, fused or per-expert experts, quantized or not), and
on demo-hybrid's head, greedy output identical to plain decode alone, in batches and after
a cache hit, with the head's cache primed along the prompt and kept in step with what the
sequence commits."""

from __future__ import annotations

import asyncio
import json
import logging
import random

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.models.qwen3_5 import TextModelArgs

from engine_bridge.engine import Engine, EngineSettings
from engine_bridge.models import mtp_head as mtp
from engine_bridge.scheduling.speculation.control import Mode, SpeculativeSettings, new_drafter
from engine_bridge.scheduling.speculation.drafters import PromptLookup
from engine_bridge.scheduling.speculation.mtp import MTPDrafter
from engine_bridge.types import Message, Sampling
from tests.conftest import QWEN36, fresh_cache_dir
from tests.scheduling.test_speculative import K, _generate, _request, _run

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


# --- on demo-hybrid's head ------------------------------------------------------------------

MODEL = "demo-hybrid"
# The heads: demo-hybrid's dense one, and demo-qwen36's with experts (stored per expert,
# stacked into switch_mlp by the loader), behind a 248k-row head.
HEADS = (MODEL, QWEN36)
# Output lengths on demo-qwen36, shorter: each of its steps reads the 248k-row head for
# the model and again for the draft, ~8x demo-hybrid's step on this CPU.
SHORT = {QWEN36: 0.4}


def _n(model: str, n: int) -> int:
    return max(1, round(n * SHORT.get(model, 1.0)))


class Watched(MTPDrafter):
    """The real head, its every draft recorded with where the head stood; optionally the
    draft verified is an oracle's (plain decode's own tokens, broken at seeded places), so
    every accept length comes up and the head is fed runs of accepted positions."""

    def __init__(self, head, model, prompt, truth=None, seed=0, depth=1):
        super().__init__(head, model, depth)
        self.prompt, self.truth = list(prompt), truth
        self.rng = random.Random(seed)
        self.seen: list[tuple[int, int, int, int]] = []  # position, start, len(out), draft

    def propose(self, out, k):
        drafts = super().propose(out, k)
        if drafts:
            self.seen.append((self.position, self.start, len(out), drafts[0]))
        if self.truth is None:
            return drafts
        oracle = self.truth[len(out) : len(out) + k]
        at = self.rng.randint(0, k)
        if at < len(oracle):
            oracle[at] = (oracle[at] + 1) % 4000
        return oracle


def _engine(demo_root, where, models=(MODEL,), **kw) -> Engine:
    return Engine(
        EngineSettings(
            cache_dir=fresh_cache_dir(demo_root, where),
            model_specs=list(models),
            ssd_enabled=False,
            speculation=SpeculativeSettings(mode=Mode.MTP),
            **kw,
        )
    )


def _watch_drafters(engine: Engine, loaded, **kw) -> list[Watched]:
    """Every sequence of `loaded`'s engine drafts with a Watched head; returns them."""
    made: list[Watched] = []

    def make(prompt):
        made.append(Watched(loaded.mtp.head(), loaded.model, prompt, **kw))
        return made[-1]

    engine.scheduler.settings.speculation.drafter = make
    return made


def _offline_drafts(loaded, tokens: list[int], start: int) -> list[int]:
    """What the head drafts at each position from `start` on, computed in one pass over
    the committed sequence: the main model's hidden states, the head over (h_p, t_p+1)."""
    head = Watched(loaded.mtp.head(), loaded.model, [])
    _, hidden = head.forward(mx.array(tokens[:-1])[None], make_prompt_cache(loaded.model))
    out = head.head(hidden[:, start:], head._embed(mx.array(tokens[start + 1 :])[None]),
                    head.head.make_cache())  # fmt: skip
    return mx.argmax(head._logits(out)[0], axis=-1).tolist()


def _check_in_step(drafter: Watched, out: list[int], loaded, start: int = 0) -> None:
    """The head was primed along the prompt and fed every committed position: each draft
    stood at the main cache's offset, and is what the head computes over the sequence."""
    n = len(drafter.prompt)
    assert drafter.seen, "the head never drafted"
    offline = _offline_drafts(loaded, drafter.prompt + out, start)
    for position, head_start, done, draft in drafter.seen:
        assert head_start == start
        assert position == n + done - 1  # the next input's position: the cache's offset
        assert draft == offline[position - 1 - start], (position, done)


@pytest.mark.parametrize("model", HEADS)
def test_greedy_output_with_the_head_is_plain_decode(demo_root, tmp_path, model):
    engine = _engine(
        demo_root, tmp_path / "c", models=(model,), prefill_chunk=64
    )  # the head primes in chunks
    stats = engine.scheduler.stats

    async def scenario():
        loaded = (await engine.models.runner(model)).loaded
        n = max(72, _n(model, 96))  # past the 64-token prefill chunk the head primes in
        plain, _ = await _generate(engine, _request(model, speculative=False, n=n, use_cache=False))
        seen = {}
        spec = engine.scheduler.settings.speculation
        spec.min_draft = spec.max_draft = K
        runs = [("head", {}), ("depth 2", {"depth": 2}), ("oracle", {"truth": plain, "seed": 3})]
        # Chaining the head on its own output is the same code on any model.
        for name, kw in runs if model == MODEL else [runs[0], runs[2]]:
            made = _watch_drafters(engine, loaded, **kw)
            before = (stats.spec_drafted, stats.spec_accepted)
            out, _ = await _generate(engine, _request(model, n=n, use_cache=False))
            seen[name] = (out, made[0], before, (stats.spec_drafted, stats.spec_accepted))
        return loaded, plain, seen

    loaded, plain, seen = _run(scenario())
    asyncio.run(engine.close())
    assert len(plain) > 64
    for name, (out, drafter, before, after) in seen.items():
        assert out == plain, name
        assert after[0] > before[0], name  # it drafted
        # Cold: primed over the prompt, all of it but the last token; the first draft comes
        # once the first token is out, from a plain step (decoding.py).
        assert drafter.seen[0][:3] == (len(drafter.prompt), 0, 1), name
        _check_in_step(drafter, out, loaded)
    # The oracle's drafts were kept in runs (every accept length), and the head, fed those
    # runs, still drafted what it computes over the sequence (checked above).
    _, _, before, after = seen["oracle"]
    assert after[1] - before[1] > len(plain) / 2


@pytest.mark.parametrize("model", HEADS)
def test_batches_of_one_to_four_match_plain_decode_row_for_row(demo_root, tmp_path, model):
    engine = _engine(demo_root, tmp_path / "c", models=(model,))
    stats = engine.scheduler.stats

    async def scenario():
        results = {}
        # demo-qwen36: alone, and a batch that shrinks to its last row (its steps cost ~8x).
        for rows in range(1, 5) if model == MODEL else (1, 3):
            # Different lengths: the batch shrinks, and its last row decodes alone, its
            # head started over where it left the batch.
            lengths = [_n(model, 30 + 30 * i) for i in range(rows)]
            plain = [(await _generate(engine, _request(model, i, False, n, use_cache=False)))[0]
                     for i, n in enumerate(lengths)]  # fmt: skip
            together = await asyncio.gather(
                *(_generate(engine, _request(model, i, True, n, use_cache=False))
                  for i, n in enumerate(lengths))
            )  # fmt: skip
            results[rows] = (plain, [t[0] for t in together])
        return results

    results = _run(scenario())
    asyncio.run(engine.close())
    for rows, (plain, together) in results.items():
        assert together == plain, rows
    assert stats.spec_paused_steps > 0  # rows shared steps: no drafting there
    assert stats.spec_rounds > 0


@pytest.mark.parametrize("model", HEADS)
def test_a_cache_hit_then_the_head_gives_what_plain_gives(demo_root, tmp_path, model):
    """A restored sequence's head starts at the restore point (its K/V is not cached) and
    drafts over what it was fed from there; the output is plain decode's."""

    async def two_turns(name: str, speculative: bool):
        engine = _engine(demo_root, tmp_path / name, models=(model,))
        try:
            loaded = (await engine.models.runner(model)).loaded
            made = _watch_drafters(engine, loaded)
            first, r1 = await _generate(engine, _request(model, 7, speculative, _n(model, 96)))
            follow = _request(model, 7, speculative, _n(model, 96))
            follow.messages = [*follow.messages, Message("assistant", r1.text),
                               Message("user", "and again")]  # fmt: skip
            second, r2 = await _generate(engine, follow)
            return first, second, r2, made, loaded, engine.scheduler.stats.spec_drafted
        finally:
            await engine.close()

    plain_first, plain_second, plain_hit, _, _, _ = _run(two_turns("plain", False))
    first, second, hit, made, loaded, drafted = _run(two_turns("spec", True))
    assert drafted > 0
    assert hit.cached_tokens == plain_hit.cached_tokens > 0
    assert (first, second) == (plain_first, plain_second)
    _check_in_step(made[0], first, loaded)
    _check_in_step(made[1], second, loaded, start=hit.cached_tokens)


def test_mtp_without_a_head_decodes_plainly(demo_root, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="engine_bridge.scheduling.runner")
    engine = _engine(demo_root, tmp_path / "c", models=("demo-llama", MODEL))
    stats = engine.scheduler.stats

    async def scenario():
        llama = (await engine.models.runner("demo-llama")).loaded
        hybrid = (await engine.models.runner(MODEL)).loaded
        plain, _ = await _generate(engine, _request("demo-llama", speculative=False))
        rounds = stats.spec_rounds
        out, _ = await _generate(engine, _request("demo-llama"))
        return llama, hybrid, plain, out, stats.spec_rounds - rounds

    llama, hybrid, plain, out, rounds = _run(scenario())
    asyncio.run(engine.close())
    assert llama.mtp is None and hybrid.mtp is not None
    assert out == plain and rounds == 0
    # The model without a head is named once, at its load; the one with a head is not.
    warned = [r.getMessage() for r in caplog.records if "has no MTP head" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("demo-llama "), warned
    mtp_mode = SpeculativeSettings(mode=Mode.MTP)
    assert new_drafter(mtp_mode, [1], llama) is None
    assert isinstance(new_drafter(mtp_mode, [1], hybrid), MTPDrafter)
    # Prompt lookup by name stays prompt lookup; "auto" takes the head where it drafts.
    assert isinstance(new_drafter(SpeculativeSettings(mode=Mode.PROMPT_LOOKUP), [1], hybrid),
                      PromptLookup)  # fmt: skip
    # "auto": the head on a GPU, prompt lookup on the CPU and for a model without one.
    auto = SpeculativeSettings(mode=Mode.AUTO)
    on_gpu = mx.default_device().type == mx.DeviceType.gpu
    assert isinstance(new_drafter(auto, [1], hybrid), MTPDrafter if on_gpu else PromptLookup)
    assert isinstance(new_drafter(auto, [1], llama), PromptLookup)


def test_sampled_decoding_with_the_head_runs_to_its_length(demo_root, tmp_path):
    engine = _engine(demo_root, tmp_path / "c")

    async def scenario():
        req = _request(MODEL, use_cache=False, n=80)
        req.sampling = Sampling(temperature=0.8, top_p=0.95, seed=4)
        return await _generate(engine, req)

    out, result = _run(scenario())
    drafted = engine.scheduler.stats.spec_drafted
    asyncio.run(engine.close())
    assert len(out) == result.completion_tokens == 80 and result.finish_reason == "length"
    assert drafted > 0
