"""The autotune scenario: does tuning the RAM tier by load beat the fixed settings?

Three traces (workload.py) whose working sets are ~2.5x the RAM budget, each played on our
proxy alone under several configurations (configs.py), one server at a time on a fresh
cache dir with the SSD tier off, so what RAM keeps is all the cache has: "tuned" (autotune
on, the default), "default fixed" (autotune off, the same budget, plain LRU) and a sweep of
fixed budgets and protect_frequent, capped at the most RAM tuned may take. The budget is
sized from the trace: a calibration server reports the bytes its RAM tier holds for one of
the trace's requests, and the trace's distinct blocks are counted without a server.

Per trace: the token hit ratio and mean TTFT of tuned against default fixed (target
>= 1.1x) and against the best of the sweep (target >= 0.95x), the RAM budget and
protect_frequent after each request of the tuned run (GET /v1/cache/stats `autotune`),
and the memory guard's shrinks (target 0: tuning never brings the guard on).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ... import servers
from ...harness import Harness, Settings, chars_per_token, stats
from ...results import Row, Sample, ScenarioResult, mean, ratio, total
from ...servers import ModelSpec, Server
from . import configs, workload
from .configs import DEFAULT, TUNED, Config

# The trace's distinct blocks over the budget it is given.
WS_OVER_BUDGET = 2.5
# A shifting load has one working set at a time: the larger half's over the budget (more
# than the budget holds, within the twice it that tuning may reach). Sized from the whole
# trace instead, each half would be 1.36x the budget, and no fixed setting of the sweep
# would reach 1.1x the default's hit ratio on it.
PHASE_OVER_BUDGET = 1.75
# RAM policy is what is measured: no SSD tier to fall back on.
SSD_OFF = {"MLX_PROMPT_CACHE_CACHE_SSD_ENABLED": "false"}
CALIBRATION_BUDGET = 1 << 30
TARGET_DEFAULT, TARGET_BEST = 1.1, 0.95
HEADLINE = "token hit ratio, autotune on (cached / prompt tokens)"
TTFT_ROW = "mean TTFT, autotune on (s)"
SHRINKS_ROW = "memory guard shrinks (memory.shrinks), autotune on"
# metrics: the tuned run's RAM budget and protect_frequent after each request (plots.py)
BUDGETS, PROTECT = "tuned_ram_budget_bytes", "tuned_protect_frequent"
NO_AUTOTUNE = "/v1/cache/stats has no `autotune` section: its budget and policy are null"


@dataclass(slots=True)
class Run:
    """One configuration's run of a trace: what its server said after it."""

    config: Config
    shrinks: int | None = None  # memory.shrinks at the end
    evicted_bytes: int | None = None
    # The tuned run's autotune section after each request (None where it was absent).
    budgets: list[int | None] = field(default_factory=list)
    protect: list[float | None] = field(default_factory=list)
    autotune: dict[str, Any] | None = None  # the last one read


@dataclass(frozen=True, slots=True)
class Plan:
    """What a trace is played with: its calls, the budget, and how that was sized."""

    trace: workload.Trace
    budget_bytes: int
    working_set_bytes: int
    working_set_blocks: int
    bytes_per_block: float  # of the estimate's blocks, as the calibration measured them


def autotune(settings: Settings, model: ModelSpec) -> list[ScenarioResult]:
    """One result per trace: tuned, default fixed and the sweep, side by side."""
    sizes = workload.Sizes.of(settings.quick)
    cpt = chars_per_token(model)
    traces = [workload.build(name, settings.seed, sizes) for name in workload.NAMES]
    try:
        per_block = calibrate(settings, model, traces[0], cpt)
    except Exception as e:  # a server that will not start: every trace says why
        return [_failed(model, t.name, e) for t in traces]
    out = []
    for trace in traces:
        plan = plan_for(trace, cpt, per_block)
        out.append(_guarded(model, trace.name, lambda plan=plan: run_trace(settings, model, plan)))
    return out


def _name(model: ModelSpec, trace: str) -> str:
    return f"{model.id} ({trace})"


def _failed(
    model: ModelSpec, trace: str, e: Exception, start: float | None = None
) -> ScenarioResult:
    failed = ScenarioResult("autotune", _name(model, trace))
    failed.errors.append(f"{type(e).__name__}: {e}")
    failed.seconds = time.perf_counter() - start if start is not None else 0.0
    return failed


