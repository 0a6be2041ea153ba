"""One model split across two ranks over loopback (mx.distributed's ring backend), loaded
through the engine's own loader: the split model computes what the whole one does, to
float tolerance split by heads (tensor) and exactly split by layers (pipeline), and a
model mlx-lm cannot split is refused with its name (issue 34)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from engine_bridge.distributed.launch import LaunchError, Ranks, command
from engine_bridge.distributed.world import ALONE, Mode, World
from tests.conftest import QWEN36, REPO, free_ports

MODELS = ("demo-llama", "demo-hybrid", QWEN36)
# mlx-lm 0.32.2 gives llama no `pipeline`: split by layers, only the Qwen3.5/3.6 models.
SPLITS = {"tensor": MODELS, "pipeline": ("demo-hybrid", QWEN36)}
# mlx-lm cannot split demo-swa (gemma3_text) by heads: the tensor world is refused it
# first, and loads the others after the refusal.
REFUSED = "demo-swa"
# Each mode's world loads these, in this order: one launch per mode.
WORLD_MODELS = {"tensor": (REFUSED, *MODELS), "pipeline": MODELS}
# Split by heads, a sum of partial products meets in an all_sum: float32 reassociation.
TENSOR_TOLERANCE = 1e-4


def _ranks(tmp_path: Path, demo_root: Path, mode: str, models: tuple[str, ...]) -> list[dict]:
    out = tmp_path / mode
    out.mkdir()
    argv = ["-m", "tests.support.distributed_rank", str(out), str(demo_root), mode, *models]
    ranks = Ranks(count=2, port=free_ports(2))  # apart from another world running at once
    done = subprocess.run(
        command(ranks, argv), cwd=REPO, capture_output=True, text=True, timeout=600
    )
    seen = done.stdout[-3000:] + done.stderr[-3000:]
    # mlx.launch can exit 0 when a rank failed: each rank's report is the proof it ran.
    assert done.returncode == 0 and all((out / f"rank{r}.json").exists() for r in range(2)), seen
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def world(demo_root, tmp_path_factory):
    """Each mode's ranks' reports, from one launch per mode, shared by the tests below."""
    reports: dict[str, list[dict]] = {}

    def ranks(mode: str) -> list[dict]:
        if mode not in reports:
            tmp = tmp_path_factory.mktemp(f"world-{mode}")
            reports[mode] = _ranks(tmp, demo_root, mode, WORLD_MODELS[mode])
        return reports[mode]

    return ranks


@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_a_split_model_computes_what_the_whole_one_does(world, mode):
    ranks = world(mode)
    assert [r["rank"] for r in ranks] == [0, 1] and {r["size"] for r in ranks} == {2}
    for model in SPLITS[mode]:
        seen = [r["models"][model] for r in ranks]
        for s in seen:
            assert s["tokens"] == s["whole_tokens"], (mode, model)
            if mode == "pipeline":
                assert s["max_abs_diff"] == 0.0, (mode, model)
            else:
                assert s["max_abs_diff"] <= TENSOR_TOLERANCE, (mode, model, s["max_abs_diff"])
            # Each rank keeps only its part of the weights.
            assert s["weight_bytes"] < s["whole_weight_bytes"], (mode, model)
        assert seen[0]["tokens"] == seen[1]["tokens"]
        # Each rank's slices are keyed apart from the other rank's and the whole model's.
        prints = {s["fingerprint"] for s in seen} | {seen[0]["whole_fingerprint"]}
        assert len(prints) == 3 and seen[0]["whole_fingerprint"] == seen[1]["whole_fingerprint"]
        for rank, s in enumerate(seen):  # named by the layout, so tensor and pipeline differ too
            part = World(None, rank, 2, Mode(mode))
            assert s["fingerprint"] == part.fingerprint(s["whole_fingerprint"])
            other = World(None, rank, 2, Mode.PIPELINE if mode == "tensor" else Mode.TENSOR)
            assert s["fingerprint"] != other.fingerprint(s["whole_fingerprint"])
    # Rank 0's decision reaches every rank, and every rank gets the least of their offers.
    models = list(WORLD_MODELS[mode])
    assert [r["shared"] for r in ranks] == [{"from": "rank 0", "models": models}] * 2
    assert [r["least"] for r in ranks] == [10, 10]
    # Every rank resumes at the deepest point all of them hold, never one only some have.
    assert [r["common"] for r in ranks] == [[192, 64, 0]] * 2


def test_a_model_mlx_lm_cannot_split_is_refused_with_its_name(world):
    for r in world("tensor"):
        refused = r["models"][REFUSED]
        assert refused["status"] == 503
        assert (
            "gemma3_text.Model cannot be split in tensor mode across 2 ranks" in refused["refused"]
        )


def test_a_process_alone_keeps_the_whole_models_fingerprint():
    """A single Mac's cache stays valid: only a split renames what it stores."""
    assert ALONE.alone and ALONE.fingerprint("f" * 32) == "f" * 32


