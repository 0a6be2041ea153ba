"""The bench's autotune scenario, by its parts: the traces (a working set larger than the
budget, a burst whose prompts never come back, a shift to other projects), the sweep and
its cap, the order it plays the configurations in, and the rows it writes from samples.
No model and no server: the whole scenario runs minutes,
`mlx-prompt-cache bench --quick --scenarios autotune`."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest

from bench import SCENARIOS, client
from bench.harness import Settings
from bench.plots import plot_all
from bench.prerequisites import skip_reason
from bench.report import details, main_table
from bench.results import Sample, ScenarioResult
from bench.scenarios.autotune import configs, workload
from bench.scenarios.autotune import scenario as sc
from bench.scenarios.autotune.configs import DEFAULT, TUNED, Config
from bench.scenarios.registry import registry
from bench.servers import ModelSpec

CPT = 2.9  # demo-llama's characters per token on this project's text
PER_BLOCK = 32768.0  # demo-llama: 2 layers x K,V x 2 heads x 16 dims x float32 x 64 tokens
SIZES = workload.Sizes.of(quick=True)


def trace(name: str, seed: int = 0) -> workload.Trace:
    return workload.build(name, seed, SIZES)


def blocks_of(calls) -> set[bytes]:
    return {b for c in calls for b in workload.blocks(c.body, CPT)}


def shared_prefixes(t: workload.Trace) -> set[bytes]:
    """The blocks every session of a project starts with: its system prompt and tools."""
    out: set[bytes] = set()
    for p in t.projects():
        firsts = [set(workload.blocks(c.body, CPT)) for c in t.calls
                  if c.project == p and c.turn == 0]  # fmt: skip
        out |= set.intersection(*firsts)
    return out


def test_autotune_is_a_scenario_that_needs_only_the_base_install():
    assert "autotune" in SCENARIOS and registry()["autotune"] is sc.autotune
    assert skip_reason("autotune") is None


def test_traces_are_deterministic_for_a_seed():
    for name in workload.NAMES:
        assert trace(name, 3) == trace(name, 3)
        assert trace(name, 3).calls != trace(name, 4).calls


def test_interleaved_projects_take_turns_round_robin_and_sessions_grow():
    t = trace(workload.INTERLEAVED)
    p, s = SIZES.projects, SIZES.sessions
    assert len(t.calls) == p * s * SIZES.turns and t.pivot is None and not t.one_offs()
    # Each project's j-th session, then every project's (j+1)-th, turn after turn.
    assert [c.project for c in t.calls[: p * s]] == [0, 1, 2, 3] * s
    assert [c.session for c in t.calls[: p * s]] == [0, 3, 6, 9, 1, 4, 7, 10, 2, 5, 8, 11]
    assert [c.turn for c in t.calls[:: p * s]] == list(range(SIZES.turns))
    for a in t.calls:
        for b in t.calls:
            if a.project == b.project:  # one system prompt and one set of tools a project
                assert a.body["messages"][0] == b.body["messages"][0]
                assert a.body["tools"] == b.body["tools"]
            if a.session == b.session and b.turn == a.turn + 1:  # the turn before, and more
                assert b.body["messages"][: len(a.body["messages"])] == a.body["messages"]
    systems = {c.body["messages"][0]["content"][:80] for c in t.calls}
    assert len(systems) == p, "every project's system prompt differs from its first line"
    assert len(t.calls[0].body["tools"]) == SIZES.tools
    assert t.calls[0].body["tools"][0]["type"] == "function"


def test_each_trace_outgrows_its_budget_but_no_request_does():
    for name in workload.NAMES:
        t = trace(name)
        plan = sc.plan_for(t, CPT, PER_BLOCK)
        budget_blocks = plan.budget_bytes / PER_BLOCK
        assert plan.working_set_blocks == len(blocks_of(t.calls))
        assert plan.working_set_bytes == int(plan.working_set_blocks * PER_BLOCK)
        if name != workload.SHIFT:  # its halves are sized (the shift's own test)
            assert plan.working_set_bytes / plan.budget_bytes == pytest.approx(2.5, rel=1e-3)
        # More than the sweep's largest budget: even twice the budget cannot hold it all.
        assert plan.working_set_bytes > configs.FACTORS[-1] * plan.budget_bytes, name
        longest = max(len(workload.blocks(c.body, CPT)) for c in t.calls)
        assert longest < budget_blocks / 2, (name, longest, budget_blocks)
        # The prefixes a project's sessions share fit in the budget: what plain LRU loses
        # is the order the requests come in, not room for what is read most.
        assert len(shared_prefixes(t)) < budget_blocks, name


def test_the_bursts_prompts_never_repeat_and_outgrow_the_budget_alone():
    t = trace(workload.BURST)
    burst = t.one_offs()
    assert len(burst) == SIZES.one_offs and burst == list(range(burst[0], burst[-1] + 1))
    assert t.pivot == burst[-1] + 1
    before, after = t.calls[: burst[0]], t.calls[t.pivot :]
    assert before and after and t.projects(before) == t.projects(after) == {0, 1}
    assert [c.turn for c in before][-1] + 1 == after[0].turn, "the projects go on"
    one_offs = [t.calls[i] for i in burst]
    texts = [c.body["messages"][0]["content"] for c in one_offs]
    assert len(set(texts)) == len(texts) and all("tools" not in c.body for c in one_offs)
    # No block of a one-off prompt is in any other request, one-off or not.
    for i, call in enumerate(one_offs):
        others = blocks_of([*before, *after, *one_offs[:i], *one_offs[i + 1 :]])
        assert not set(workload.blocks(call.body, CPT)) & others
    plan = sc.plan_for(t, CPT, PER_BLOCK)
    budget_blocks = plan.budget_bytes / PER_BLOCK
    assert len(blocks_of(one_offs)) > budget_blocks, "plain LRU keeps nothing through it"
    # ... while the projects' system prompts and tools fit in protect_frequent 0.5's share.
    assert len(shared_prefixes(t)) <= configs.PROTECT[-1] * budget_blocks


def test_the_shift_hands_over_to_other_projects_that_need_more_than_the_budget():
    t = trace(workload.SHIFT)
    first, second = t.calls[: t.pivot], t.calls[t.pivot :]
    assert len(first) == len(second) and not t.one_offs()
    assert t.projects(first) == {0, 1} and t.projects(second) == {2, 3}
    assert not blocks_of(first) & blocks_of(second), "nothing of the first half comes back"
    budget = sc.plan_for(t, CPT, PER_BLOCK).budget_bytes / PER_BLOCK
    for half in (first, second):  # more than the budget, within what tuning may reach
        assert budget < len(blocks_of(half)) < configs.AUTO_RAM_MAX * budget
    # The larger half is 1.75x the budget: tight enough that only more RAM keeps it.
    larger = max(len(blocks_of(first)), len(blocks_of(second)))
    assert larger / budget == pytest.approx(sc.PHASE_OVER_BUDGET, rel=0.02)


def test_a_requests_blocks_chain_so_only_equal_prefixes_match():
    body = {"messages": [{"role": "user", "content": "x" * 1000}]}
    edited = {"messages": [{"role": "user", "content": "y" + "x" * 999}]}
    chunk = round(workload.BLOCK_TOKENS * CPT)
    assert len(workload.blocks(body, CPT)) == (len("user\n") + 1000) // chunk
    assert not set(workload.blocks(body, CPT)) & set(workload.blocks(edited, CPT))
    longer = {"messages": [*body["messages"], {"role": "assistant", "content": "z" * 500}]}
    assert workload.blocks(longer, CPT)[:5] == workload.blocks(body, CPT)


def test_the_sweep_stays_under_the_cap_tuned_may_use():
    assert [(c.key, c.budget_bytes, c.protect_frequent) for c in configs.sweep(1000, 2000)] == [
        ("fixed-1x-pf0", 1000, 0.0), ("fixed-1x-pf0.5", 1000, 0.5),
        ("fixed-1.5x-pf0", 1500, 0.0), ("fixed-1.5x-pf0.5", 1500, 0.5),
        ("fixed-2x-pf0", 2000, 0.0), ("fixed-2x-pf0.5", 2000, 0.5),
    ]  # fmt: skip
    assert configs.sweep(1000, 2000)[0].key == DEFAULT
    capped = configs.sweep(1000, 1600)
    assert [c.budget_bytes for c in capped] == [1000, 1000, 1500, 1500, 1600, 1600]
    assert capped[-1].factor == 1.6 and "budget 1.6x (0.00 MB)" in capped[-1].label
    # A cap at 1.5x: 2x would be the same budget again, so it is left out.
    assert [c.key for c in configs.sweep(1000, 1500)][-1] == "fixed-1.5x-pf0.5"
    assert [c.budget_bytes for c in configs.sweep(1000, 1000)] == [1000, 1000]
    with pytest.raises(AssertionError):
        configs.sweep(1000, 999)


def test_the_cap_is_the_tuned_runs_ram_max_or_twice_the_budget():
    bounds = {"bounds": {"ram_min_bytes": 1000, "ram_max_bytes": 1700}}
    assert configs.ram_cap(bounds, 1000) == (
        1700,
        "the tuned run's autotune bounds (ram_max_bytes)",
    )
    auto = (2000, 'ram_max = "auto": 2x the budget')
    assert configs.ram_cap(None, 1000) == auto
    assert configs.ram_cap({"enabled": True}, 1000) == auto
    assert configs.ram_cap({"bounds": {"ram_max_bytes": 10}}, 1000) == auto


def test_each_configuration_is_served_with_its_own_config_file():
    assert configs.tuned(1234).toml() == '[autotune]\nenabled = true\ninterval = "1s"\n'
    assert (configs.tuned(1234).budget_bytes, configs.tuned(1234).label) == (1234, "autotune on")
    fixed = configs.sweep(2_000_000, 4_000_000)[3]
    assert fixed.toml() == ("[autotune]\nenabled = false\n\n[cache.ram]\nprotect_frequent = 0.5\n")
    assert fixed.label == "fixed: budget 1.5x (3.00 MB), protect_frequent 0.5"


# ---- the configurations played, with a scripted server -------------------------------


class FakeServer:
    """What `play` reads: replies to the trace's requests and /v1/cache/stats."""

    kind = "ours"
    label = "mlx-prompt-cache"
    model_name = "demo-llama"
    url = "http://127.0.0.1:9"

    def __init__(self, config: Config):
        self.config = config
        self.sent = 0