def _guarded(model: ModelSpec, trace: str, fn: Callable[[], ScenarioResult]) -> ScenarioResult:
    """A trace's result; a failure carries the error, so the other traces still run
    (registry.guarded, which this package cannot import: a circle)."""
    start = time.perf_counter()
    try:
        return fn()
    except Exception as e:  # a server that will not start
        return _failed(model, trace, e, start)


def calibrate(settings: Settings, model: ModelSpec, trace: workload.Trace, cpt: float) -> float:
    """Bytes the RAM tier holds per block of the estimate (workload.blocks), measured on the
    trace's longest request on a server with room for it."""
    call = max(trace.calls, key=lambda c: len(workload.text(c.body)))
    result = ScenarioResult("autotune", _name(model, "calibration"))
    config = Config("calibration", CALIBRATION_BUDGET, 0.0, tuned=False)
    with Harness(settings, result, model) as h, serving(h, config, "autotune") as server:
        before = (stats(server).get("ram") or {}).get("bytes")  # what the warm-up left
        sample = h.send(server, "openai", call.body, 0)
        h.progress("calibration: one request", server, sample)
        after = (stats(server).get("ram") or {}).get("bytes")
    if not sample.ok or before is None or not after or after <= before:
        raise RuntimeError(f"calibration read no RAM bytes: {result.errors or (before, after)}")
    return (after - before) / len(workload.blocks(call.body, cpt))


def plan_for(trace: workload.Trace, cpt: float, per_block: float) -> Plan:
    blocks = workload.working_set(trace.calls, cpt)
    ws = int(blocks * per_block)
    if trace.name != workload.SHIFT:
        return Plan(trace, int(ws / WS_OVER_BUDGET), ws, blocks, per_block)
    halves = (trace.calls[: trace.pivot], trace.calls[trace.pivot :])
    live = max(workload.working_set(half, cpt) for half in halves)
    return Plan(trace, int(live * per_block / PHASE_OVER_BUDGET), ws, blocks, per_block)


@contextmanager
def serving(h: Harness, config: Config, trace: str) -> Iterator[Server]:
    """Our proxy under `config`, on a fresh cache dir with the SSD tier off."""
    name = f"{trace}-{config.key}"
    path = h.work / f"{name}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config.toml())
    cache_dir = servers.fresh_cache_dir(h.work, name, h.model)
    args = (*h.settings.proxy_args, "--ram-budget", str(config.budget_bytes),
            "--config", str(path))  # fmt: skip
    server = h.fleet.add(servers.start("ours", h.model, h.logs, cache_dir, name, args, SSD_OFF))
    try:
        h.warm(server, config.key)
        h.result.servers[config.key] |= {"config": config.toml(), "label": config.label,
                                         "ram_budget_bytes": config.budget_bytes}  # fmt: skip
        yield server
    finally:
        server.stop()
        h.fleet.servers.remove(server)


def run_trace(settings: Settings, model: ModelSpec, plan: Plan) -> ScenarioResult:
    trace = plan.trace
    result = ScenarioResult("autotune", _name(model, trace.name))
    with Harness(settings, result, model) as h:
        tuned = play(h, configs.tuned(plan.budget_bytes), trace)
        cap, cap_source = configs.ram_cap(tuned.autotune, plan.budget_bytes)
        runs = [tuned] + [play(h, c, trace) for c in configs.sweep(plan.budget_bytes, cap)]
    burst = trace.one_offs()
    result.metrics |= {"ram_cap_bytes": cap, "calls": len(trace.calls), "pivot": trace.pivot,
                       "burst_first": burst[0] if burst else None,
                       "burst_last": burst[-1] if burst else None}  # fmt: skip
    summarize(result, plan, runs)
    result.notes.append(f"the sweep's budgets are capped at {cap / 1e6:.2f} MB: {cap_source}")
    return result.finish()