def test_the_launcher_refuses_what_cannot_start_a_world(tmp_path):
    with pytest.raises(LaunchError, match="--ranks must be 2 or more"):
        command(Ranks(count=1), ["-m", "x"])
    bad = tmp_path / "hosts.json"
    bad.write_text('[{"ips": ["10.0.0.2"]}]')
    with pytest.raises(LaunchError, match='host 0 has no "ssh" name'):
        command(Ranks(hostfile=bad), ["-m", "x"])
    bad.write_text("{not json")
    with pytest.raises(LaunchError, match="not JSON"):
        command(Ranks(hostfile=bad), ["-m", "x"])
    good = tmp_path / "two.json"
    good.write_text(json.dumps([{"ssh": "mini-a", "ips": ["10.0.0.1"]}, {"ssh": "mini-b"}]))
    argv = command(Ranks(hostfile=good), ["-m", "x"])
    assert argv[:7] == [sys.executable, "-m", "engine_bridge.distributed.quiet_launch",
                        "--backend", "ring", "--hostfile", str(good)]  # fmt: skip
    local = command(Ranks(count=2, port=40100), ["-m", "x"])
    assert local[5:11] == ["-n", "2", "--hosts", "127.0.0.1", "--starting-port", "40100"]
    assert argv[-3:] == ["--", "-m", "x"] and Ranks(hostfile=good).size() == 2


def test_the_launcher_waits_for_its_ranks_output_where_mlx_launch_spins_a_core():
    """mlx.launch's relay asks `select` whether each rank's stdin is writable with nothing
    to write, so it never waits; ours (quiet_launch.py) asks only about output. Both start
    the same two idle ranks side by side; the CPU each launcher used, not a time, counts."""
    from engine_bridge.distributed.launch import launcher

    idle = ["-c", "import time; print('up', flush=True); time.sleep(4)"]

    def start(argv: list[str], port: int) -> subprocess.Popen:
        where = ["--backend", "ring", "-n", "2", "--hosts", "127.0.0.1",
                 "--starting-port", str(port), "--python", sys.executable, "--", *idle]  # fmt: skip
        # stdin a pipe that stays open, as the supervisor gives it (see quiet_launch.py)
        return subprocess.Popen([*argv, *where], cwd=REPO, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip

    stock = start([str(Path(sys.executable).with_name("mlx.launch"))], free_ports(2))
    quiet = start(launcher(), free_ports(2))
    time.sleep(3)
    used = {}
    for name, proc in (("stock", stock), ("quiet", quiet)):
        cpu = psutil.Process(proc.pid).cpu_times()
        used[name] = cpu.user + cpu.system
    for proc in (stock, quiet):
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and out.count(b"up") == 2, out  # output still relayed
    # Start-up (imports) costs both alike; the stock relay then spins for seconds.
    assert used["stock"] > 3 * used["quiet"], used
