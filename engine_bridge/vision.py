"""Vision-language models through mlx-vlm, behind the interface the runner knows.

`VisionModel` looks like an mlx-lm model to the runner and the cache (`layers`, called
with token ids and a cache), so text-only requests, batching and every cache tier work
unchanged. The differences: positions are multimodal RoPE (three indices per token), always
passed explicitly so they never depend on module state or on where a cached prefix ended,
and a prompt with images is prefilled from embeddings with the image features in place.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from .vision_prompt import SUPPORTED_TYPES, VisionPrompt, VisionSpec, available

log = logging.getLogger("engine_bridge.vision")

# Encoder outputs kept by image digest, so a later turn with the same image skips the
# vision tower; bounded by bytes (a screenshot's features are a few MB on a large model).
FEATURE_CACHE_BYTES = 256 << 20


def mlx_vlm_version() -> str:
    import mlx_vlm

    return getattr(mlx_vlm, "__version__", "unknown")


def has_vision_tower(config: dict[str, Any]) -> bool:
    return isinstance(config.get("vision_config"), dict)


def can_load(config: dict[str, Any]) -> bool:
    """Whether this model loads with its vision tower here."""
    return has_vision_tower(config) and config.get("model_type") in SUPPORTED_TYPES and available()


def load(path: Path) -> tuple[VisionModel, dict[str, Any]]:
    """Load a vision-language model directory through mlx-vlm."""
    from mlx_vlm.utils import load as vlm_load
    from mlx_vlm.utils import load_config

    model, processor = vlm_load(str(path))
    config = load_config(path)
    return VisionModel(model, processor, config), config


class VisionModel:
    """An mlx-vlm Qwen-VL model with mlx-lm's calling convention."""

    def __init__(self, model: Any, processor: Any, config: dict[str, Any]):
        self.vlm = model
        self.lm = model.language_model
        self.spec = VisionSpec(
            image_token_id=int(config["image_token_id"]),
            vision_start_token_id=int(config["vision_start_token_id"]),
            merge_size=int(config["vision_config"].get("spatial_merge_size", 2)),
            image_processor=processor.image_processor,
        )
        self._features: OrderedDict[bytes, mx.array] = OrderedDict()
        self._feature_bytes = 0
        self.encoder_runs = 0  # images the vision tower encoded (feature cache misses)

    @property
    def layers(self) -> list[Any]:
        return self.lm.model.layers

    def parameters(self) -> Any:
        return self.vlm.parameters()

    def __call__(
        self, inputs: mx.array, cache: Any = None, rope_deltas: list[int] | None = None
    ) -> mx.array:
        """Logits for `inputs` (B, L) following `cache`: text positions, each row shifted by
        its prompt's RoPE delta (0 for a prompt without images)."""
        batch, length = inputs.shape
        offset = cache[0].offset if cache else 0
        if isinstance(offset, mx.array) and offset.ndim > 0:
            start = offset.reshape(-1, 1)
        else:
            start = mx.full((batch, 1), int(offset))
        if rope_deltas is not None and any(rope_deltas):
            start = start + mx.array(rope_deltas).reshape(-1, 1)
        pos = start + mx.arange(length)[None]
        positions = mx.broadcast_to(pos[None], (3, batch, length))
        return self.lm(inputs, cache=cache, position_ids=positions).logits

    def prefill(self, prompt: VisionPrompt, start: int, end: int, cache: Any) -> mx.array:
        """Run tokens [start, end) of a prompt with images; features fill image positions."""
        ids = prompt.model_tokens[start:end]
        embed = self.lm.model.embed_tokens
        pieces, cursor = [], start
        for image in prompt.images:
            lo, hi = max(image.start, start), min(image.end, end)
            if lo >= hi:
                continue
            if lo > cursor:
                pieces.append(embed(mx.array(prompt.model_tokens[cursor:lo])))
            feats = self.features(image)
            pieces.append(feats[lo - image.start : hi - image.start].astype(embed.weight.dtype))
            cursor = hi
        if cursor < end:
            pieces.append(embed(mx.array(prompt.model_tokens[cursor:end])))
        h = mx.concatenate(pieces, axis=0)[None] if len(pieces) > 1 else pieces[0][None]
        positions = mx.array(prompt.positions[:, start:end].astype(np.int32))[:, None, :]
        return self.lm(
            mx.array(ids)[None], inputs_embeds=h, cache=cache, position_ids=positions
        ).logits

    def features(self, image: Any) -> mx.array:
        """The vision tower's output for `image`, from the feature cache when it is there."""
        hit = self._features.get(image.digest)
        if hit is not None:
            self._features.move_to_end(image.digest)
            return hit
        tower = self.vlm.vision_tower
        dtype = tower.patch_embed.proj.weight.dtype
        feats = tower(
            mx.array(image.pixel_values).astype(dtype),
            mx.array([list(image.grid_thw)]),
            output_hidden_states=False,
        )
        mx.eval(feats)
        self.encoder_runs += 1
        assert feats.shape[0] == image.n_tokens, (feats.shape, image.n_tokens)
        self._features[image.digest] = feats
        self._feature_bytes += feats.nbytes
        while self._feature_bytes > FEATURE_CACHE_BYTES and len(self._features) > 1:
            _, old = self._features.popitem(last=False)
            self._feature_bytes -= old.nbytes
        return feats
