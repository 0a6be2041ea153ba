"""`mlx-prompt-cache doctor`, run as the CLI runs, against a fake LM Studio (its documented
REST shapes) and with no server of ours at the configured port."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from engine_bridge.models.preflight import weights_bytes
from engine_bridge.ops.blas import cpu_blas
from proxy.doctor import EXTRAS, PROGRAMS
from tests.conftest import REPO, free_port
from tests.support.fake_lmstudio import FakeLmStudio, FakeModel, lmstudio_model_folder

GB = 1 << 30


def _config(tmp_path: Path, upstream: str, serve: list[str], lmstudio_dir: Path) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(
        f'[upstream]\nurl = "{upstream}"\n'
        f"[models]\nserve = {json.dumps(serve)}\nlmstudio_dirs = {json.dumps([str(lmstudio_dir)])}\n"
        f'[engine]\nkv_memory = "4GB"\n'
        f'[cache.ram]\nbudget = "8GB"\n'
        f'[cache.ssd]\ndir = "{tmp_path / "cache"}"\n'
    )
    return path


def _doctor(config: Path, *flags: str) -> subprocess.CompletedProcess:
    # A port nothing listens on: no server of ours is running.
    env = {**os.environ, "MLX_PROMPT_CACHE_SERVER_PORT": str(free_port())}
    cmd = [sys.executable, "-m", "proxy.cli", "doctor", "--config", str(config), *flags]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_doctor_reports_what_lm_studio_holds_the_memory_figures_and_the_extras(demo_root, tmp_path):
    root, folder = lmstudio_model_folder(demo_root, tmp_path)
    models = [
        FakeModel("tiny-llama-mlx", "acme", 20 * GB, ["tiny-llama-mlx"]),
        FakeModel("qwen/qwen3-8b", "qwen", 5 * GB, [], format="gguf"),
    ]
    with FakeLmStudio(models) as fake:
        config = _config(tmp_path, fake.url, [str(folder), "demo-llama"], root)
        text = _doctor(config)
        as_json = _doctor(config, "--json")
    assert text.returncode == 0, text.stderr
    out = text.stdout
    assert "Served in-process (server at http://127.0.0.1:" in out and ": not running)" in out
    assert "  acme/tiny-llama-mlx  configured" in out
    assert "  demo-llama           configured" in out
    assert f"LM Studio at {fake.url} (REST API v1)" in out
    assert (
        "  tiny-llama-mlx  loaded as tiny-llama-mlx  20.0 GB"
        "  also served here as acme/tiny-llama-mlx: two copies"
    ) in out
    assert "qwen/qwen3-8b" not in out  # known to LM Studio, not loaded
    assert " GB total, " in out and " GB available" in out
    assert "  RAM tier budget  8GB\n" in out
    assert "  K/V memory       4GB\n" in out
    assert "  kept free        5% (" in out and " GB of all RAM)\n" in out
    for name in EXTRAS:
        assert f"\n  {name:11} " in out
    for name in PROGRAMS:
        assert f"\n  {name:17} " in out

    assert as_json.returncode == 0, as_json.stderr
    report = json.loads(as_json.stdout)
    assert report["server"]["running"] is False
    ours = report["models"][0]
    assert (ours["id"], ours["path"], ours["loaded"]) == ("acme/tiny-llama-mlx", str(folder), None)
    assert ours["weights_bytes"] == weights_bytes(folder) > 0
    assert report["lmstudio"]["reachable"] and report["lmstudio"]["api"] == "v1"
    assert report["lmstudio"]["loaded"] == [
        {
            "key": "tiny-llama-mlx",
            "instances": ["tiny-llama-mlx"],
            "size_bytes": 20 * GB,
            "format": "mlx",
            "type": "llm",
            "also_served_here": ["acme/tiny-llama-mlx"],
        }
    ]
    memory = report["memory"]
    assert memory["ram_budget_bytes"] == 8 * 1000**3 and memory["kv_memory_bytes"] == 4 * 1000**3
    assert 0 < memory["available_bytes"] <= memory["total_bytes"]
    assert set(report["extras"]) == set(EXTRAS)
    assert all(isinstance(v, bool) for v in report["extras"].values())
    assert set(report["programs"]) == set(PROGRAMS)
    blas = cpu_blas()  # the doctor ran in this environment
    assert report["cpu_blas"] == {"name": blas.name, "advice": blas.advice()}
    assert f"\nMLX's CPU BLAS: {blas.name}\n" in out + "\n"


def test_doctor_says_lm_studio_is_unreachable_and_still_exits_0(demo_root, tmp_path):
    root, folder = lmstudio_model_folder(demo_root, tmp_path)
    done = _doctor(_config(tmp_path, "http://127.0.0.1:9", [str(folder)], root))
    assert done.returncode == 0, done.stderr
    assert "LM Studio: unreachable at http://127.0.0.1:9 (" in done.stdout
    assert "Memory\n" in done.stdout and "Optional extras" in done.stdout
