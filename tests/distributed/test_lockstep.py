"""The engine serving a split model: rank 0 takes requests through `Engine.start`, the
other rank follows its steps (scheduling/lockstep.py), and greedy answers equal the whole
model's alone, for one request, three batched with one cut off by its client, and one
after (issue 34)."""

from __future__ import annotations

import json
import subprocess

import pytest

from engine_bridge.distributed.launch import Ranks, command
from tests.conftest import QWEN36, REPO, free_ports


@pytest.mark.parametrize(
    ("model", "mode"), [("demo-hybrid", "tensor"), (QWEN36, "pipeline"), ("demo-llama", "tensor")]
)
def test_a_split_engine_answers_as_the_whole_model_does(demo_root, tmp_path, model, mode):
    argv = ["-m", "tests.support.distributed_engine", str(tmp_path), str(demo_root), mode, model]
    ranks = Ranks(count=2, port=free_ports(2))  # apart from another world running at once
    done = subprocess.run(
        command(ranks, argv), cwd=REPO, capture_output=True, text=True, timeout=600
    )
    seen = done.stdout[-3000:] + done.stderr[-3000:]
    # mlx.launch can exit 0 when a rank failed: rank 0's answers are the proof it ran.
    assert done.returncode == 0 and (tmp_path / "answers.json").exists(), seen
    answers = json.loads((tmp_path / "answers.json").read_text())
    assert len(answers["split"]) == 5 and all(answers["split"])
    assert answers["split"] == answers["whole"]
    # Sampled without a seed, every rank drew the same tokens (rank 0 seeds each request).
    assert answers["ranks_agree"] and all(answers["sampled"])
