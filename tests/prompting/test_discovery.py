"""LM Studio's models folder: MLX folders are found and served by their LM Studio key."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import httpx

from engine_bridge.models import loading as models
from engine_bridge.models.discovery import scan
from tests.conftest import REPO, fresh_cache_dir, start_server


def _fake_lmstudio(demo_root, root):
    for name, publisher in (("demo-llama", "acme"), ("demo-hybrid", "acme"), ("demo-swa", "other")):
        shutil.copytree(demo_root / "models" / name, root / publisher / f"{name}-mlx")
    gguf = root / "lmstudio-community" / "Qwen3-8B-GGUF"
    gguf.mkdir(parents=True)
    (gguf / "Qwen3-8B-Q4_K_M.gguf").write_bytes(b"GGUF" + b"\0" * 64)
    (root / "empty" / "nothing").mkdir(parents=True)
    return root


def test_scan_finds_mlx_and_gguf_folders_with_cache_kinds(demo_root, tmp_path):
    root = _fake_lmstudio(demo_root, tmp_path / "models")
    found = {m.id: m for m in scan([root])}
    assert set(found) == {
        "acme/demo-llama-mlx",
        "acme/demo-hybrid-mlx",
        "other/demo-swa-mlx",
        "lmstudio-community/Qwen3-8B-GGUF",
    }
    assert found["acme/demo-llama-mlx"].format == "mlx"
    assert (found["acme/demo-llama-mlx"].architecture, found["acme/demo-llama-mlx"].cache_kind) == (
        "llama",
        "plain",
    )
    assert found["acme/demo-hybrid-mlx"].cache_kind == "hybrid"
    assert found["other/demo-swa-mlx"].cache_kind == "sliding"
    assert found["lmstudio-community/Qwen3-8B-GGUF"].format == "gguf"


def test_config_prediction_agrees_with_the_loaded_cache_classes(demo_root, tmp_path):
    root = _fake_lmstudio(demo_root, tmp_path / "models")
    for found in scan([root]):
        if found.format == "mlx":
            loaded = models.load(models.ModelRef(found.id, found.path))
            assert (found.id, found.cache_kind) == (found.id, loaded.cache_kind)


def test_models_command_lists_what_is_served_where(demo_root, tmp_path):
    root = _fake_lmstudio(demo_root, tmp_path / "models")
    config = tmp_path / "config.toml"
    config.write_text(f'[models]\nserve = ["acme/demo-llama-mlx"]\nlmstudio_dirs = ["{root}"]\n')
    out = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "models", "--config", str(config), "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = {r["id"]: r for r in map(json.loads, out.splitlines())}
    assert rows["acme/demo-llama-mlx"]["served"] == "local"
    assert rows["acme/demo-hybrid-mlx"]["served"] == "not served"
    assert rows["lmstudio-community/Qwen3-8B-GGUF"]["served"] == "upstream"
    assert rows["other/demo-swa-mlx"]["cache"] == "sliding"


def test_serve_all_mlx_serves_models_under_their_lmstudio_keys(demo_root, tmp_path):
    root = _fake_lmstudio(demo_root, tmp_path / "models")
    config = tmp_path / "config.toml"
    config.write_text(f'[models]\nserve_all_mlx = true\nlmstudio_dirs = ["{root}"]\n')
    s = start_server(
        fresh_cache_dir(demo_root, tmp_path / "cache"),
        "--config",
        str(config),
        "--upstream",
        "http://127.0.0.1:9",
    )
    try:
        ids = [m["id"] for m in httpx.get(s.url + "/v1/models", timeout=30).json()["data"]]
        assert ids == ["acme/demo-hybrid-mlx", "acme/demo-llama-mlx", "other/demo-swa-mlx"]
        r = httpx.post(
            s.url + "/v1/chat/completions",
            json={
                "model": "acme/demo-llama-mlx",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
            },
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
    finally:
        s.stop()
