"""`mlx-prompt-cache bench`: the quick run end to end, and the agent trace in both dialects."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import TypeAdapter

from bench import SCENARIOS, scenario_names, traces
from bench.agent_tools import TOOL_NAMES
from bench.harness import Settings
from bench.plots import plot_all
from bench.prerequisites import skip_reason
from bench.report import details, main_table, to_json
from bench.scenarios import concurrency, speculative
from bench.scenarios.registry import run_one
from bench.scenarios.ssd_reload import bench_startup, run
from bench.servers import KINDS, ModelSpec

REPO_ROOT = Path(__file__).resolve().parents[2]
QUICK_SCENARIOS = ("chat", "agent", "share", "overhead", "restart")
SERVERS_BY_SCENARIO = {
    "chat": {"ours", "nocache", "mlx_lm"},
    "agent": {"ours", "nocache", "mlx_lm"},
    "share": {"ours", "mlx_lm"},
    "overhead": {"ours", "nocache", "bare", "mlx_lm"},  # mlx_lm: the cold series
    "restart": {"ours", "nocache", "mlx_lm"},
}


def small_trace(seed: int = 3) -> traces.AgentTrace:
    return traces.agent_trace(seed, (4, 3), system_chars=1500, tool_detail_chars=60,
                              result_chars=600)  # fmt: skip


def validate(type_, value):
    """Validate `value` as `type_`, consuming pydantic's lazily validated iterables."""
    # The adapter must outlive the iterators it returns: they refer to its definitions.
    adapter = TypeAdapter(type_)
    return drain(adapter.validate_python(value))