def scripted(monkeypatch, served: list[FakeServer], bounds_max: int | None):
    """`serving` yields a FakeServer; each reply hits half its prompt; the tuned server's
    budget grows a tenth of the configured one per request, up to `bounds_max`."""

    @contextmanager
    def serving(h, config, trace_name):
        server = FakeServer(config)
        served.append(server)
        h.result.servers[config.key] = {"label": config.label}
        yield server

    def stream(url, dialect, body, headers=None, timeout=900.0):
        server = served[-1]
        server.sent += 1
        return client.Reply(True, 200, 0.1, 0.2, prompt_tokens=100, cached_tokens=50,
                            completion_tokens=8, text="ok")  # fmt: skip

    def stats(server):
        c = server.config
        memory = {"shrinks": 0}
        ram = {"evicted_bytes": 7 * server.sent}
        if not c.tuned:
            return {"memory": memory, "ram": ram, "autotune": {"enabled": False}}
        grown = c.budget_bytes + c.budget_bytes // 10 * server.sent
        tune = {"enabled": True, "ram_budget_bytes": grown, "protect_frequent": 0.1,
                "changes": [{"setting": "cache.ram.budget"}] * server.sent}  # fmt: skip
        if bounds_max is not None:
            tune["bounds"] = {"ram_max_bytes": bounds_max}
        return {"memory": memory, "ram": ram, "autotune": tune}

    monkeypatch.setattr(sc, "serving", serving)
    monkeypatch.setattr(sc, "stats", stats)
    monkeypatch.setattr(client, "stream", stream)