def play(h: Harness, config: Config, trace: workload.Trace) -> Run:
    """The trace's calls in order; after each, the tuned run reads its budget and policy.

    Every run reads its stats after each request, as the tuned one must: a stats read
    costs the server a little time (the diagnosis, the tiers' figures), and only the same
    load leaves the runs' TTFTs comparable."""
    run = Run(config)
    with serving(h, config, trace.name) as server:
        for i, call in enumerate(trace.calls):
            session = call.session if call.session is not None else -1
            sample = h.send(server, "openai", call.body, i, session=session)
            sample.server = config.key
            h.progress(f"{trace.name} {config.key} {i + 1}/{len(trace.calls)}", config.key,
                       sample)  # fmt: skip
            read = stats(server)
            if config.tuned:
                _track(run, read)
        last = stats(server)
    if config.tuned:
        _track(run, last, record=False)
    run.shrinks = (last.get("memory") or {}).get("shrinks")
    run.evicted_bytes = (last.get("ram") or {}).get("evicted_bytes")
    return run


def _track(run: Run, s: dict[str, Any], record: bool = True) -> None:
    tune = s.get("autotune")
    if tune is not None:
        run.autotune = tune
    if record:
        run.budgets.append((tune or {}).get("ram_budget_bytes"))
        run.protect.append((tune or {}).get("protect_frequent"))


# ---- rows ------------------------------------------------------------------------------


def hit_ratio(samples: Iterable[Sample]) -> float | None:
    """Cached over prompt tokens, over the requests whose server said what it cached."""
    told = [s for s in samples if s.prompt_tokens and s.cached_tokens is not None]
    return ratio(total(s.cached_tokens for s in told), total(s.prompt_tokens for s in told))


def best_fixed(result: ScenarioResult, runs: list[Run]) -> Run | None:
    """The fixed run with the highest hit ratio; the smaller budget on a tie."""
    scored = [(hit_ratio(result.of(r.config.key)), r) for r in runs if not r.config.tuned]
    scored = [(h, r) for h, r in scored if h is not None]
    # max() keeps the first of equals: the sweep runs the smaller budgets first.
    return max(scored, key=lambda hr: hr[0], default=(None, None))[1]


def _verdict(value: float | None, target: float) -> str:
    return "null" if value is None else ("met" if value >= target else "MISSED")


def summarize(result: ScenarioResult, plan: Plan, runs: list[Run]) -> None:
    by_key = {r.config.key: r for r in runs}
    hits = {k: hit_ratio(result.of(k)) for k in by_key}
    ttft = {k: mean(s.ttft_s for s in result.of(k) if s.ok) for k in by_key}
    best = best_fixed(result, runs)
    b = best.config.key if best else None
    vs_default, vs_best = ratio(hits[TUNED], hits.get(DEFAULT)), ratio(hits[TUNED], hits.get(b))
    faster_default = ratio(ttft.get(DEFAULT), ttft[TUNED])
    faster_best = ratio(ttft.get(b), ttft[TUNED])
    best_label = best.config.label if best else "none"
    result.rows += [
        Row(HEADLINE, {"ours": hits[TUNED]},
            {"tuned / default fixed": vs_default, "tuned / best fixed": vs_best},
            note=f"{plan.trace.name}: default fixed (autotune off, the same budget, plain LRU) "
            f"{_fmt(hits.get(DEFAULT))}, best fixed ({best_label}) {_fmt(hits.get(b))}; "
            f"targets tuned / default fixed ≥ {TARGET_DEFAULT:g} "
            f"({_verdict(vs_default, TARGET_DEFAULT)}), tuned / best fixed ≥ {TARGET_BEST:g} "
            f"({_verdict(vs_best, TARGET_BEST)})"),
        Row(TTFT_ROW, {"ours": ttft[TUNED]},
            {"default fixed / tuned": faster_default, "best fixed / tuned": faster_best},
            note=f"every request of the trace; default fixed {_fmt(ttft.get(DEFAULT))} s, "
            f"best fixed {_fmt(ttft.get(b))} s; targets default fixed / tuned ≥ "
            f"{TARGET_DEFAULT:g} ({_verdict(faster_default, TARGET_DEFAULT)}), best fixed / "
            f"tuned ≥ {TARGET_BEST:g} ({_verdict(faster_best, TARGET_BEST)})"),
    ]  # fmt: skip
    for r in runs:
        if r.config.tuned:
            continue
        name = " (default fixed)" if r.config.key == DEFAULT else ""
        result.rows.append(
            Row(f"token hit ratio, {r.config.label}{name}", {"ours": hits[r.config.key]},
                {"tuned / this": ratio(hits[TUNED], hits[r.config.key])},
                note=f"mean TTFT {_fmt(ttft[r.config.key])} s; evicted {_mb(r.evicted_bytes)}")
        )  # fmt: skip
    _tuning_rows(result, plan, by_key[TUNED], runs)
    result.metrics |= {
        "budget_bytes": plan.budget_bytes,
        "working_set_bytes": plan.working_set_bytes,
        "tuned_over_default_hit_ratio": vs_default,
        "tuned_over_best_hit_ratio": vs_best,
        "default_over_tuned_ttft": faster_default,
        "best_over_tuned_ttft": faster_best,
        "best_fixed": b,
    }
    result.metrics |= {f"hit_ratio_{k}": v for k, v in hits.items()}
    result.metrics |= {f"mean_ttft_{k}": v for k, v in ttft.items()}
    result.metrics |= {f"evicted_bytes_{r.config.key}": r.evicted_bytes for r in runs}