def drain(value):
    if isinstance(value, dict):
        return {k: drain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [drain(v) for v in value]
    if isinstance(value, Iterator):
        return [drain(v) for v in value]
    return value


def numbers(value) -> Iterator[float]:
    if isinstance(value, bool):
        return
    if isinstance(value, int | float):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from numbers(v)
    elif isinstance(value, list):
        for v in value:
            yield from numbers(v)


def test_agent_trace_is_deterministic_for_a_seed():
    assert small_trace(3).to_json() == small_trace(3).to_json()
    assert small_trace(3).to_json() != small_trace(4).to_json()


def test_agent_trace_has_the_shape_of_a_coding_agent_session():
    trace = small_trace()
    assert [(c.session, c.index) for c in trace.calls] == [
        (0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2)
    ]  # fmt: skip
    first = {c.session: c.body for c in trace.calls if c.index == 0}
    headers = [first[s]["system"][0]["text"] for s in (0, 1)]
    assert all(h.startswith("x-anthropic-billing-header: cc_version=") for h in headers)
    assert headers[0] != headers[1], "the billing header must change per session"
    assert first[0]["system"][1] == first[1]["system"][1], "same project, same system prompt"
    assert first[0]["tools"] == first[1]["tools"]
    assert len(first[0]["tools"]) == len(TOOL_NAMES) >= 20
    last = trace.calls[3].body["messages"]
    kinds = [b["type"] for m in last if isinstance(m["content"], list) for b in m["content"]]
    assert {"thinking", "tool_use", "tool_result", "text"} <= set(kinds)
    # Every tool_use is answered by a tool_result with its id in the next message.
    for i, m in enumerate(last):
        if m["role"] == "assistant":
            ids = [b["id"] for b in m["content"] if b["type"] == "tool_use"]
            answers = [
                b["tool_use_id"] for b in last[i + 1]["content"] if b["type"] == "tool_result"
            ]
            assert ids == answers
    # Each call's history extends the previous call's within a session.
    for a, b in zip(trace.calls, trace.calls[1:], strict=False):
        if a.session == b.session:
            n = len(a.body["messages"])
            strip = [
                {
                    **m,
                    "content": [
                        {k: v for k, v in blk.items() if k != "cache_control"}
                        for blk in m["content"]
                    ],
                }
                for m in b.body["messages"][:n]
            ]
            mine = [
                {
                    **m,
                    "content": [
                        {k: v for k, v in blk.items() if k != "cache_control"}
                        for blk in m["content"]
                    ],
                }
                for m in a.body["messages"]
            ]
            assert strip == mine  # fmt: skip


def test_agent_trace_validates_as_anthropic_messages_requests():
    from anthropic.types import MessageParam, TextBlockParam, ToolParam
    from anthropic.types.message_create_params import MessageCreateParamsNonStreaming

    for call in small_trace().calls:
        body = call.anthropic("demo-llama", 8)
        validate(MessageCreateParamsNonStreaming, body)
        validate(list[MessageParam], body["messages"])
        validate(list[TextBlockParam], body["system"])
        validate(list[ToolParam], body["tools"])
        assert body["messages"][0]["role"] == "user" and body["messages"][-1]["role"] == "user"


def test_agent_trace_converts_to_valid_openai_chat_requests():
    from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

    for call in small_trace().calls:
        body = call.openai("default_model", 8)
        validate(list[ChatCompletionMessageParam], body["messages"])
        validate(list[ChatCompletionToolParam], body["tools"])
        anthropic_body = call.body
        assert len(body["tools"]) == len(anthropic_body["tools"])
        calls = {c["id"]: c for m in body["messages"] for c in m.get("tool_calls", [])}
        results = [m for m in body["messages"] if m["role"] == "tool"]
        assert all(r["tool_call_id"] in calls for r in results)
        assert bool(results) == (call.index > 0), "tool results follow the first request"
        for c in calls.values():
            assert isinstance(json.loads(c["function"]["arguments"]), dict)
        assert body["messages"][0]["role"] == "system"
        assert body["messages"][0]["content"][0]["text"].startswith("x-anthropic-billing-header")


def test_chat_trace_is_deterministic_and_grows_by_turn():
    a = traces.chat_trace(5, 4, 500)
    assert a == traces.chat_trace(5, 4, 500)
    assert a.messages(2)[: len(a.messages(1)) - 1] == a.messages(1)[:-1]
    assert a.messages(3)[-1] == {"role": "user", "content": a.users[3]}
    assert a.new_only(2)[0]["content"].startswith(a.replies[1])


def test_scenario_names_accept_commas_and_spaces_and_reject_unknown_ones():
    assert scenario_names(["chat,agent", "share"]) == ["chat", "agent", "share"]
    with pytest.raises(SystemExit, match="unknown scenario"):
        scenario_names(["chat,nope"])


def test_serve_never_imports_the_bench_package(tmp_path):
    code = (
        "import sys; from proxy.cli import main;"
        " assert main(['serve', '--print-config']) == 0;"
        " loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'bench'"
        " or m == 'engine_bridge.probes.shapes');"
        " assert not loaded, loaded"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_PROMPT_CACHE_")}
    env["HOME"] = str(tmp_path)  # no user config file
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "[server]" in proc.stdout


def test_bench_help_comes_from_the_bench_parser():
    proc = subprocess.run([sys.executable, "-m", "proxy.cli", "bench", "--help"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: mlx-prompt-cache bench ")
    assert "--scenarios" in proc.stdout and "--shape" in proc.stdout
    top = subprocess.run([sys.executable, "-m", "proxy.cli", "--help"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert "bench" in top.stdout and "serve" in top.stdout


def test_ssd_startup_benchmark_runs_at_a_tiny_size(tmp_path):
    result = bench_startup(tmp_path, 300)
    assert result["entries"] == 300
    print(result)


def test_ssd_reload_benchmark_runs_at_a_tiny_size(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_DIR", str(tmp_path))
    result = run(entries=50, reload_entries=2, mb=1)
    assert result["startup"]["entries"] == 50
    assert set(result["reload"]) == {"cold_MBps", "warm_MBps"}
    assert list(tmp_path.iterdir()) == []  # the temporary folder is gone


@pytest.mark.slow
def test_bench_quick_runs_end_to_end(tmp_path, demo_root):
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "proxy.cli", "bench", "--quick", "--model", "demo-llama",
           "--scenarios", ",".join(QUICK_SCENARIOS), "--out", str(out),
           "--models-dir", str(demo_root / "models")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for name in ("results.json", "results.md", "chat_ttft.png", "agent_ttft.png",
                 "hit_ratio.png", "restart_ttft.png"):  # fmt: skip
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name

    def reject(constant: str):
        raise AssertionError(f"results.json holds {constant}")

    data = json.loads((out / "results.json").read_text(), parse_constant=reject)
    assert all(math.isfinite(x) for x in numbers(data))
    assert data["meta"]["machine"]["cpu_count"] and data["meta"]["versions"]["mlx-lm"]
    by_name = {s["scenario"]: s for s in data["scenarios"]}
    assert set(by_name) == set(QUICK_SCENARIOS)
    for name, scenario in by_name.items():
        assert scenario["errors"] == [], (name, scenario["errors"])
        assert scenario["rows"], name
        samples = scenario["samples"]
        assert {s["server"] for s in samples} == SERVERS_BY_SCENARIO[name], name
        assert all(s["ok"] and s["ttft_s"] is not None for s in samples), name
    overhead = by_name["overhead"]
    cold = [s for s in overhead["samples"] if s["label"] == "cold"]
    assert sorted((s["server"], s["step"]) for s in cold) == sorted(
        (server, k) for server in ("ours", "mlx_lm") for k in range(5)
    )
    assert all(s["cached_tokens"] <= 3 for s in cold), "cold prompts must share nothing"
    assert overhead["metrics"]["cold_5_ours_over_mlx_lm"] > 0
    render = {k: v for k, v in overhead["metrics"].items() if k.startswith("render_")}
    assert render["render_messages"] == 201
    assert all(render[f"render_{k}_s"] > 0 for k in ("template", "render_chat_cold"))
    md = (out / "results.md").read_text()
    for name in QUICK_SCENARIOS:
        assert f"| {name} | demo-llama |" in md


def test_concurrency_scenario_reports_every_part_for_every_server(tmp_path, demo_root):
    model = ModelSpec("demo-llama", demo_root / "models" / "demo-llama", is_demo=True)
    lines: list[str] = []
    settings = Settings(tmp_path, model, [], quick=True, max_tokens=2, progress=lines.append,
                        request_timeout_s=60)  # fmt: skip
    result = concurrency.concurrency(settings, model, concurrency.TINY)
    assert result.errors == []
    tiny = concurrency.TINY
    counts = {"hol-long": 1, "hol-short": concurrency.SHORTS, "stream": concurrency.STREAMS,
              "session": concurrency.SESSIONS * tiny.calls_per_session}  # fmt: skip
    most = {"hol-long": 2, "hol-short": tiny.short_output, "stream": tiny.stream_output[1],
            "session": 2}  # fmt: skip
    for kind in KINDS:
        for label, n in counts.items():
            samples = result.of(kind, label)
            assert len(samples) == n, (kind, label)
            for s in samples:
                assert s.ok and s.ttft_s > 0 and s.prompt_tokens > 0, (kind, label, s)
                assert 0 < s.completion_tokens <= most[label], (kind, label, s)
        per_session = sorted(s.session for s in result.of(kind, "session"))
        assert per_session == sorted(list(range(concurrency.SESSIONS)) * tiny.calls_per_session)
        done = [ln for ln in lines if f" {kind} " in ln + " " and "[concurrency]" in ln]
        assert any("stream 8/8" in ln for ln in done), kind
        assert any(f"session 4 request {tiny.calls_per_session}/" in ln for ln in done), kind
    rows = {row.metric: row.values for row in result.rows}
    assert result.rows[0].metric == concurrency.HOL_ROW
    for metric in (concurrency.HOL_ROW, concurrency.STREAMS_ROW, concurrency.SESSIONS_ROW):
        assert set(rows[metric]) == set(KINDS), metric
        assert all(v > 0 for v in rows[metric].values()), (metric, rows[metric])
    for name in ("hol_short_ttft_ours_over_mlx_lm", "streams8_tok_s_ours_over_mlx_lm",
                 "sessions4_wall_ours_over_mlx_lm", "sessions4_wall_ours_over_nocache"):  # fmt: skip
        assert result.metrics[name] > 0, name
    assert concurrency.HOL_ROW in details(result)
    plots, skipped = plot_all(tmp_path, [result])
    assert skipped or [p.name for p in plots] == ["concurrency.png"]


# What a machine without the optional parts is told (bench/prerequisites.py).
NO_REDIS_SERVER = (
    "redis-server not found; install it with `brew install redis` (macOS) "
    "or `apt-get install redis-server`"
)
NO_REDIS = "redis (the Python package) missing; pip install 'mlx-prompt-cache[shared]'"
NO_MLX_VLM = "mlx-vlm missing; pip install 'mlx-prompt-cache[vision]'"
NO_MATPLOTLIB = "Plots skipped: matplotlib missing; pip install 'mlx-prompt-cache[bench]'."
OPTIONAL_MODULES = ("redis", "mlx_vlm", "matplotlib")


def path_without(program: str) -> str:
    """$PATH less every folder that holds `program`: absent for the run, not uninstalled."""
    folders = os.environ.get("PATH", "").split(os.pathsep)
    return os.pathsep.join(d for d in folders if d and not (Path(d) / program).exists())


def test_scenarios_whose_prerequisites_are_absent_are_skipped_before_they_start(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("PATH", path_without("redis-server"))
    for module in OPTIONAL_MODULES:
        monkeypatch.setitem(sys.modules, module, None)  # `import module` now fails
    assert shutil.which("redis-server") is None
    assert {n: skip_reason(n) for n in SCENARIOS} == {
        **dict.fromkeys(SCENARIOS),
        "shared": f"{NO_REDIS_SERVER}. {NO_REDIS}",
        "vision": NO_MLX_VLM,
    }
    # No model on disk: a scenario that started anything would fail, not skip.
    model = ModelSpec("demo-llama", tmp_path / "absent-model", is_demo=True)
    settings = Settings(tmp_path, model, [])
    (shared,) = run_one("shared", settings)
    (vision,) = run_one("vision", settings)
    assert [(r.scenario, r.skipped, r.errors, r.samples) for r in (shared, vision)] == [
        ("shared", f"{NO_REDIS_SERVER}. {NO_REDIS}", [], []),
        ("vision", NO_MLX_VLM, [], []),
    ]
    assert list(tmp_path.iterdir()) == [], "a skipped scenario writes nothing"
    assert main_table([shared, vision]).splitlines()[2:] == [
        f"| shared | demo-llama | skipped: {NO_REDIS_SERVER}. {NO_REDIS} | — |",
        f"| vision | demo-llama | skipped: {NO_MLX_VLM} | — |",
    ]
    assert details(vision) == f"### vision — skipped\n\n- **skipped**: {NO_MLX_VLM}"
    scenarios = to_json([shared, vision], {})["scenarios"]
    assert [(s["scenario"], s["skipped"], s["errors"]) for s in scenarios] == [
        ("shared", f"{NO_REDIS_SERVER}. {NO_REDIS}", []),
        ("vision", NO_MLX_VLM, []),
    ]
    assert plot_all(tmp_path, [shared, vision]) == ([], NO_MATPLOTLIB)


def test_shared_scenario_names_whichever_redis_part_is_missing(tmp_path, monkeypatch):
    stub = tmp_path / "bin" / "redis-server"  # found on PATH, never run
    stub.parent.mkdir()
    stub.write_text("#!/bin/sh\nexit 1\n")
    stub.chmod(0o755)
    monkeypatch.setenv("PATH", str(stub.parent))
    assert skip_reason("shared") is None  # the test extra installs the redis package
    monkeypatch.setitem(sys.modules, "redis", None)
    assert skip_reason("shared") == NO_REDIS
    monkeypatch.delitem(sys.modules, "redis")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert skip_reason("shared") == NO_REDIS_SERVER


def test_bench_imports_no_optional_package_until_a_scenario_needs_it():
    code = (
        "import sys, bench, bench.report, bench.plots, bench.scenarios.registry;"
        " bench.build_parser(); bench.scenarios.registry.registry();"
        f" print(sorted(m for m in sys.modules if m.split('.')[0] in {OPTIONAL_MODULES!r}))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_bench_without_redis_or_mlx_vlm_skips_their_scenarios_and_exits_0(tmp_path, demo_root):
    # The bench in its own process, where importing redis, mlx_vlm or matplotlib fails,
    # with redis-server off PATH: shared and vision are skipped, share runs for real (the
    # cheapest scenario with a model: two servers; test_bench_quick_runs_end_to_end runs
    # it and chat with matplotlib).
    code = (
        "import sys\n"
        f"for m in {OPTIONAL_MODULES!r}: sys.modules[m] = None\n"
        "from bench import main\n"
        "raise SystemExit(main(sys.argv[1:]))\n"
    )
    out = tmp_path / "bench"
    cmd = [sys.executable, "-c", code, "--quick", "--max-tokens", "2", "--model", "demo-llama",
           "--scenarios", "shared,vision,share", "--out", str(out),
           "--models-dir", str(demo_root / "models")]  # fmt: skip
    env = {**os.environ, "PATH": path_without("redis-server")}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    data = json.loads((out / "results.json").read_text())
    scenarios = data["scenarios"]
    assert [(s["scenario"], s["skipped"], s["errors"]) for s in scenarios] == [
        ("shared", f"{NO_REDIS_SERVER}. {NO_REDIS}", []),
        ("vision", NO_MLX_VLM, []),
        ("share", None, []),
    ]
    share = scenarios[2]
    assert {s["server"] for s in share["samples"]} == SERVERS_BY_SCENARIO["share"]
    assert all(s["ok"] for s in share["samples"])
    assert data["meta"]["plot_note"] == NO_MATPLOTLIB
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == ["results.json", "results.md"]
    assert f"skipped: shared: {NO_REDIS_SERVER}. {NO_REDIS}" in proc.stderr
    assert f"skipped: vision: {NO_MLX_VLM}" in proc.stderr
    table = proc.stdout.split("\n\nresults:")[0].splitlines()
    assert table[2:4] == [
        f"| shared | demo-llama | skipped: {NO_REDIS_SERVER}. {NO_REDIS} | — | — | — |",
        f"| vision | demo-llama | skipped: {NO_MLX_VLM} | — | — | — |",
    ]
    assert table[4].startswith("| share | demo-llama | cache bytes per session (4 sessions) | ")
    md = (out / "results.md").read_text()
    assert f"- **skipped**: {NO_MLX_VLM}" in md and NO_MATPLOTLIB in md


def test_speculative_scenario_reports_every_drafter_on_every_demo_model(tmp_path, demo_root):
    model = ModelSpec("demo-llama", demo_root / "models" / "demo-llama", is_demo=True)
    lines: list[str] = []
    settings = Settings(tmp_path, model, [], quick=True, progress=lines.append)
    results = speculative.scenario(settings, model, speculative.TINY)
    runs = [label for label, _ in speculative.blas_runs()]
    assert [(r.scenario, r.model, r.errors) for r in results] == [
        ("speculative", speculative._name(m, label), [])
        for label in runs
        for m in speculative.MODELS
    ]
    others = speculative.CONFIGS[1:]
    for r in results:
        assert r.metrics["outputs_identical"] == 1.0, r.model
        assert set(r.rows[0].ratios) == {f"{c} / off" for c in others}
        assert [row.metric for row in r.rows[1:]] == [
            f"decode tok/s, {speculative.LABELS[c]}" for c in others
        ]
        assert all(row.values["ours"] > 0 for row in r.rows), r.rows
        assert sorted((s.label, s.step) for s in r.samples) == sorted(
            (c, k) for c in speculative.CONFIGS for k in range(speculative.TINY.repeats)
        )
        assert len({s.output for s in r.samples}) == 1
        m = r.metrics
        assert (m["off_tokens_per_step"], m["off_acceptance"]) == (1.0, None)
        assert (m["oracle_acceptance"], m["wrong_acceptance"]) == (1.0, 0.0)
        assert m["oracle_tokens_per_step"] > m["lookup_tokens_per_step"] > 1.0
        assert m["lookup_acceptance"] > 0.5
        assert "target ≥ 2× off: " in r.rows[1].note and "target ≥ 0.95× off: " in r.rows[3].note
    assert any("[speculative] demo-swa wrong 1/1: " in ln for ln in lines), lines
    # Each result names the BLAS it ran on, and a preload shows in the process's maps.
    for r in results:
        blas = r.notes[-1]
        assert blas.startswith("CPU BLAS: "), r.notes
        if r.model.endswith("[OpenBLAS (preloaded)]"):
            assert "(preloaded)" in blas and "openblas" in blas.split("mapped: ")[1].lower()
    # A run that wrote something else is an error, not a row to read.
    answer = json.loads((tmp_path / "work" / "speculative" / "speculative.json").read_text())
    measured = answer["models"][0]
    measured["runs"][-1]["text"] += "x"
    (broken,) = [speculative.summarize(answer, measured)]
    assert broken.metrics["outputs_identical"] == 0.0
    assert broken.errors == [
        "speculation changed the greedy output: wrong run 1 wrote "
        f"{measured['runs'][0]['completion_tokens']} tokens (stop) a different text; off wrote "
        f"{measured['runs'][0]['completion_tokens']} (stop)"
    ]