def test_tuned_plays_first_and_the_sweep_gets_no_more_ram_than_its_bounds(tmp_path, monkeypatch):
    served: list[FakeServer] = []
    scripted(monkeypatch, served, bounds_max=15_000)
    t = trace(workload.BURST)
    plan = sc.Plan(t, 10_000, 25_000, 100, 250.0)
    model = ModelSpec("demo-llama", tmp_path / "absent", is_demo=True)
    result = sc.run_trace(Settings(tmp_path, model, []), model, plan)
    assert [s.config.key for s in served] == [
        TUNED, "fixed-1x-pf0", "fixed-1x-pf0.5", "fixed-1.5x-pf0", "fixed-1.5x-pf0.5",
    ]  # fmt: skip
    assert [s.config.budget_bytes for s in served] == [10_000] * 3 + [15_000] * 2
    assert all(s.sent == len(t.calls) for s in served)
    assert result.metrics["ram_cap_bytes"] == 15_000
    tuned = result.of(TUNED)
    assert [s.step for s in tuned] == list(range(len(t.calls)))
    assert [s.session for s in tuned[10:14]] == [2, 5, -1, -1], "one-offs have no session"
    # After each request the tuned run read its budget: a tenth more each time.
    assert result.metrics[sc.BUDGETS] == [10_000 + 1_000 * n for n in range(1, len(t.calls) + 1)]
    assert result.metrics[sc.PROTECT] == [0.1] * len(t.calls)
    assert result.metrics["burst_first"] == 12 and result.metrics["burst_last"] == 18
    assert result.rows[0].metric == sc.HEADLINE and result.errors == []
    assert "capped at 0.01 MB: the tuned run's autotune bounds (ram_max_bytes)" in result.notes[-1]


