"""Find and load models: built-in demo ids, local MLX directories, LM Studio model keys.

A loaded model carries a fingerprint (weights, config and tokenizer identity plus the
mlx-lm version) that the prompt cache keys every block on, so a changed model can never
be served state computed by another.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
from mlx_lm.utils import load as mlx_load
from mlx_lm.utils import load_model, load_tokenizer

from .. import kv
from ..distributed.shard import NotShardable, load_split, refusal
from ..distributed.world import ALONE, World
from ..prompting.output_format import OutputFormat
from ..prompting.prefix_memo import PrefixMemo
from ..types import EngineError
from ..vision import model as vision
from . import demo
from .mtp_head import MTPSource, has_head

log = logging.getLogger("engine_bridge.models.loading")


# Files whose bytes define the tokenizer and chat template.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    # How images become pixels, which their cache keys are digests of.
    "preprocessor_config.json",
)
# How much of each weight file's data is sampled into the fingerprint: hashing all of a
# 20 GB model at every start would cost minutes; header + ends + size catches re-quantized
# or replaced weights, which is what the fingerprint is for.
_SAMPLE_BYTES = 1 << 20


@dataclass(slots=True)
class ModelRef:
    """Where a model id resolves to on disk, before it is loaded."""

    id: str
    path: Path
    is_demo: bool = False


@dataclass(slots=True, weakref_slot=True)  # tests watch an unloaded model die
class LoadedModel:
    id: str
    path: Path
    model: Any
    tokenizer: Any
    config: dict[str, Any]
    fingerprint: str
    context_length: int
    cache_kind: kv.CacheKind
    load_s: float
    # Rendered message prefixes, so a conversation's next turn renders only its new ones.
    prefixes: PrefixMemo = field(default_factory=PrefixMemo, repr=False)
    # Set when the model loaded with its vision tower (mlx-vlm): it is also `model`.
    vision: vision.VisionModel | None = None
    # The config names a vision tower, whether or not it loaded with it.
    has_vision_tower: bool = False
    # Its reasoning and tool-call markup, as mlx-lm infers it from the tokenizer.
    output_format: OutputFormat = field(default_factory=OutputFormat)
    # Its multi-token-prediction head (Qwen3.5/3.6 `mtp.*` weights), read on first use;
    # None where the checkpoint has none.
    mtp: MTPSource | None = None


def chat_template_text(path: Path) -> str:
    """The chat template a model directory ships ("" when none is found): its
    chat_template.jinja, else tokenizer_config.json's (a string, or the "default" one)."""
    jinja = path / "chat_template.jinja"
    try:
        if jinja.is_file():
            return jinja.read_text(encoding="utf-8")
        config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ""
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else ""


def resolve(spec: str, cache_dir: Path, lmstudio_dirs: list[Path]) -> ModelRef:
    """Turn a demo id, a directory path or an LM Studio key into a model directory."""
    if demo.is_demo_model(spec):
        return ModelRef(id=spec, path=demo.ensure_demo_model(spec, cache_dir), is_demo=True)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise EngineError(f"model directory {path} has no config.json", field="model")
        return ModelRef(id=_id_for_path(path.resolve(), lmstudio_dirs), path=path.resolve())
    for root in lmstudio_dirs:
        candidate = root.expanduser() / spec
        if (candidate / "config.json").is_file():
            return ModelRef(id=spec, path=candidate.resolve())
    looked = ", ".join(str(d.expanduser()) for d in lmstudio_dirs)
    raise EngineError(
        f"model {spec!r} is not a demo model, a directory, or an LM Studio key under {looked}",
        field="model",
        status=404,
    )


def _id_for_path(path: Path, lmstudio_dirs: list[Path]) -> str:
    # A model inside LM Studio's folder keeps LM Studio's key, so clients' names still work.
    for root in lmstudio_dirs:
        try:
            return str(path.relative_to(root.expanduser().resolve()))
        except ValueError:
            continue
    return path.name


def check_split(ref: ModelRef, world: World) -> None:
    """Refuse, naming it, a model this world cannot split (a vision model, or a class with
    no split of the asked kind): at start, so that no request finds it out. The model is
    built lazily, so no weight is read."""
    config = json.loads((ref.path / "config.json").read_text(encoding="utf-8"))
    if vision.can_load(config):
        raise EngineError(f"{ref.id} is a vision model, which runs on one rank only")
    model, _ = load_model(ref.path, lazy=True)
    if (why := refusal(model, world)) is not None:
        raise EngineError(f"{ref.id}: {why}", field="model")


