"""Multi-token prediction heads: what Qwen3.5/3.6 checkpoints ship as `mtp.*` tensors.

mlx-lm 0.32 drops these tensors when it loads the model (`qwen3_5.sanitize`); this module
reads them back from the checkpoint's safetensors into an `MTPHead`, kept by the loaded
model (`MTPSource`). The drafter that runs it is scheduling/speculation/mtp.py.

The head at position p takes two inputs: the main model's hidden state there, h_p, and
the embedding of the token after it, t_{p+1}; it predicts t_{p+2}. Each input gets its
own RMSNorm (`pre_fc_norm_hidden`, `pre_fc_norm_embedding`), the two are concatenated
embedding first and projected back to the hidden size (`fc`, 2h -> h), run through one
full-attention decoder layer of the main model's kind (MoE where the model is MoE) with
its own K/V cache, normed (`norm`) and scored by the main model's own `lm_head` over its
own `embed_tokens` (`mtp_use_dedicated_embeddings` false, as Qwen ships them).

h_p is the main model's *final* hidden state, after its last norm: the tensor its lm_head
scores. Implementations disagree on this in public; the measured ones agree (llama.cpp
#24025, LightLLM #1402, Rapid-MLX #3371: post-norm accepts 3-50% more), and it is what
vLLM's qwen3_5_mtp feeds (`Qwen3_5Model.forward` returns the normed state). It is also the
cheap one here: mlx-lm's backbone returns exactly that, and the logits are lm_head of it,
so one forward pass gives both.

How a head is fed along a sequence (primed at prefill, committed positions only, started
over at a restore point) is the drafter's business: scheduling/speculation/mtp.py.

Weights are taken as the checkpoint stores them: unquantized (bf16) where the checkpoint
keeps the head so, quantized with the checkpoint's own bits where it ships it quantized.
"""

from __future__ import annotations

import copy
import logging
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.qwen3_5 import DecoderLayer, TextModelArgs
from mlx_lm.utils import infer_quant_config

from ..kv import KVCache

log = logging.getLogger("engine_bridge.models.mtp_head")

# Model types whose mlx-lm classes this head is built from.
MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")
# An `mtp.` segment starts the head's keys, at the top level (Qwen's own files) or under a
# wrapper (`language_model.mtp.`, `model.mtp.`) some conversions add.
_HEAD_KEY = re.compile(r"(?:^|\.)mtp\.(.+)$")
# Experts one tensor each, as Qwen3-Next and older exports store them.
_PER_EXPERT = re.compile(
    r"^(layers\.\d+\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|scales|biases)$"
)
# Experts fused, as Qwen3.5/3.6 checkpoints store them: gate and up stacked on axis -2.
_FUSED = re.compile(r"^(layers\.\d+\.mlp)\.experts\.(gate_up_proj|down_proj)$")
# The head's RMSNorms. Qwen stores them offset-free (the layer scales by 1 + w); mlx's
# RMSNorm scales by w, so a checkpoint in Qwen's form gets +1, as mlx-lm's sanitize does
# to the main model's norms.
_NORMS = frozenset({"pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm", "input_layernorm",
                    "post_attention_layernorm", "q_norm", "k_norm"})  # fmt: skip


# --- the head -------------------------------------------------------------------------------


