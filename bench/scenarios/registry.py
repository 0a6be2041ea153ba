"""The chat, agent, share and hybrid scenarios, and the registry of all of them.

Every server gets the same requests in the same order, one at a time, streaming and greedy.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .. import traces
from ..harness import Harness, Settings, chars_per_token, probe, stats
from ..prerequisites import skip_reason
from ..results import Row, ScenarioResult, mean, ratio, total
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


def registry() -> dict[str, Callable[[Settings, ModelSpec], Produced]]:
    from .concurrency import concurrency
    from .overhead import overhead
    from .restart import restart
    from .shared import shared
    from .speculative import scenario as speculative
    from .vision import vision
    from .wear import scenario as wear

    return {
        "chat": chat,
        "agent": agent,
        "restart": restart,
        "share": share,
        "hybrid": hybrid,
        "overhead": overhead,
        "concurrency": concurrency,
        "shared": shared,
        "wear": wear,
        "vision": vision,
        "speculative": speculative,
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