def load(ref: ModelRef, world: World = ALONE) -> LoadedModel:
    """Load `ref`; in a world of several ranks, only this rank's part of its weights."""
    start = time.perf_counter()
    config = json.loads((ref.path / "config.json").read_text(encoding="utf-8"))
    seeing = None
    if vision.can_load(config):
        if not world.alone:
            raise EngineError(
                f"{ref.id} is a vision model, which runs on one rank only", status=503
            )
        seeing, config = vision.load(ref.path)
        model, tokenizer = seeing, load_tokenizer(ref.path)
    elif not world.alone:
        try:
            model, config = load_split(ref.path, world)
        except NotShardable as e:
            raise EngineError(f"{ref.id}: {e}", field="model", status=503) from e
        tokenizer = load_tokenizer(ref.path, eos_token_ids=config.get("eos_token_id"))
    else:
        model, tokenizer, config = mlx_load(str(ref.path), return_config=True)
    load_s = time.perf_counter() - start
    loaded = LoadedModel(
        id=ref.id,
        path=ref.path,
        model=model,
        tokenizer=tokenizer,
        config=config,
        fingerprint=world.fingerprint(fingerprint(ref.path)),
        context_length=context_length(config),
        cache_kind=cache_kind(model),
        load_s=load_s,
        vision=seeing,
        has_vision_tower=vision.has_vision_tower(config),
        output_format=OutputFormat.of(tokenizer, model=ref.id),
        # The MTP head is not split: a world of several ranks decodes without it.
        mtp=MTPSource(ref.path, config)
        if seeing is None and world.alone and has_head(ref.path, config)
        else None,
    )
    log.info(
        "loaded model %s from %s in %.2fs (kind=%s, context=%d, fingerprint=%s, "
        "tool calls=%s, reasoning=%s, mtp head=%s)",
        loaded.id,
        loaded.path,
        load_s,
        loaded.cache_kind,
        loaded.context_length,
        loaded.fingerprint[:12],
        loaded.output_format.family or "none",
        loaded.output_format.think_start
        or ("channels" if loaded.output_format.harmony else "none"),
        "yes" if loaded.mtp is not None else "no",
    )
    return loaded


def fingerprint(path: Path) -> str:
    """A stable identity of weights, config, tokenizer and the mlx-lm version (and
    mlx-vlm's, when the model runs through it: its text model computes differently)."""
    h = hashlib.sha256()
    h.update(b"mlx-prompt-cache-fingerprint-v1\0")
    h.update(f"mlx-lm={mlx_lm.__version__};mlx={mx.__version__}\0".encode())
    if vision.can_load(json.loads((path / "config.json").read_text(encoding="utf-8"))):
        h.update(f"mlx-vlm={vision.mlx_vlm_version()}\0".encode())
    h.update(_file_digest(path / "config.json"))
    for name in _TOKENIZER_FILES:
        if (path / name).is_file():
            h.update(name.encode() + b"\0" + _file_digest(path / name))
    for weights in sorted(path.glob("*.safetensors")):
        h.update(weights.name.encode() + b"\0" + _weights_digest(weights))
    return h.hexdigest()[:32]


def _file_digest(path: Path) -> bytes:
    return hashlib.sha256(path.read_bytes()).digest()


def _weights_digest(path: Path) -> bytes:
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(struct.pack("<Q", size))
    with path.open("rb") as f:
        header_len = struct.unpack("<Q", f.read(8))[0]
        h.update(f.read(min(header_len, 16 << 20)))
        h.update(f.read(_SAMPLE_BYTES))
        if size > 2 * _SAMPLE_BYTES:
            f.seek(size - _SAMPLE_BYTES)
            h.update(f.read(_SAMPLE_BYTES))
    return h.digest()


def context_length(config: dict[str, Any]) -> int:
    text = config.get("text_config") or {}
    for key in ("max_position_embeddings", "max_seq_len", "n_positions", "seq_length"):
        value = config.get(key) or text.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return 32768


def cache_kind(model: Any) -> kv.CacheKind:
    """From the cache classes mlx-lm gives the loaded model (kv.layout classifies them)."""
    try:
        return kv.layout(kv.make_prompt_cache(model)).cache_kind
    except kv.UnsupportedCacheError:
        return kv.CacheKind.UNKNOWN