class MTPHead(nn.Module):
    """The `mtp.*` module: two input norms, `fc`, decoder layer(s), a final norm."""

    def __init__(self, args: TextModelArgs, n_layers: int, dedicated_embeddings: bool = False):
        super().__init__()
        h, eps = args.hidden_size, args.rms_norm_eps
        self.pre_fc_norm_embedding = nn.RMSNorm(h, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(h, eps=eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        # The main model's own layer class, at an index that makes it full attention.
        self.layers = [
            DecoderLayer(args, args.full_attention_interval - 1) for _ in range(n_layers)
        ]
        self.norm = nn.RMSNorm(h, eps=eps)
        if dedicated_embeddings:
            self.embed_tokens = nn.Embedding(args.vocab_size, h)

    def __call__(self, hidden: mx.array, embedded: mx.array, cache: list[KVCache]) -> mx.array:
        """The normed output at each of L positions, from [1, L, h] hidden states and the
        [1, L, h] embeddings of the tokens one ahead of them."""
        x = mx.concatenate(
            [self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden)], axis=-1
        )
        x = self.fc(x)
        # Qwen ships one layer. Where a checkpoint has more, vLLM runs layer i for draft
        # depth i; this head drafts with the first only (priming the others would need
        # their own deeper inputs).
        x = self.layers[0](x, mask=create_attention_mask(x, cache[0]), cache=cache[0])
        return self.norm(x)

    def make_cache(self) -> list[KVCache]:
        return [KVCache()]


# --- reading it from a checkpoint ------------------------------------------------------------


def head_args(config: dict[str, Any]) -> tuple[TextModelArgs, int] | None:
    """The head's layer arguments and layer count, when `config` declares a head."""
    if config.get("model_type") not in MODEL_TYPES:
        return None
    text = config.get("text_config") or config
    n = int(text.get("mtp_num_hidden_layers") or 0)
    if n <= 0:
        return None
    # A deep copy: ModelArgs rewrite nested dicts (rope_parameters) in place.
    return TextModelArgs.from_dict(copy.deepcopy(text)), n


def read_head_tensors(path: Path) -> tuple[dict[str, mx.array], bool]:
    """The checkpoint's `mtp.*` tensors keyed below `mtp.`, and whether the checkpoint is
    in Hugging Face's layout (unconverted conv1d weights: mlx-lm's own test for it).

    mx.load maps the files lazily: reading the keys of a 20 GB model reads its headers.
    """
    head: dict[str, mx.array] = {}
    raw = False
    for file in sorted(path.glob("*.safetensors")):
        for key, value in mx.load(str(file)).items():
            if (m := _HEAD_KEY.search(key)) is not None:
                head[m[1]] = value
            elif "conv1d.weight" in key and value.shape[-1] != 1:
                raw = True
    return head, raw


def norms_offset_free(weights: dict[str, mx.array], raw_layout: bool) -> bool:
    """Whether the head's norm weights are stored in Qwen's offset-free form (need +1).

    A checkpoint in Hugging Face's layout stores them so (mlx-lm shifts the main model's
    for the same reason). A converted checkpoint that kept the head may have shifted them
    or not, and says nothing about it: the values tell. Scales as mlx applies them sit
    near 1; a head whose scales sat near 0 would zero its own input, so weights near 0
    are offsets. The per-head q/k norms are left out of the mean: they are the ones that
    train far from 1.
    """
    if raw_layout:
        return True
    norms = [v.astype(mx.float32) for k, v in weights.items()
             if _is_norm(k, v) and k.split(".")[-2] not in ("q_norm", "k_norm")]  # fmt: skip
    if not norms:
        return False
    return mx.mean(mx.abs(mx.concatenate(norms))).item() < 0.5


def sanitize(weights: dict[str, mx.array], offset_free: bool) -> dict[str, mx.array]:
    """The head's tensors as `MTPHead` names them: experts stacked into `switch_mlp` (per
    expert or fused, as mlx-lm does for the main layers) and norms shifted when stored
    offset-free."""
    out: dict[str, mx.array] = {}
    experts: dict[tuple[str, str, str], dict[int, mx.array]] = {}
    for key, value in weights.items():
        if (m := _PER_EXPERT.match(key)) is not None:
            experts.setdefault((m[1], m[3], m[4]), {})[int(m[2])] = value
        elif (m := _FUSED.match(key)) is not None:
            if m[2] == "gate_up_proj":
                mid = value.shape[-2] // 2
                out[f"{m[1]}.switch_mlp.gate_proj.weight"] = value[..., :mid, :]
                out[f"{m[1]}.switch_mlp.up_proj.weight"] = value[..., mid:, :]
            else:
                out[f"{m[1]}.switch_mlp.down_proj.weight"] = value
        elif offset_free and _is_norm(key, value):
            out[key] = value + 1.0
        else:
            out[key] = value
    for (mlp, proj, param), by_expert in experts.items():
        ids = sorted(by_expert)
        assert ids == list(range(len(ids))), f"{mlp}: experts {ids} are not 0..n-1"
        out[f"{mlp}.switch_mlp.{proj}.{param}"] = mx.stack([by_expert[e] for e in ids])
    return out


def load_head(path: Path, config: dict[str, Any]) -> MTPHead | None:
    """The checkpoint's head with its weights, or None where it has none."""
    declared = head_args(config)
    if declared is None:
        return None
    args, n_layers = declared
    tensors, raw = read_head_tensors(path)
    if not tensors:
        return None
    offset_free = norms_offset_free(tensors, raw)
    weights = sanitize(tensors, offset_free)
    head = MTPHead(args, n_layers, dedicated_embeddings="embed_tokens.weight" in weights)
    if any(k.endswith(".scales") for k in weights):

        def quantized(p: str, m: nn.Module) -> bool | dict[str, Any]:
            if not hasattr(m, "to_quantized") or f"{p}.scales" not in weights:
                return False
            return infer_quant_config(p, m, weights)

        nn.quantize(head, class_predicate=quantized)
    head.load_weights(list(weights.items()), strict=True)
    mx.eval(head.parameters())
    log.info("loaded the MTP head of %s: %d layer(s), %s, norms %s", path.name, n_layers,
             "quantized" if any(k.endswith(".scales") for k in weights) else
             str(weights["fc.weight"].dtype), "shifted" if offset_free else "as stored")  # fmt: skip
    return head


def has_head(path: Path, config: dict[str, Any]) -> bool:
    """Whether the config declares a head and the checkpoint's files hold its tensors
    (mlx-community conversions keep the config key and drop the tensors)."""
    return head_args(config) is not None and bool(read_head_tensors(path)[0])


def _is_norm(key: str, value: mx.array) -> bool:
    parts = key.split(".")
    return value.ndim == 1 and parts[-1] == "weight" and len(parts) > 1 and parts[-2] in _NORMS


# --- drafting with it ------------------------------------------------------------------------


class MTPSource:
    """A loaded model's head, read on first use (on the MLX thread) and kept."""

    def __init__(self, path: Path, config: dict[str, Any]):
        self.path, self.config = path, config
        self._head: MTPHead | None = None
        self._failed = False

    def head(self) -> MTPHead | None:
        if self._head is None and not self._failed:
            try:
                self._head = load_head(self.path, self.config)
            except Exception:
                log.exception("the MTP head of %s did not load; drafting without it", self.path)
                self._failed = True
            self._failed |= self._head is None
        return self._head
