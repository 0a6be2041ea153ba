"""The chat, agent, agent-templates, share and hybrid scenarios, and the registry of all.

Every server gets the same requests in the same order, one at a time, streaming and greedy.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from .. import traces
from ..harness import Harness, Settings, chars_per_token, probe, stats
from ..prerequisites import skip_reason
from ..results import Row, Sample, ScenarioResult, mean, ratio, total
from ..servers import KINDS, ModelSpec

NEW_ONLY_NOTE = (
    "new-only = TTFT of the --no-cache server for a prompt made of just the turn's new "
    "messages (the previous reply and the new user message, as one user message): "
    "measured, not derived from a prefill rate"
)


def chat(settings: Settings, model: ModelSpec, scenario: str = "chat") -> ScenarioResult:
    """Turns of one conversation with a long system prompt: does TTFT stay flat?"""
    result = ScenarioResult(scenario, model.id)
    turns = settings.size(4, 10) if scenario == "chat" else settings.size(3, 10)
    system_tokens = settings.size(1000, 2000)
    trace = traces.chat_trace(settings.seed, turns, system_tokens, chars_per_token(model))
    with Harness(settings, result, model) as h:
        for kind in KINDS:
            with h.serve(kind) as server:
                for t in range(turns):
                    step = f"turn {t + 1}/{turns}"
                    sample = h.send(server, "openai", {"messages": trace.messages(t)}, t)
                    h.progress(step, server, sample)
                    if kind == "nocache" and t >= 1:
                        body = {"messages": trace.new_only(t)}
                        sample = h.send(server, "openai", body, t, label="new-only")
                        h.progress(step, "new-only", sample)
                if kind == "ours":
                    result.metrics["ram_bytes_after"] = stats(server).get("ram", {}).get("bytes")
    _summarize_chat(result)
    return result.finish()


def _summarize_chat(result: ScenarioResult) -> None:
    ttft = {k: [s.ttft_s for s in result.of(k)] for k in KINDS}
    warm = {k: mean(v[1:]) for k, v in ttft.items()}
    result.rows.append(
        Row(
            "mean TTFT of turns 2..N (s)",
            warm,
            {
                "no-cache / ours": ratio(warm["nocache"], warm["ours"]),
                "mlx_lm / ours": ratio(warm["mlx_lm"], warm["ours"]),
            },
        )
    )
    result.rows.append(
        Row("TTFT of turn 1, cold (s)", {k: v[0] if v else None for k, v in ttft.items()})
    )
    last = {k: v[-1] if v else None for k, v in ttft.items()}
    result.rows.append(
        Row(
            "TTFT of the last turn (s)",
            last,
            {
                "no-cache / ours": ratio(last["nocache"], last["ours"]),
                "mlx_lm / ours": ratio(last["mlx_lm"], last["ours"]),
            },
            note="turns add different numbers of new tokens, so warm TTFT moves with them; "
            "flat means it follows the new tokens, not the conversation's length",
        )
    )
    new_only = {s.step: s.ttft_s for s in result.of("nocache", "new-only")}
    per_turn = [ratio(s.ttft_s, new_only.get(s.step)) for s in result.of("ours")[1:]]
    result.rows.append(
        Row(
            "TTFT of prefilling only the new tokens (s)",
            {"nocache": mean(new_only.values())},
            {"ours warm / new-only (mean of turns 2..N)": mean(per_turn)},
            note=NEW_ONLY_NOTE,
        )
    )
    _hit_row(result)
    ours, plain = result.of("ours"), result.of("nocache")
    same = [a.output == b.output for a, b in zip(ours, plain, strict=False) if a.ok and b.ok]
    result.metrics["greedy_outputs_equal_ours_vs_nocache"] = sum(same) / len(same) if same else None


def _hit_row(result: ScenarioResult) -> None:
    hits = {}
    for k in KINDS:
        samples = [s for s in result.of(k) if s.prompt_tokens]
        hits[k] = ratio(
            total(s.cached_tokens or 0 for s in samples), total(s.prompt_tokens for s in samples)
        )
    result.rows.append(Row("token hit ratio (cached / prompt tokens)", hits))


def agent(settings: Settings, model: ModelSpec) -> ScenarioResult:
    """A coding-agent session over the Anthropic API, then a second session in the project."""
    result = ScenarioResult("agent", model.id)
    trace = traces.agent_trace(
        settings.seed,
        calls_per_session=settings.size((4, 3), (12, 8)),
        system_chars=settings.size(2000, 9000),
        tool_detail_chars=settings.size(0, 300),
        result_chars=settings.size(800, 3000),
        # Quick: schemas without property descriptions, so prefills fit a 2-core CPU.
        compact_tools=settings.quick,
    )
    result.metrics["calls"] = len(trace.calls)
    with Harness(settings, result, model) as h:
        for kind in KINDS:
            with h.serve(kind) as server:
                for i, call in enumerate(trace.calls):
                    step = f"request {i + 1}/{len(trace.calls)} (session {call.session + 1})"
                    body = call.anthropic(server.model_name, settings.max_tokens)
                    if kind == "mlx_lm":
                        sample = h.send(
                            server, "openai", traces.to_openai(body), i, session=call.session
                        )
                    else:
                        sample = h.send(server, "anthropic", body, i, session=call.session)
                    h.progress(step, server, sample)
                if kind == "ours":
                    result.metrics["server_hit_ratio_ours"] = stats(server).get("hit_ratio")
    totals = {k: total(s.ttft_s for s in result.of(k)) for k in KINDS}
    result.rows.append(
        Row(
            "total TTFT over all requests (s)",
            totals,
            {
                "no-cache / ours": ratio(totals["nocache"], totals["ours"]),
                "mlx_lm / ours": ratio(totals["mlx_lm"], totals["ours"]),
            },
        )
    )
    _hit_row(result)
    firsts = {k: next((s for s in result.of(k) if s.session == 1), None) for k in KINDS}
    result.rows.append(
        Row(
            "session 2, first request: cached tokens",
            {k: s.cached_tokens if s else None for k, s in firsts.items()},
            note="the billing header in the first system block differs between sessions",
        )
    )
    pairs = zip(result.of("ours"), result.of("mlx_lm"), strict=False)
    diffs = [
        a.prompt_tokens - b.prompt_tokens for a, b in pairs if a.prompt_tokens and b.prompt_tokens
    ]
    result.metrics["prompt_tokens_ours_minus_mlx_lm_max"] = max(diffs, default=None)
    result.metrics["prompt_tokens_ours_minus_mlx_lm_min"] = min(diffs, default=None)
    result.notes.append(
        "ours and --no-cache get the Anthropic request; mlx_lm.server the same call converted "
        "to OpenAI (traces.to_openai). Ours drops the per-session billing header line before "
        "tokenizing, so its prompts are a few tokens shorter."
    )
    return result.finish()


def share(settings: Settings, model: ModelSpec) -> ScenarioResult:
    """Sessions that share one system prompt: what does each cost the RAM tier?"""
    result = ScenarioResult("share", model.id)
    sessions = settings.size(4, 16)
    system_tokens = settings.size(1000, 2000)
    trace = traces.chat_trace(settings.seed + 2, sessions, system_tokens, chars_per_token(model))
    before = after = None
    with Harness(settings, result, model) as h:
        for kind in ("ours", "mlx_lm"):
            with h.serve(kind) as server:
                if kind == "ours":
                    before = stats(server).get("ram", {}).get("bytes")
                for k in range(sessions):
                    body = {"messages": trace.session(k)}
                    sample = h.send(server, "openai", body, k, session=k)
                    h.progress(f"session {k + 1}/{sessions}", server, sample)
                if kind == "ours":
                    after = stats(server).get("ram", {}).get("bytes")
    ours = [s for s in result.of("ours") if s.prompt_tokens]
    lengths = [s.prompt_tokens + (s.completion_tokens or 0) for s in ours]
    mean_len = int(round(mean(lengths) or 0))
    one_copy = None
    if mean_len:
        kv = probe("kv-bytes", str(model.path), str(mean_len))
        one_copy = kv["bytes"][0]
        result.metrics |= {"one_copy_tokens": mean_len, "one_copy_held_bytes": kv["held_bytes"][0]}
    used = after - before if after is not None and before is not None else None
    per_session = used / sessions if used is not None else None
    result.metrics |= {"sessions": sessions, "ram_bytes_before": before, "ram_bytes_after": after}
    result.rows.append(
        Row(
            f"cache bytes per session ({sessions} sessions)",
            {"ours": per_session, "mlx_lm": one_copy},
            {
                "one copy / ours per session": ratio(one_copy, per_session),
                f"{sessions} copies / ours total": ratio(
                    one_copy * sessions if one_copy else None, used
                ),
            },
            note="mlx_lm column: one uncached copy of a session's state (prompt + output), "
            "measured in-process with mlx-lm; mlx_lm.server keeps one such copy per cached "
            "sequence and does not report its bytes over HTTP",
        )
    )
    ttft = {k: mean(s.ttft_s for s in result.of(k)[1:]) for k in ("ours", "mlx_lm")}
    result.rows.append(
        Row(
            "mean TTFT of sessions 2..N (s)",
            ttft,
            {"mlx_lm / ours": ratio(ttft["mlx_lm"], ttft["ours"])},
        )
    )
    return result.finish()


def hybrid(settings: Settings, model: ModelSpec) -> list[ScenarioResult]:
    """Chat and restart on each hybrid/sliding-window model (demo-hybrid, demo-swa)."""
    from .restart import restart

    out = []
    for m in settings.hybrid_models:
        out.append(guarded("hybrid/chat", m, lambda m=m: chat(settings, m, "hybrid/chat")))
        out.append(guarded("hybrid/restart", m, lambda m=m: restart(settings, m, "hybrid/restart")))
    return out


Produced = ScenarioResult | list[ScenarioResult]

AGENT_TEMPLATES_QUICK = ("qwen3_6.jinja", "qwen3_5.jinja")
AGENT_TEMPLATES_FULL = (
    *AGENT_TEMPLATES_QUICK,
    "minimax_m2.jinja",
    "gpt_oss_harmony.jinja",
    "gemma4_31b_it.jinja",
    "glm_4_7_flash.jinja",
)
AGENT_REPLAY_NOTE = (
    "mlx_lm.server cannot be forced to write the markup (its logits processors are built "
    "inside the server, with no hook): it is sent the very requests ours got in the "
    "no-pause session (the same prompts, reasoning dropped) and writes what it writes; "
    "its cache is reported as it is"
)


def agent_templates(settings: Settings, model: ModelSpec) -> list[ScenarioResult]:
    """Agent sessions on real chat templates (bench/agent_session.py): the share of each
    prompt the cache serves, and TTFT, per template."""
    from engine_bridge.models.demo.real_templates import templates_dir

    folder = templates_dir()
    if not folder.is_dir():
        reason = f"the real chat templates are not here: {folder.resolve()}"
        return [ScenarioResult("agent-templates", "real templates", skipped=reason)]
    root = settings.out / "work" / "agent-templates"
    templates = settings.size(AGENT_TEMPLATES_QUICK, AGENT_TEMPLATES_FULL)
    if chosen := os.environ.get("MLX_PROMPT_CACHE_BENCH_TEMPLATES"):
        # e.g. "minimax_m2.jinja,glm_4_7_flash.jinja": other families at --quick sizes.
        templates = tuple(t.strip() for t in chosen.split(",") if t.strip())
    built = probe("families", str(root / "models"), *templates)["models"]
    out = []
    for m in built:
        spec = ModelSpec(m["case"], Path(m["path"]), is_demo=False)
        out.append(
            guarded("agent-templates", spec, lambda m=m, spec=spec: _agent_case(settings, spec, m))
        )
    return out


def _agent_case(settings: Settings, model: ModelSpec, case: dict) -> ScenarioResult:
    from .. import agent_session as session

    result = ScenarioResult("agent-templates", model.id)
    plan = session.script(
        case["template"], settings.seed,
        system_chars=settings.size(16_000, 60_000),
        result_chars=settings.size(300, 4_000),
        reasoning_chars=settings.size(400, 1_500),
    )  # fmt: skip
    forced = settings.out / "work" / "agent-templates" / f"{model.id}-forced.json"
    forced.write_text(json.dumps({"outputs": plan.forced()}))
    env = {"MLX_PROMPT_CACHE_FORCE_OUTPUT": str(forced)}
    played: dict[tuple[str, str], list[session.Record]] = {}
    warm: dict = {}

    def play(kind: str, label: str, server, **kw) -> None:
        try:
            recs = session.run_session(server.url, server.model_name, "openai", plan,
                                       send_back_reasoning=False, session=label, **kw)  # fmt: skip
        except Exception as e:  # a session that cannot go on: record why, keep the rest
            result.errors.append(f"{server.label} {label}: {type(e).__name__}: {e}")
            return
        played[kind, label] = recs
        _agent_samples(h, result, kind, label, recs)

    with Harness(settings, result, model) as h:
        # --no-cache first: its new questions' TTFT (a cold prefill) sizes the pause.
        with h.serve("nocache", env) as server:
            play("nocache", "no pause", server)
        cold = {r.task: r.ttft_s or 0.0 for r in played.get(("nocache", "no pause"), [])
                if r.step == 0}  # fmt: skip
        with h.serve("ours", env) as server:
            play("ours", "no pause", server)
            play("ours", "pause", server, pause_s=lambda t: cold.get(t, 0.0))
            warm = stats(server).get("warm_ahead") or {}
        if not case.get("flag"):
            # The trade docs/templates.md names: reasoning the client dropped left out.
            config = forced.with_name(f"{model.id}-restore-off.toml")
            config.write_text(f'[model."{model.path.name}"]\nrestore_reasoning = false\n')
            h.settings = dataclasses.replace(
                settings, proxy_args=(*settings.proxy_args, "--config", str(config))
            )
            try:
                with h.serve("ours", env) as server:
                    play("ours", RESTORE_OFF, server)
            finally:
                h.settings = settings
        with h.serve("mlx_lm") as server:
            ours = played.get(("ours", "no pause"), [])
            recs = session.replay(server.url, server.model_name, ours, settings.max_tokens)
            _agent_samples(h, result, "mlx_lm", "no pause", recs)
    result.metrics |= {f"warm_ahead_{k}": v for k, v in warm.items() if isinstance(v, int | float)}
    result.metrics["pause_s_mean"] = mean(v for t, v in cold.items() if t > 0)
    _agent_rows(result, case)
    return result.finish()


RESTORE_OFF = "no pause, restore_reasoning = false"
_SUFFIX = {"no pause": "", "pause": "-paused", RESTORE_OFF: "-restore-off"}


def _agent_samples(h: Harness, result: ScenarioResult, kind: str, label: str, recs) -> None:
    suffix = _SUFFIX[label]
    for i, r in enumerate(recs):
        sample = Sample(
            server=kind, step=i, ttft_s=r.ttft_s, total_s=r.total_s,
            prompt_tokens=r.prompt_tokens, cached_tokens=r.cached_tokens,
            completion_tokens=r.completion_tokens, source=None, ok=True,
            label=r.kind + suffix, session=r.task, output=r.text,
        )  # fmt: skip
        result.samples.append(sample)
        h.progress(f"{label} task {r.task + 1} step {r.step + 1}", kind, sample)


def _agent_rows(result: ScenarioResult, case: dict) -> None:
    def per(label: str, pick=lambda s: s.hit_ratio, later: bool = True) -> dict[str, float | None]:
        # Questions 2..3: the first question of a session has no task before it.
        return {k: mean(pick(s) for s in result.of(k, label) if not later or s.session > 0)
                for k in KINDS if result.of(k, label)}  # fmt: skip

    ttft = lambda s: s.ttft_s  # noqa: E731
    q, q_paused = per("question"), per("question-paused")
    result.rows.append(
        Row(
            "new question: share of its prompt from the cache, no pause",
            q,
            note=f"{case['template']}, OpenAI chat, reasoning dropped by the client; "
            "questions 2 and 3 (each after a task of two tool steps)",
        )  # fmt: skip
    )
    result.rows.append(
        Row(
            "new question after a pause as long as its cold prefill: share from the cache",
            q_paused,
            note="pause = the --no-cache server's TTFT of that question",
        )  # fmt: skip
    )
    tools = per("tool", later=False)
    result.rows.append(Row("tool step: share of its prompt from the cache (mean)", tools))
    if result.of("ours", "question-restore-off"):
        note = "the client's dropped reasoning left out ([model] restore_reasoning = false)"
        result.rows.append(
            Row("new question, no pause, restore_reasoning = false: share from the cache",
                per("question-restore-off"), note=note)
        )  # fmt: skip
        result.rows.append(
            Row("tool step, restore_reasoning = false: share from the cache (mean)",
                per("tool-restore-off", later=False))
        )  # fmt: skip
    result.metrics["tool_share_min_ours"] = min(
        (s.hit_ratio for s in result.of("ours", "tool") if s.hit_ratio is not None), default=None
    )
    for metric, values in (
        ("new question: mean TTFT, no pause (s)", per("question", ttft)),
        ("new question after the pause: mean TTFT (s)", per("question-paused", ttft)),
        ("tool step: mean TTFT (s)", per("tool", ttft, later=False)),
        (
            "new question, no pause, restore_reasoning = false: mean TTFT (s)",
            per("question-restore-off", ttft),
        ),
        (
            "tool step, restore_reasoning = false: mean TTFT (s)",
            per("tool-restore-off", ttft, later=False),
        ),
    ):
        if not values:
            continue
        ratios = {
            "no-cache / ours": ratio(values.get("nocache"), values.get("ours")),
            "mlx_lm / ours": ratio(values.get("mlx_lm"), values.get("ours")),
        }
        result.rows.append(Row(metric, values, {k: v for k, v in ratios.items() if v}))
    flag = case.get("flag")
    result.notes.append(
        f"{case['template']} keeps earlier reasoning with `{flag}`, which ours turns on by default"
        if flag
        else f"{case['template']} has no flag that keeps earlier reasoning: a new question "
        "hits only if ours warmed its prefix ahead during the pause"
    )
    result.notes.append(AGENT_REPLAY_NOTE)


def registry() -> dict[str, Callable[[Settings, ModelSpec], Produced]]:
    from .autotune.scenario import autotune
    from .concurrency import concurrency
    from .distributed.scenario import distributed
    from .overhead import overhead, tier_stall
    from .restart import restart
    from .shared import shared
    from .speculative import scenario as speculative
    from .vision import vision
    from .wear import scenario as wear

    return {
        "chat": chat,
        "agent": agent,
        "agent-templates": agent_templates,
        "restart": restart,
        "share": share,
        "hybrid": hybrid,
        "overhead": overhead,
        "concurrency": concurrency,
        "shared": shared,
        "wear": wear,
        "vision": vision,
        "speculative": speculative,
        "tier-stall": tier_stall,
        "distributed": distributed,
        "autotune": autotune,
    }


def run_one(name: str, settings: Settings) -> list[ScenarioResult]:
    """Run scenario `name`, or a result that says why it was skipped, before it starts."""
    reason = skip_reason(name)
    if reason is not None:
        return [ScenarioResult(name, settings.model.id, skipped=reason)]
    produced = guarded(name, settings.model, lambda: registry()[name](settings, settings.model))
    return produced if isinstance(produced, list) else [produced]


def guarded(name: str, model: ModelSpec, fn: Callable[[], Produced]) -> Produced:
    """Run a scenario; a failure becomes a result that carries the error, not a crash."""
    start = time.perf_counter()
    try:
        return fn()
    except Exception as e:  # a server that will not start, a helper that fails
        failed = ScenarioResult(name, model.id)
        failed.errors.append(f"{type(e).__name__}: {e}")
        failed.seconds = time.perf_counter() - start
        return failed
