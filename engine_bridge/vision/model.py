"""Vision-language models through mlx-vlm, behind the interface the runner knows.

`VisionModel` looks like an mlx-lm model to the runner and the cache (`layers`, called
with token ids and a cache), so text-only requests, batching and every cache tier work
unchanged. The differences: positions are multimodal RoPE (three indices per token), always
passed explicitly so they never depend on module state or on where a cached prefix ended,
and a prompt with images is prefilled from embeddings with the image features in place.

On a hybrid model (Qwen3.5: Gated DeltaNet layers between full-attention ones) the cache is
mlx-lm's own classes (`make_cache`), so every tier pages and checkpoints it as it does a
text model's; mlx-vlm's recurrent layers run on it through `_vlm_view`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ..prompting.images import VisionPrompt
from .features import FeatureCache
from .prompt import SUPPORTED_TYPES, VisionSpec, available

log = logging.getLogger("engine_bridge.vision.model")

_PIXEL_DTYPES = {mx.float16: "float16", mx.bfloat16: "bfloat16"}


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
        # A hybrid layout's first layer is recurrent (no offset): positions are read from
        # a full-attention layer's cache, as mlx-vlm does.
        self._fa_idx: int | None = getattr(self.lm.model, "fa_idx", None)
        image_token = config.get("image_token_id", config.get("image_token_index"))
        self.spec = VisionSpec(
            image_token_id=int(image_token),
            vision_start_token_id=int(config["vision_start_token_id"]),
            merge_size=int(config["vision_config"].get("spatial_merge_size", 2)),
            image_processor=processor.image_processor,
            pixel_dtype=_PIXEL_DTYPES.get(
                self.vlm.vision_tower.patch_embed.proj.weight.dtype, "float32"
            ),
        )
        # Encoder outputs by image digest, so a later turn with the same image skips the
        # vision tower; the engine binds it to the RAM and SSD tiers.
        self.feature_cache = FeatureCache()

    @property
    def encoder_runs(self) -> int:
        """Images the vision tower encoded (misses in every feature tier)."""
        return self.feature_cache.stats.encoder_runs

    @property
    def hybrid(self) -> bool:
        """Whether recurrent (Gated DeltaNet) layers sit between the attention layers."""
        return self._fa_idx is not None

    @property
    def layers(self) -> list[Any]:
        return self.lm.model.layers

    def parameters(self) -> Any:
        return self.vlm.parameters()

    def make_cache(self) -> list[Any]:
        """mlx-lm's cache classes, which the cache tiers know: K/V for attention layers,
        ArraysCache (conv window and recurrent state) for Gated DeltaNet layers."""
        from ..kv import ArraysCache, KVCache

        if not self.hybrid:
            return [KVCache() for _ in self.layers]
        return [ArraysCache(size=2) if layer.is_linear else KVCache() for layer in self.layers]

    def _forward(self, cache: Any, **kw: Any) -> mx.array:
        if not self.hybrid or not cache:
            return self.lm(cache=cache, **kw).logits
        view = _vlm_view(cache)
        logits = self.lm(cache=view, **kw).logits
        _write_back(cache, view)
        return logits

    def __call__(
        self, inputs: mx.array, cache: Any = None, rope_deltas: list[int] | None = None
    ) -> mx.array:
        """Logits for `inputs` (B, L) following `cache`: text positions, each row shifted by
        its prompt's RoPE delta (0 for a prompt without images)."""
        batch, length = inputs.shape
        offset = cache[self._fa_idx or 0].offset if cache else 0
        if isinstance(offset, mx.array) and offset.ndim > 0:
            start = offset.reshape(-1, 1)
        else:
            start = mx.full((batch, 1), int(offset))
        if rope_deltas is not None and any(rope_deltas):
            start = start + mx.array(rope_deltas).reshape(-1, 1)
        pos = start + mx.arange(length)[None]
        positions = mx.broadcast_to(pos[None], (3, batch, length))
        return self._forward(cache, inputs=inputs, position_ids=positions)

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
            feats = self.features(image, prompt.tenant)
            pieces.append(feats[lo - image.start : hi - image.start].astype(embed.weight.dtype))
            cursor = hi
        if cursor < end:
            pieces.append(embed(mx.array(prompt.model_tokens[cursor:end])))
        h = mx.concatenate(pieces, axis=0)[None] if len(pieces) > 1 else pieces[0][None]
        positions = mx.array(prompt.positions[:, start:end].astype(np.int32))[:, None, :]
        return self._forward(
            cache, inputs=mx.array(ids)[None], inputs_embeds=h, position_ids=positions
        )

    def features(self, image: Any, tenant: str = "default") -> mx.array:
        """The vision tower's output for `image`, from the feature cache when it is there."""
        hit = self.feature_cache.get(tenant, image.digest)
        if hit is not None:
            assert hit.shape[0] == image.n_tokens, (hit.shape, image.n_tokens)
            return hit
        tower = self.vlm.vision_tower
        dtype = tower.patch_embed.proj.weight.dtype
        pixels = mx.array(image.pixel_values)
        if pixels.dtype == mx.uint16:  # bfloat16 bits (vision_prompt.narrow)
            pixels = pixels.view(mx.bfloat16)
        feats = tower(
            pixels.astype(dtype),
            mx.array([list(image.grid_thw)]),
            output_hidden_states=False,
        )
        if isinstance(feats, tuple):  # Qwen3-VL's tower: (features, deepstack features)
            feats = feats[0]
        mx.eval(feats)
        assert feats.shape[0] == image.n_tokens, (feats.shape, image.n_tokens)
        self.feature_cache.put(tenant, image.digest, feats)
        return feats


def _vlm_view(cache: list[Any]) -> list[Any]:
    """`cache` with each mlx-lm ArraysCache as mlx-vlm's (the same arrays), whose causal
    window and recurrent updates mlx-vlm's Gated DeltaNet layers call; K/V caches as is."""
    from mlx_vlm.models.cache import ArraysCache as VlmArraysCache

    from ..kv import ArraysCache

    view = []
    for c in cache:
        if type(c) is ArraysCache:
            v = VlmArraysCache(len(c.cache))
            v.cache = list(c.cache)
            if c.left_padding is not None:
                v.left_padding = c.left_padding
            if c.lengths is not None:
                v.lengths = c.lengths
            c = v
        view.append(c)
    return view


def _write_back(cache: list[Any], view: list[Any]) -> None:
    """Carry the states a forward pass left in `view` back into the mlx-lm caches."""
    from ..kv import ArraysCache

    for i, (c, v) in enumerate(zip(cache, view, strict=True)):
        if type(c) is ArraysCache:
            c.cache = list(v.cache)
            c.left_padding = v.left_padding
            c.lengths = v.lengths
        elif v is not c:  # the model replaced a batch cache (its row-wise path)
            cache[i] = v