def _tuning_rows(result: ScenarioResult, plan: Plan, tuned: Run, runs: list[Run]) -> None:
    """What the tuner did (its budget and policy over the requests), the guard's shrinks,
    and the trace's size against the budget."""
    tune = tuned.autotune
    budgets = [b for b in tuned.budgets if b is not None]
    protect = [p for p in tuned.protect if p is not None]
    changes = (tune or {}).get("changes") or []
    settings = [c.get("setting", "") for c in changes]
    n_budget = sum(s.endswith("budget") for s in settings)
    n_protect = sum(s.endswith("protect_frequent") for s in settings)
    cap = ((tune or {}).get("bounds") or {}).get("ram_max_bytes")
    told = [r.shrinks for r in runs if r.shrinks is not None]
    every = sum(told) if told else None
    result.rows += [
        Row("RAM budget, autotune on, after the last request (bytes)",
            {"ours": budgets[-1] if budgets else None},
            {"end / configured": ratio(budgets[-1] if budgets else None, plan.budget_bytes),
             "largest / configured": ratio(max(budgets, default=None), plan.budget_bytes)},
            note=f"configured {plan.budget_bytes / 1e6:.2f} MB, ram_max "
            f"{_mb(cap)}; {n_budget} budget changes, {n_protect} protect_frequent changes"),
        Row("protect_frequent, autotune on, after the last request",
            {"ours": protect[-1] if protect else None},
            note=f"from {tuned.config.protect_frequent:g}; lowest "
            f"{_fmt(min(protect, default=None))}, highest "
            f"{_fmt(max(protect, default=None))} over the requests"),
        Row(SHRINKS_ROW, {"ours": tuned.shrinks},
            note=f"target 0; every configuration of this trace: {_fmt(every)}"),
        Row("working set of the trace (bytes)", {"ours": plan.working_set_bytes},
            {"working set / configured budget": ratio(plan.working_set_bytes,
                                                       plan.budget_bytes)},
            note=f"{plan.working_set_blocks} distinct 64-token blocks (counted from the "
            f"trace's text) x {plan.bytes_per_block / 1e3:.1f} KB, the RAM bytes per block a "
            "calibration request held"),
    ]  # fmt: skip
    result.metrics[BUDGETS] = tuned.budgets
    result.metrics[PROTECT] = tuned.protect
    result.metrics["autotune_changes"] = changes
    result.metrics["memory_shrinks_tuned"] = tuned.shrinks
    result.metrics["memory_shrinks_all"] = every
    if tune is None:
        result.notes.append(NO_AUTOTUNE)
    if burst := plan.trace.one_offs():
        result.notes.append(f"requests {burst[0] + 1}..{burst[-1] + 1}: the burst of one-off "
                            "prompts; the same projects before and after")  # fmt: skip
    elif plan.trace.pivot is not None:
        result.notes.append(f"from request {plan.trace.pivot + 1}: the other half of the "
                            "projects, none of the first half")  # fmt: skip
    result.notes.append(
        f"[autotune] interval = {configs.INTERVAL} in the tuned run (default 10s, least 1s): the "
        "bench sends requests back to back; every other setting is the default"
    )


def _fmt(value: float | None) -> str:
    return "null" if value is None else f"{value:.3g}"


def _mb(n: Any) -> str:
    return f"{n / 1e6:.2f} MB" if isinstance(n, int | float) else "null"
