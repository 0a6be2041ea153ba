"""The bench's vision scenario (issue 13) runs end to end at its quick size."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("mlx_vlm")

from tests.conftest import REPO  # noqa: E402


def test_vision_scenario_hits_after_the_image_and_matches_no_cache(tmp_path, demo_root):
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "proxy.cli", "bench", "--quick", "--model", "demo-llama",
           "--scenarios", "vision", "--out", str(out),
           "--models-dir", str(demo_root / "models")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    (scenario,) = json.loads((out / "results.json").read_text())["scenarios"]
    assert (scenario["scenario"], scenario["model"], scenario["errors"]) == (
        "vision",
        "demo-vision",
        [],
    )
    assert scenario["metrics"]["greedy_outputs_equal_ours_vs_nocache"] == 1.0
    # mlx-vlm's own server decodes the same greedy tokens (its detokenizer keeps a reply's
    # leading space, mlx-lm's drops it).
    assert scenario["metrics"]["greedy_outputs_equal_ours_vs_mlx_vlm_but_a_leading_space"] == 1.0
    ours = [s for s in scenario["samples"] if s["server"] == "ours"]
    nocache = [s for s in scenario["samples"] if s["server"] == "nocache"]
    # mlx-vlm's own server gets the same requests (its prefix cache on).
    vlm = [s for s in scenario["samples"] if s["server"] == "mlx_vlm"]
    assert len(ours) == len(nocache) == len(vlm) == 4
    assert all(s["ok"] for s in ours + nocache + vlm)
    assert all(s["prompt_tokens"] == o["prompt_tokens"] for s, o in zip(vlm, ours, strict=True))
    # From turn 3 on, everything up to the previous turn's prompt (image included) is cached.
    for prev, cur in zip(ours[1:], ours[2:], strict=False):
        assert cur["cached_tokens"] >= prev["prompt_tokens"] - 1
    assert all(s["cached_tokens"] == 0 for s in nocache)
    assert [r["metric"] for r in scenario["rows"]][:3] == [
        "mean TTFT of turns 3..4, after the image (s)",
        "TTFT of turn 1 (s)",
        "TTFT of turn 2 (image) (s)",
    ]
