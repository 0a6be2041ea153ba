"""The bench's distributed scenario (issue 34), by its parts: the worlds it starts and how
it stops them, the index mlx_lm.server's pipeline split needs, the rows it writes from
its samples and each rank's figures, and its skip where mlx.launch is missing. The whole
scenario runs minutes: `mlx-prompt-cache bench --quick --scenarios distributed`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from bench import SCENARIOS, traces
from bench.harness import Harness, Settings
from bench.prerequisites import MLX_LAUNCH, skip_reason
from bench.report import main_table
from bench.results import Sample, ScenarioResult
from bench.scenarios.distributed import scenario as dist
from bench.scenarios.distributed.worlds import (
    INDEX,
    World,
    command,
    serving,
    stop_tree,
    with_weight_index,
    worlds,
)
from bench.scenarios.registry import run_one
from bench.servers import ModelSpec

NO_MLX_LAUNCH = (
    "mlx.launch (MLX's launcher of distributed programs) not found; "
    "it ships with mlx: pip install --force-reinstall mlx"
)


def path_without(program: str) -> str:
    folders = os.environ.get("PATH", "").split(os.pathsep)
    return os.pathsep.join(d for d in folders if d and not (Path(d) / program).exists())


def test_distributed_is_skipped_before_it_starts_where_mlx_launch_is_missing(tmp_path, monkeypatch):
    assert "distributed" in SCENARIOS
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    monkeypatch.setenv("PATH", path_without("mlx.launch"))
    assert skip_reason("distributed") == NO_MLX_LAUNCH
    # No model on disk: a scenario that started anything would fail, not skip.
    out = tmp_path / "out"
    settings = Settings(out, ModelSpec("demo-llama", tmp_path / "absent", is_demo=True), [])
    (result,) = run_one("distributed", settings)
    assert (result.scenario, result.skipped, result.errors) == ("distributed", NO_MLX_LAUNCH, [])
    assert not out.exists(), "a skipped scenario writes nothing"
    assert main_table([result]).splitlines()[2] == (
        f"| distributed | demo-llama | skipped: {NO_MLX_LAUNCH} | — |"
    )
    # The launcher beside this Python counts, though its bin/ is not on PATH.
    (bin_dir / "mlx.launch").write_text("#!/bin/sh\n")
    assert skip_reason("distributed") is None
    assert MLX_LAUNCH.where() == bin_dir / "mlx.launch"


def test_each_world_starts_with_its_ranks_and_split():
    model = ModelSpec("demo-hybrid", Path("/m/demo-hybrid"), is_demo=True)
    launcher = str(MLX_LAUNCH.where())
    ours2, ours1, mlx_lm, quiet = worlds("pipeline")
    assert [(w.key, w.kind, w.ranks, w.quiet) for w in (ours2, ours1, mlx_lm, quiet)] == [
        ("ours", "ours", 2, False), ("ours_1rank", "ours", 1, False),
        ("mlx_lm", "mlx_lm", 2, False), ("mlx_lm_quiet", "mlx_lm", 2, True),
    ]  # fmt: skip
    serve = [sys.executable, "-m", "proxy.cli", "serve", "--port", "8000", "--cache-dir", "/c",
             "--model", "demo-hybrid", "--upstream", "http://127.0.0.1:9"]  # fmt: skip
    assert command(ours2, model, 8000, 41000, Path("/c"), ["--max-batch", "2"]) == [
        *serve, "--ranks", "2", "--split", "pipeline", "--max-batch", "2",
    ]  # fmt: skip
    assert command(ours1, model, 8000, 41000, Path("/c")) == serve
    reference = [launcher, "--backend", "ring", "-n", "2", "--hosts", "127.0.0.1",
                 "--starting-port", "41000", "--python", sys.executable, "--",
                 "-m", "mlx_lm.server", "--model", "/m/demo-hybrid",
                 "--host", "127.0.0.1", "--port", "8000"]  # fmt: skip
    assert command(mlx_lm, model, 8000, 41000) == [*reference, "--pipeline"]
    # The same world under the launcher ours starts its ranks with (quiet_launch.py).
    assert command(quiet, model, 8000, 41000) == [
        sys.executable, "-m", "engine_bridge.distributed.quiet_launch", *reference[1:],
        "--pipeline",
    ]  # fmt: skip
    assert quiet.label == "mlx_lm.server, 2 ranks (pipeline), quiet launcher"
    tensor = World("mlx_lm", "mlx_lm", 2, "tensor")
    assert command(tensor, model, 8000, 41000) == reference
    assert tensor.label == "mlx_lm.server, 2 ranks (tensor)" and ours1.label.endswith("1 rank")


def _safetensors(path: Path, names: list[str]) -> None:
    header = {n: {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]}
              for i, n in enumerate(names)}  # fmt: skip
    header["__metadata__"] = {"format": "mlx"}
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"\0" * 4 * len(names))


def test_a_one_file_model_gets_the_weight_index_mlx_lm_pipeline_reads(tmp_path):
    folder = tmp_path / "demo-hybrid"
    folder.mkdir()
    names = ["model.embed_tokens.weight", "model.layers.0.mlp.weight", "lm_head.weight"]
    _safetensors(folder / "model.safetensors", names)
    (folder / "config.json").write_text("{}")
    model = ModelSpec("demo-hybrid", folder, is_demo=True)
    indexed = with_weight_index(model, tmp_path / "work")
    assert indexed.path != folder and not (folder / INDEX).exists(), "the model stays as built"
    index = json.loads((indexed.path / INDEX).read_text())
    assert index["weight_map"] == dict.fromkeys(names, "model.safetensors")
    assert (indexed.path / "config.json").resolve() == (folder / "config.json").resolve()
    assert with_weight_index(model, tmp_path / "work") == indexed  # built once
    (folder / INDEX).write_text(json.dumps(index))
    assert with_weight_index(model, tmp_path / "other") == model  # one already there


def _samples(
    server: str, ttft: list[float], cached: list[int | None], label: str = "turn"
) -> list[Sample]:
    return [
        Sample(server=server, step=i, ttft_s=t, total_s=t + 1.0, prompt_tokens=1000,
               cached_tokens=c, completion_tokens=11, source=None, ok=True, label=label)
        for i, (t, c) in enumerate(zip(ttft, cached, strict=True))
    ]  # fmt: skip


def test_the_rows_set_ours_on_two_ranks_against_mlx_lm_and_against_one_rank():
    result = ScenarioResult("distributed", "demo-hybrid (tensor split)")
    result.samples += _samples("ours", [3.0, 0.2, 0.4], [0, 900, 900])
    result.samples += _samples("ours_1rank", [2.0, 0.1, 0.1], [0, 900, 900])
    result.samples += _samples("mlx_lm", [4.0, 0.6, 1.0], [None, None, None])
    result.samples += _samples("mlx_lm_quiet", [3.0, 0.4, 0.8], [None, None, None])
    # The next turn after the restart: ours from the SSD, mlx_lm cold; neither counts warm.
    (restarted,) = _samples("ours", [0.5], [960], dist.RESTARTED)
    restarted.source = "ssd"
    result.samples += [restarted, *_samples("mlx_lm", [5.0], [0], dist.RESTARTED)]
    split = {"ssd_bytes": [40, 41], "kv_bytes": [0, 0]}
    split |= {"layout": ["tensor 0/2", "tensor 1/2"], "ram_bytes": [500, 510]}
    held = {"ours": split, "ours_1rank": dist.per_rank({"ram": {"bytes": 1000}, "ssd": None})}
    kinds = [dist.NEW_SESSION, dist.TOOL_ROUND, dist.NEW_QUESTION]  # the first call is cold
    dist.summarize(result, held, "the next call", kinds)
    rows = {r.metric: r for r in result.rows}
    assert result.rows[0].metric == dist.HEADLINE
    assert result.rows[0].values == pytest.approx({"ours": 0.3, "mlx_lm": 0.8})
    assert result.rows[0].ratios == pytest.approx({"mlx_lm / ours": 0.8 / 0.3})
    quiet = rows[
        "mean TTFT of warm agent turns (2..N), 2 ranks, mlx_lm.server under our launcher (s)"
    ]
    assert quiet.values == pytest.approx({"ours": 0.3, "mlx_lm": 0.6})
    assert result.metrics["warm_ttft_mlx_lm_quiet_over_ours"] == pytest.approx(2.0)
    tool = rows["mean TTFT of warm turns: tool round (1), 2 ranks (s)"]
    assert tool.values == pytest.approx({"ours": 0.2, "mlx_lm": 0.6})
    assert tool.ratios == pytest.approx(
        {"mlx_lm / ours": 3.0, "mlx_lm under our launcher / ours": 2.0}
    )
    assert tool.note == "hit ratio (cached / prompt tokens): ours 0.900, mlx_lm null"
    question = rows["mean TTFT of warm turns: new question (1), 2 ranks (s)"]
    assert question.ratios["mlx_lm / ours"] == pytest.approx(2.5)
    assert result.metrics["warm_ttft_new_question_mlx_lm_over_ours"] == pytest.approx(2.5)
    assert not any("new session" in m for m in rows), "no warm turn of that kind"
    one = rows["mean TTFT of warm agent turns (2..N), ours on 1 rank (s)"]
    assert one.ratios == pytest.approx({"ours 2 ranks / 1 rank": 3.0})
    # 10 tokens after the first, in the second after it, on every turn.
    assert rows["decode tok/s, 2 ranks"].values == pytest.approx({"ours": 10.0, "mlx_lm": 10.0})
    hits = rows["token hit ratio of warm turns (cached / prompt tokens), 2 ranks"]
    assert hits.values == {"ours": pytest.approx(0.9), "mlx_lm": None}
    rank1 = rows["cache RAM bytes held by rank 1 (tensor 1/2)"]
    assert (rank1.values, rank1.ratios) == ({"ours": 510}, {"rank 1 / 1 rank": 0.51})
    assert rows["cache RAM bytes, ours on 1 rank"].values == {"ours": 1000}
    after = rows[dist.RESTART_TTFT]
    assert (after.values, after.ratios) == ({"ours": 0.5, "mlx_lm": 5.0}, {"mlx_lm / ours": 10.0})
    assert after.note.startswith("the next call, after every rank")
    share = rows["cached / prompt tokens of the next turn after a restart, 2 ranks"]
    assert share.values == {"ours": 0.96, "mlx_lm": 0.0}
    assert "960 of 1000 prompt tokens from its cache (x-prompt-cache-source: ssd)" in share.note
    assert result.metrics["after_restart_source_ours"] == "ssd"
    assert result.metrics["rank0_ram_over_1rank"] == 0.5
    assert result.metrics["greedy_outputs_equal_2ranks_vs_1rank"] == 1.0
    assert result.metrics["ssd_bytes_2ranks_rank1"] == 41
    assert result.metrics["ssd_bytes_1rank_rank0"] is None
    assert "mlx_lm.server reported no cached tokens: its hit ratio is null" in result.notes


def test_decode_rate_counts_only_what_streamed_after_the_first_token():
    one = _samples("ours", [0.5], [0])[0]
    one.completion_tokens = 1  # nothing after the first token: no decode to time
    failed = _samples("ours", [0.5], [0])[0]
    failed.ok = False
    assert dist.decode_rate([one, failed]) is None
    assert dist.decode_rate(_samples("ours", [0.5, 0.7], [0, 0])) == pytest.approx(10.0)


def test_each_ranks_figures_count_once_rank_0s_match_its_live_ram():
    live = {"ram": {"bytes": 7}, "ranks": [{"rank": 0, "ram_bytes": 7}, {"rank": 1}]}
    assert dist._gathered(live, 2)
    assert not dist._gathered(live | {"ram": {"bytes": 9}}, 2)  # gathered before the turns
    assert not dist._gathered({"ram": {"bytes": 7}, "ranks": None}, 2)
    by_rank = dist.per_rank(live | {"ranks": [{"layout": "pipeline 0/2", "ram_bytes": 7}]})
    assert by_rank == {"layout": ["pipeline 0/2"], "ram_bytes": [7], "ssd_bytes": [None],
                       "kv_bytes": [None]}  # fmt: skip


def test_stop_tree_ends_what_the_world_started_in_a_session_of_its_own(tmp_path):
    # Like our front, whose ranks run in a process group of their own.
    child = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', " \
            "'import time; time.sleep(60)'], start_new_session=True); time.sleep(60)"  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", child], start_new_session=True)
    deadline = time.monotonic() + 20
    while not psutil.Process(proc.pid).children() and time.monotonic() < deadline:
        time.sleep(0.05)
    (grandchild,) = psutil.Process(proc.pid).children()
    assert os.getpgid(grandchild.pid) != os.getpgid(proc.pid)
    assert stop_tree(proc, timeout=5) < 15
    assert proc.returncode is not None and not grandchild.is_running()


def test_each_call_of_the_agent_trace_is_a_tool_round_a_new_question_or_a_new_session():
    kw = {"system_chars": 500, "tool_detail_chars": 0, "result_chars": 200,
          "compact_tools": True}  # fmt: skip
    calls = traces.agent_trace(0, calls_per_session=(6, 2), **kw).calls
    kinds = [dist.turn_kind(c) for c in calls]
    tool, question, session = dist.TOOL_ROUND, dist.NEW_QUESTION, dist.NEW_SESSION
    assert kinds == [session, tool, tool, tool, question, tool, session, tool]


def test_the_turn_after_the_restart_adds_the_sessions_next_tool_round():
    kw = {"system_chars": 2000, "tool_detail_chars": 0, "result_chars": 800,
          "compact_tools": True}  # fmt: skip
    calls = traces.agent_trace(0, calls_per_session=(4 + dist.LOOKAHEAD,), **kw).calls
    assert calls[:4] == traces.agent_trace(0, calls_per_session=(4,), **kw).calls
    # The 5th call is a new user request: the turn takes the 6th call's tool round.
    following, note = dist.next_tool_round(calls[3], calls[4:])
    last = calls[3].body["messages"]
    added = following.body["messages"][len(last) :]
    assert following.body["messages"][: len(last) - 1] == last[:-1]
    assert added == calls[5].body["messages"][-2:]
    assert [b["type"] for b in added[0]["content"]][-1] == "tool_use"
    assert "cache_control" not in following.body["messages"][len(last) - 1]["content"][-1]
    assert "cache_control" in last[-1]["content"][-1], "the trace's call is left as it was"
    assert following.body["tools"] == calls[3].body["tools"] and "its call 6 adds" in note
    # When the very next call is a tool round, it is the turn.
    assert dist.next_tool_round(calls[0], calls[1:]) == (
        calls[1], "the session's next call: its last request plus one more tool round",
    )  # fmt: skip


def test_mlx_lm_split_by_layers_serves_the_demo_model_and_leaves_nothing_behind(
    tmp_path, demo_root
):
    model = ModelSpec("demo-hybrid", demo_root / "models" / "demo-hybrid", is_demo=True)
    settings = Settings(tmp_path, model, [], quick=True, max_tokens=4, request_timeout_s=120)
    result = ScenarioResult("distributed", "demo-hybrid (pipeline split)")
    with Harness(settings, result, model) as h:
        with serving(h, World("mlx_lm", "mlx_lm", 2, "pipeline"), model) as server:
            ranks = psutil.Process(server.proc.pid).children(recursive=True)
            serving_ranks = [p for p in ranks if "mlx_lm.server" in " ".join(p.cmdline())]
            body = {"messages": [{"role": "user", "content": "Name three rivers."}]}
            sample = h.send(server, "openai", body, 0)
    assert result.errors == [], result.errors + [server.log_tail()]
    assert sample.ok and sample.completion_tokens == 4 and sample.prompt_tokens > 0
    assert len(serving_ranks) >= 2  # each rank, and the shell mlx.launch starts it in
    assert not any(p.is_running() for p in ranks)
    assert result.servers["mlx_lm"]["label"] == "mlx_lm.server, 2 ranks (pipeline)"