def test_without_bounds_the_sweep_is_capped_at_twice_the_budget(tmp_path, monkeypatch):
    served: list[FakeServer] = []
    scripted(monkeypatch, served, bounds_max=None)
    plan = sc.Plan(trace(workload.SHIFT), 10_000, 25_000, 100, 250.0)
    model = ModelSpec("demo-llama", tmp_path / "absent", is_demo=True)
    result = sc.run_trace(Settings(tmp_path, model, []), model, plan)
    assert [s.config.budget_bytes for s in served[1:]] == [10_000] * 2 + [15_000] * 2 + [20_000] * 2
    assert result.metrics["pivot"] == 24 and result.metrics["burst_first"] is None


# ---- the rows, from samples ------------------------------------------------------------


def samples(key: str, cached: list[int | None], ttft: float) -> list[Sample]:
    return [
        Sample(server=key, step=i, ttft_s=ttft, total_s=ttft + 0.1, prompt_tokens=100,
               cached_tokens=c, completion_tokens=8, source=None, ok=True, label="turn")
        for i, c in enumerate(cached)
    ]  # fmt: skip


def fake_runs(tune: dict | None) -> tuple[ScenarioResult, sc.Plan, list[sc.Run]]:
    plan = sc.Plan(trace(workload.SHIFT), 1_000_000, 2_500_000, 76, 32768.0)
    tuned = sc.Run(configs.tuned(1_000_000), shrinks=0, budgets=[None, 1_250_000, 1_500_000],
                   protect=[0.0, 0.1, 0.2], autotune=tune)  # fmt: skip
    runs = [tuned] + [sc.Run(c, shrinks=i % 2, evicted_bytes=10**6 * i) for i, c in
                      enumerate(configs.sweep(1_000_000, 2_000_000))]  # fmt: skip
    result = ScenarioResult("autotune", "demo-llama (shift)")
    result.samples += samples(TUNED, [0, 60, 90], 0.2)  # 0.5
    result.samples += samples(DEFAULT, [0, 20, 25], 0.4)  # 0.15
    result.samples += samples("fixed-1x-pf0.5", [0, 30, 30], 0.35)  # 0.2
    result.samples += samples("fixed-1.5x-pf0", [0, 50, 55], 0.25)  # 0.35
    result.samples += samples("fixed-1.5x-pf0.5", [0, 50, 55], 0.25)  # a tie: 1.5x pf0 first
    result.samples += samples("fixed-2x-pf0", [0, 40, None], 0.3)  # 0.2 over what it told
    result.samples += samples("fixed-2x-pf0.5", [0, 40, 40], 0.3)
    return result, plan, runs


