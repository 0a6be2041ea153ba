"""Find models in LM Studio's models folder without loading them.

An MLX model is a folder with `config.json` and safetensors weights; a folder with GGUF
files belongs to LM Studio's own engine and stays with the upstream. The id is the path
relative to the models root (`publisher/model`), which is LM Studio's model key, so a
client's existing model name keeps working through the proxy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..kv import CacheKind
from ..vision.prompt import vision_status

Format = Literal["mlx", "gguf"]

DEFAULT_LMSTUDIO_DIRS = ("~/.lmstudio/models", "~/.cache/lm-studio/models")

# Architectures whose cache holds recurrent (SSM / linear attention) state.
_HYBRID_TYPES = {
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_moe",
    "mamba",
    "mamba2",
    "jamba",
    "nemotron_h",
    "falcon_h1",
    "granitemoehybrid",
    "lfm2",
    "lfm2_moe",
    "plamo2",
    "kimi_linear",
    "bailing_hybrid",
    "olmo_hybrid",
    "recurrent_gemma",
    "rwkv7",
}
# Architectures mlx-lm gives a rotating (sliding window) cache on some layers.
_SLIDING_TYPES = {"gemma2", "gemma3", "gemma3_text", "gemma3n", "gpt_oss", "cohere2", "exaone4"}


@dataclass(frozen=True, slots=True)
class FoundModel:
    id: str
    path: Path
    format: Format
    architecture: str
    cache_kind: CacheKind
    size_bytes: int
    # Whether it can see images here (vision_prompt.vision_status).
    vision: str = "no"


def cache_kind_from_config(config: dict[str, Any]) -> CacheKind:
    """What the cache will be, told from config.json before loading (kv.layout is exact)."""
    text = config.get("text_config") or {}
    model_type = str(config.get("model_type") or text.get("model_type") or "")
    layer_types = config.get("layer_types") or text.get("layer_types") or []
    kinds = {str(t) for t in layer_types}
    if model_type in _HYBRID_TYPES or kinds & {"linear_attention", "mamba", "mamba2"}:
        return CacheKind.HYBRID
    if model_type in _SLIDING_TYPES or "sliding_attention" in kinds:
        return CacheKind.SLIDING
    return CacheKind.PLAIN


def scan(roots: list[Path], max_depth: int = 3) -> list[FoundModel]:
    """Every MLX or GGUF model folder under the roots (first root wins on equal ids)."""
    found: dict[str, FoundModel] = {}
    for root in roots:
        root = root.expanduser()
        if not root.is_dir():
            continue
        for folder in _folders(root, max_depth):
            model = _inspect(root, folder)
            if model is not None and model.id not in found:
                found[model.id] = model
    return sorted(found.values(), key=lambda m: m.id)


def _folders(root: Path, max_depth: int) -> list[Path]:
    out = []
    frontier = [root]
    for _ in range(max_depth):
        nxt = []
        for d in frontier:
            try:
                children = [c for c in d.iterdir() if c.is_dir() and not c.name.startswith(".")]
            except OSError:
                continue
            out.extend(children)
            nxt.extend(children)
        frontier = nxt
    return out


def _inspect(root: Path, folder: Path) -> FoundModel | None:
    try:
        files = [f for f in folder.iterdir() if f.is_file()]
    except OSError:
        return None
    model_id = str(folder.relative_to(root))
    weights = [f for f in files if f.suffix == ".safetensors"]
    ggufs = [f for f in files if f.suffix == ".gguf"]
    if (folder / "config.json").is_file() and weights:
        try:
            config = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError):
            config = {}
        text = config.get("text_config") or {}
        arch = str(config.get("model_type") or text.get("model_type") or "unknown")
        size = sum(f.stat().st_size for f in weights)
        kind = cache_kind_from_config(config)
        return FoundModel(model_id, folder, "mlx", arch, kind, size, vision_status(config))
    if ggufs:
        size = sum(f.stat().st_size for f in ggufs)
        return FoundModel(model_id, folder, "gguf", "gguf", CacheKind.UNKNOWN, size)
    return None
