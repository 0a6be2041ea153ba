"""Build a demo model directory once, atomically, under a cross-process file lock."""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from . import qwen36, specs, tokenizer

logger = logging.getLogger("engine_bridge.models.demo.build")

# Bump when the build changes in a way the inputs hashed below do not capture.
RECIPE_VERSION = 1
MARKER = "demo_build.json"
MODEL_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


def recipe_digest(name: str) -> str:
    """Digest of everything a build of `name` depends on; a stale build is rebuilt."""
    h = hashlib.sha256(f"{RECIPE_VERSION}/{name}".encode())
    if name in specs.QWEN36_DEMO_IDS:
        # The real vocabulary: the demo corpus plays no part.
        h.update(qwen36.recipe_inputs(name))
        return h.hexdigest()
    h.update(tokenizer.corpus_bytes())
    if name in specs.VISION_DEMO_IDS:
        h.update(tokenizer.chat_template().encode("utf-8"))
        h.update(_vision_demo_module(name).recipe_inputs())
    else:
        # The template this model ships: a changed or swapped template rebuilds it.
        h.update(tokenizer.chat_template(specs.chat_template_file(name)).encode("utf-8"))
        h.update(json.dumps(specs.model_config(name, 0, 0), sort_keys=True).encode())
    return h.hexdigest()


def _vision_demo_module(name: str) -> Any:
    """The module that builds vision demo `name` (demo/vision.py or demo/vision_hybrid.py)."""
    if name == "demo-vision-hybrid":
        from . import vision_hybrid

        return vision_hybrid
    from . import vision

    return vision


def ensure_demo_model(name: str, root: Path) -> Path:
    """Return `root/models/name`, building it first if it is missing or stale."""
    if not specs.is_demo_model(name):
        raise ValueError(
            f"unknown demo model {name!r}; valid ids: {', '.join(specs.ALL_DEMO_IDS)}"
        )
    models_dir = Path(root).expanduser() / "models"
    final = models_dir / name
    digest = recipe_digest(name)
    if _is_complete(final, digest):
        return final
    models_dir.mkdir(parents=True, exist_ok=True)
    with open(models_dir / f".{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            # Another process may have finished the build while we waited.
            if not _is_complete(final, digest):
                _sweep_leftovers(models_dir, name)
                _build_and_publish(name, final, digest)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return final


def _is_complete(path: Path, digest: str) -> bool:
    # The marker is written last, inside the temp dir, and the dir appears by rename:
    # a marker with the right digest means every file beside it is whole.
    try:
        marker = json.loads((path / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return marker.get("recipe") == digest


def _sweep_leftovers(models_dir: Path, name: str) -> None:
    # Only the lock holder builds, so any temp dir of this name is from a crashed build.
    for stale in models_dir.glob(f".{name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _build_and_publish(name: str, final: Path, digest: str) -> None:
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=final.parent))
    try:
        write_model_files(name, tmp)
        _write_json(tmp / MARKER, {"id": name, "recipe": digest})
        # mkdtemp makes the dir private; the model is as readable as any other download.
        os.chmod(tmp, 0o755)
        for child in tmp.iterdir():
            os.chmod(child, 0o644)
            _fsync(child)
        if final.exists():
            # A stale or incomplete build: move it aside, swap, then delete it.
            old = final.with_name(f".{name}.tmp-old-{os.getpid()}")
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("built demo model %s in %.2fs at %s", name, time.perf_counter() - start, final)


def write_model_files(name: str, out: Path) -> None:
    """Write every file of demo model `name` into the existing directory `out`."""
    if name in specs.VISION_DEMO_IDS:
        _vision_demo_module(name).write_model_files(out)
        return
    if name in specs.QWEN36_DEMO_IDS:
        qwen36.write_model_files(name, out)
        return
    # mlx is imported here, not at module top, so the fast path stays cheap.
    from . import weights

    tok = tokenizer.train_tokenizer()
    eos_id = tok.token_to_id(tokenizer.EOS_TOKEN)
    config = specs.model_config(name, tok.get_vocab_size(with_added_tokens=True), eos_id)
    muted = sorted(tok.token_to_id(t) for t in tokenizer.SPECIAL_TOKENS)
    weights.save_weights(weights.random_weights(config, muted), out / "model.safetensors")
    template = tokenizer.chat_template(specs.chat_template_file(name))
    tokenizer.write_tokenizer_files(tok, out, template)
    _write_json(out / "config.json", config)


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