def test_the_rows_set_tuned_against_default_fixed_and_the_best_of_the_sweep():
    tune = {"enabled": True, "bounds": {"ram_max_bytes": 2_000_000},
            "changes": [{"setting": "cache.ram.budget"}, {"setting": "cache.ram.budget"},
                        {"setting": "cache.ram.protect_frequent"}]}  # fmt: skip
    result, plan, runs = fake_runs(tune)
    sc.summarize(result, plan, runs)
    rows = {r.metric: r for r in result.rows}
    head = result.rows[0]
    assert head.metric == sc.HEADLINE and head.values == {"ours": 0.5}
    assert head.ratios == pytest.approx({"tuned / default fixed": 0.5 / 0.15,
                                         "tuned / best fixed": 0.5 / 0.35})  # fmt: skip
    assert head.note == (
        "shift: default fixed (autotune off, the same budget, plain LRU) 0.15, best fixed "
        "(fixed: budget 1.5x (1.50 MB), protect_frequent 0) 0.35; targets tuned / default "
        "fixed ≥ 1.1 (met), tuned / best fixed ≥ 0.95 (met)"
    )
    ttft = rows[sc.TTFT_ROW]
    assert ttft.values == pytest.approx({"ours": 0.2})
    assert ttft.ratios == pytest.approx({"default fixed / tuned": 2.0, "best fixed / tuned": 1.25})
    assert "(met)" in ttft.note and "MISSED" not in ttft.note
    default = rows[
        "token hit ratio, fixed: budget 1x (1.00 MB), protect_frequent 0 (default fixed)"
    ]
    assert default.values == pytest.approx({"ours": 0.15})
    assert default.ratios == pytest.approx({"tuned / this": 0.5 / 0.15})
    assert default.note == "mean TTFT 0.4 s; evicted 0.00 MB"
    assert rows["token hit ratio, fixed: budget 2x (2.00 MB), protect_frequent 0"].values == (
        pytest.approx({"ours": 0.2})
    )
    budget = rows["RAM budget, autotune on, after the last request (bytes)"]
    assert budget.values == {"ours": 1_500_000}
    assert budget.ratios == {"end / configured": 1.5, "largest / configured": 1.5}
    assert budget.note.endswith("ram_max 2.00 MB; 2 budget changes, 1 protect_frequent changes")
    assert rows["protect_frequent, autotune on, after the last request"].values == {"ours": 0.2}
    shrinks = rows[sc.SHRINKS_ROW]
    assert (shrinks.values, shrinks.note) == (
        {"ours": 0},
        "target 0; every configuration of this trace: 3",
    )
    ws = rows["working set of the trace (bytes)"]
    assert ws.ratios == {"working set / configured budget": 2.5}
    assert ws.note.startswith(
        "76 distinct 64-token blocks (counted from the trace's text) x 32.8 KB"
    )
    m = result.metrics
    assert m["best_fixed"] == "fixed-1.5x-pf0" and m["hit_ratio_tuned"] == 0.5
    assert m["memory_shrinks_all"] == 3 and m[sc.BUDGETS] == [None, 1_250_000, 1_500_000]
    assert m["evicted_bytes_fixed-2x-pf0.5"] == 5 * 10**6 and m["evicted_bytes_tuned"] is None
    assert sc.NO_AUTOTUNE not in result.notes
    assert "from request 25: the other half of the projects" in " ".join(result.notes)
    assert main_table([result]).splitlines()[2] == (
        "| autotune | demo-llama (shift) | token hit ratio, autotune on (cached / prompt tokens) "
        "| 0.5 | tuned / default fixed: 3.33×; tuned / best fixed: 1.43× |"
    )
    assert "(default fixed)" in details(result)


def test_missed_targets_say_so():
    result, plan, runs = fake_runs({"enabled": True})
    result.samples = [s for s in result.samples if s.server != TUNED]
    result.samples += samples(TUNED, [0, 20, 30], 0.45)  # 0.1667: over default, under best
    sc.summarize(result, plan, runs)
    head, ttft = result.rows[0], result.rows[1]
    assert head.note.endswith(
        "tuned / default fixed ≥ 1.1 (met), tuned / best fixed ≥ 0.95 (MISSED)"
    )
    assert ttft.note.endswith(
        "default fixed / tuned ≥ 1.1 (MISSED), best fixed / tuned ≥ 0.95 (MISSED)"
    )


def test_a_server_without_the_autotune_section_reports_null_and_says_so(tmp_path):
    result, plan, runs = fake_runs(None)
    runs[0].budgets, runs[0].protect = [None] * 3, [None] * 3
    sc.summarize(result, plan, runs)
    rows = {r.metric: r for r in result.rows}
    assert rows["RAM budget, autotune on, after the last request (bytes)"].values == {"ours": None}
    assert rows["protect_frequent, autotune on, after the last request"].values == {"ours": None}
    assert sc.NO_AUTOTUNE in result.notes and result.metrics["autotune_changes"] == []
    assert result.rows[0].values == {"ours": 0.5}, "the hit ratios stand without it"
    plots, skipped = plot_all(tmp_path, [result])  # a plot with nothing on it still draws
    assert skipped or [p.name for p in plots] == ["autotune.png"]


def test_the_plot_draws_the_budget_and_policy_of_each_trace(tmp_path):
    pytest.importorskip("matplotlib")
    result, plan, runs = fake_runs({"enabled": True})
    sc.summarize(result, plan, runs)
    result.metrics |= {"pivot": 1, "burst_first": None}
    plots, skipped = plot_all(tmp_path, [result, result])
    assert skipped is None and [p.name for p in plots] == ["autotune.png"]
    assert Path(plots[0]).stat().st_size > 10_000
