"""The distributed scenario: the agent trace on demo-qwen36 split across two ranks.

For each split (by heads, "tensor"; by layers, "pipeline") four servers get the same
requests in one run, one after the other: ours on 2 ranks (`serve --ranks 2 --split MODE`),
ours on 1 rank (plain `serve`), and mlx_lm.server's own distributed mode on 2 ranks
(`mlx.launch ... mlx_lm.server [--pipeline]`), as its users start it and again under the
launcher ours runs (worlds.py: mlx.launch's relay spins a core; ours does not), so the
launcher's share of the difference and the cache's are told apart. The requests are the
agent scenario's trace:
a coding-agent session of tool rounds with a new user request every fifth call, then a
second session in the same project (Claude Code's billing header changes). The model is
demo-qwen36: Qwen3.6-35B-A3B's layers, experts and real chat template, which drops every
earlier round's thinking once a new question comes. It reports the TTFT of the warm turns
(every call but the first), overall and by kind of turn, the decode rate (the split's work:
each token crosses the ranks' links), the share of each prompt from the cache, and what
each rank's cache holds against the whole model's cache for the same turns (each rank
holds its slice of every block: about half on two ranks). Then both split worlds are
restarted whole (every rank stopped cleanly, started again: ours on the same cache dir)
and get the second session's next tool round: ours should load its prefix back from every
rank's SSD, where mlx_lm.server, whose cache lives in RAM only, starts cold.

Ranks on one machine share its cores, so on a small CPU the split is slower than the whole
model; the ratios, measured side by side, are what to read, never the bare seconds.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ... import traces
from ...harness import Harness, Settings, resolve_model, stats
from ...results import Row, Sample, ScenarioResult, mean, ratio, total
from ...servers import ModelSpec
from .worlds import World, WorldServer, restart, serving, with_real_template, worlds

# The user's model's shape (Gated DeltaNet and attention layers, experts, the 248k
# vocabulary) with Qwen3.6's real template; mlx-lm splits it by heads and by layers alike.
MODEL = "demo-qwen36"
REAL_TEMPLATE = "qwen3_6.jinja"
MODES = ("tensor", "pipeline")
RANKS = 2
# World.key of worlds(): 2 ranks, 1 rank, mlx_lm under mlx.launch, and under our launcher
KEYS = ("ours", "ours_1rank", "mlx_lm", "mlx_lm_quiet")
# /v1/cache/stats gathers each rank's RAM figures when asked; each rank reads its SSD's
# counts every second on a thread of its own (engine_bridge/distributed/figures.py), and
# warming ahead may still store after the last turn: read the figures after a pause.
FIGURES_SETTLE_S = 3.0
SETTLE_POLL_S = 2.0
SETTLE_POLLS = 8

HEADLINE = f"mean TTFT of warm agent turns (2..N), {RANKS} ranks (s)"
RESTARTED = "after-restart"  # the label of the next turn's sample, after the restart
RESTART_TTFT = "TTFT of the next turn after a restart of every rank (s)"
# Calls the trace goes on past the turns, to find the last session's next tool round in:
# every fifth call of a session is a new user request, the others tool rounds.
LOOKAHEAD = 5
# The kinds of warm turn, by what the call adds to what the server saw before.
TOOL_ROUND, NEW_QUESTION, NEW_SESSION = "tool round", "new question", "new session"
TARGETS = (
    "target mlx_lm / ours ≥ 2 (ours ≤ 0.5× mlx_lm.server's distributed mode); "
    "each rank ≈ 1/2 of the whole model's cache"
)


@dataclass(frozen=True, slots=True)
class Sizes:
    """The agent trace: sessions of `calls` requests each (then the last session's next
    turn, sent after the restart), and the tokens each generates."""

    calls: tuple[int, ...]
    system_chars: int
    result_chars: int
    tool_detail_chars: int
    compact_tools: bool
    max_tokens: int  # enough streamed tokens after the first to time the decode

    @classmethod
    def of(cls, settings: Settings) -> Sizes:
        if settings.quick:  # schemas without descriptions: prefills that fit a 2-core CPU
            # Session 1: four tool rounds and a new question; session 2: three calls.
            return cls((5, 3), 2000, 800, 0, True, max(settings.max_tokens, 24))
        return cls((12, 8), 9000, 3000, 300, False, max(settings.max_tokens, 64))

    @property
    def turns(self) -> int:
        return sum(self.calls)


def distributed(settings: Settings, model: ModelSpec) -> list[ScenarioResult]:
    """Ours split, ours whole and mlx_lm.server split, on each split mode of demo-hybrid."""
    spec = split_model(settings)
    sizes = Sizes.of(settings)
    # The last session goes on past the turns, for the next turn after the restart (a
    # session's first calls do not depend on how many follow): run_split sends the turns.
    *first, last = sizes.calls
    trace = traces.agent_trace(
        settings.seed,
        calls_per_session=(*first, last + LOOKAHEAD),
        system_chars=sizes.system_chars,
        tool_detail_chars=sizes.tool_detail_chars,
        result_chars=sizes.result_chars,
        compact_tools=sizes.compact_tools,
    )
    return [
        _guarded(_name(spec, mode), lambda mode=mode: run_split(settings, spec, mode, trace, sizes))
        for mode in MODES
    ]


def split_model(settings: Settings) -> ModelSpec:
    """demo-qwen36 as the run has it, or built beside the run's other demo models; on
    Qwen3.6's real chat template where ../shared/templates has it, as a user's download
    ships it (the demo's template drops past reasoning on every new question)."""
    model = next((m for m in (settings.model, *settings.hybrid_models) if m.id == MODEL), None)
    if model is None:
        root = settings.model.path.parent if settings.model.is_demo else settings.out / "models"
        model = resolve_model(MODEL, root)
    from engine_bridge.models.demo.real_templates import templates_dir

    template = templates_dir() / REAL_TEMPLATE
    if not template.is_file():
        return model
    return with_real_template(model, settings.out / "work" / "distributed", template)


def _name(model: ModelSpec, mode: str) -> str:
    return f"{model.id} ({mode} split)"


def _guarded(name: str, fn: Callable[[], ScenarioResult]) -> ScenarioResult:
    """One split's result; a failure becomes a result that carries the error, so the other
    split still runs (registry.guarded, which this package cannot import: a circle)."""
    start = time.perf_counter()
    try:
        return fn()
    except Exception as e:  # a world that will not start
        failed = ScenarioResult("distributed", name)
        failed.errors.append(f"{type(e).__name__}: {e}")
        failed.seconds = time.perf_counter() - start
        return failed


def run_split(
    settings: Settings, model: ModelSpec, mode: str, trace: traces.AgentTrace, sizes: Sizes
) -> ScenarioResult:
    result = ScenarioResult("distributed", _name(model, mode))
    held: dict[str, dict[str, list[Any]]] = {}
    turns = trace.calls[: sizes.turns]
    following, next_turn = next_tool_round(turns[-1], trace.calls[sizes.turns :])
    with Harness(settings, result, model) as h:
        for world in worlds(mode, RANKS):
            h.progress(f"{mode}: starting", world.label)
            with serving(h, world, model) as server:
                for i, call in enumerate(turns):
                    sample = send(h, server, world, call, i, sizes.max_tokens)
                    step = f"{mode} call {i + 1}/{len(turns)} ({turn_kind(call)})"
                    h.progress(step, world.key, sample)
                if world.kind == "ours":
                    held[world.key] = holdings(server, world)
                    h.progress(f"{mode}: cache RAM bytes by rank {held[world.key]}", world.key)
                if world.ranks > 1 and not world.quiet:  # its restart is as cold as mlx_lm's
                    after_restart(h, server, world, following, len(turns), sizes.max_tokens)
    result.metrics |= {"calls": len(turns), "max_tokens": sizes.max_tokens}
    summarize(result, held, next_turn, [turn_kind(c) for c in turns])
    result.notes.append(
        "ours gets the Anthropic request, mlx_lm.server the same call converted to OpenAI "
        "(traces.to_openai); the servers ran one at a time, in the order ours on 2 ranks, "
        "ours on 1 rank, mlx_lm.server on 2 ranks under mlx.launch, then under our "
        "launcher; each 2-rank world but the last was restarted after its turns and sent "
        "the next turn"
    )
    return result.finish()


def send(
    h: Harness, server: WorldServer, world: World, call: traces.AgentCall, step: int,
    max_tokens: int, label: str = "turn",
) -> Sample:  # fmt: skip
    body = call.anthropic(server.model_name, max_tokens)
    if world.kind == "mlx_lm":
        sample = h.send(server, "openai", traces.to_openai(body), step, label, call.session)
    else:
        sample = h.send(server, "anthropic", body, step, label, call.session)
    sample.server = world.key  # ours on 2 ranks and on 1 are both kind "ours"
    return sample


def turn_kind(call: traces.AgentCall) -> str:
    """What a call adds to the session's previous one: a tool round (results of the tools
    the model called), a new question (the template then drops earlier thinking), or the
    first call of a later session (a new billing header, the same system prompt and tools)."""
    if call.index == 0:
        return NEW_SESSION
    *_, last = call.body["messages"]
    if any(b.get("type") == "tool_result" for b in last["content"]):
        return TOOL_ROUND
    return NEW_QUESTION


def after_restart(
    h: Harness, server: WorldServer, world: World, call: traces.AgentCall, step: int,
    max_tokens: int,
) -> None:  # fmt: skip
    """Restart the whole world, then send the session's next call; for ours, read what
    each rank holds in RAM once that call is served (each loaded its slices back). A world
    that does not come back is an error of this result, which keeps the turns' rows."""
    h.progress(f"{world.mode}: restarting every rank (SIGTERM, start again)", world.key)
    try:
        server = restart(h, server)
    except Exception as e:  # not ready again: its log's tail is in the message
        h.result.errors.append(f"{world.label} restart: {type(e).__name__}: {e}")
        return
    sample = send(h, server, world, call, step, max_tokens, RESTARTED)
    h.progress(f"{world.mode} next turn after the restart", world.key, sample)
    if world.kind == "ours":
        by_rank = per_rank(stats(server)).get("ram_bytes") or []
        h.progress(f"{world.mode}: cache RAM bytes by rank after it {by_rank}", world.key)
        h.result.metrics |= {f"after_restart_ram_bytes_rank{i}": b for i, b in enumerate(by_rank)}


def next_tool_round(
    last: traces.AgentCall, later: Iterable[traces.AgentCall]
) -> tuple[traces.AgentCall, str]:
    """The turn after the restart: `last`'s request plus the session's next tool round,
    and what it is, in words. The session's very next call when that is a tool round;
    a new user request is skipped, since a Qwen-style template then drops every earlier
    round's thinking from the prompt, and with it most of the cached prefix."""
    for n, call in enumerate(later):
        *_, uses, results = call.body["messages"]
        if not any(b["type"] == "tool_use" for b in uses["content"]):
            continue
        if n == 0:
            return call, "the session's next call: its last request plus one more tool round"
        messages = copy.deepcopy(last.body["messages"])
        for block in messages[-1]["content"]:
            block.pop("cache_control", None)  # it marks the newest message only
        body = last.body | {"messages": [*messages, uses, results]}
        return traces.AgentCall(last.session, last.index + 1, body), (
            "the session's last request plus one more tool round, the one its call "
            f"{call.index + 1} adds (its next call is a new user request, on which the "
            "template drops every earlier round's thinking)"
        )
    raise ValueError("no tool round after the session's last turn")


def holdings(server: WorldServer, world: World) -> dict[str, list[Any]]:
    """What the cache holds after the turns, by rank, once every rank's figures are in.

    Both of ours wait as long, so a warm-ahead prefill after the last turn counts in both.
    """
    time.sleep(FIGURES_SETTLE_S)
    current: dict[str, Any] = {}
    for _ in range(SETTLE_POLLS):
        current = stats(server)
        if world.ranks == 1 or _gathered(current, world.ranks):
            break
        time.sleep(SETTLE_POLL_S)
    return per_rank(current)


def _gathered(s: dict[str, Any], ranks: int) -> bool:
    """Whether the gathered figures are in for every rank and rank 0's match its live RAM."""
    by_rank = s.get("ranks") or []
    live = (s.get("ram") or {}).get("bytes")
    return len(by_rank) == ranks and by_rank[0].get("ram_bytes") == live


def per_rank(s: dict[str, Any]) -> dict[str, list[Any]]:
    """RAM and SSD bytes of the cache, by rank: `ranks` of a split server's
    /v1/cache/stats, or a single process's own `ram` and `ssd` sections."""
    by_rank = s.get("ranks")
    if by_rank:
        keys = ("layout", "ram_bytes", "ssd_bytes", "kv_bytes")
        return {k: [r.get(k) for r in by_rank] for k in keys}
    return {
        "layout": ["whole"],
        "ram_bytes": [(s.get("ram") or {}).get("bytes")],
        "ssd_bytes": [(s.get("ssd") or {}).get("bytes")],
    }


def decode_rate(samples: Iterable[Sample]) -> float | None:
    """Tokens streamed after the first over the seconds after the first token, summed over
    the requests that streamed two or more."""
    timed = [
        (s.completion_tokens - 1, s.total_s - s.ttft_s)
        for s in samples
        if s.ok and s.ttft_s is not None and (s.completion_tokens or 0) > 1 and s.total_s > s.ttft_s
    ]
    return ratio(total(n for n, _ in timed), total(t for _, t in timed))


def hit_ratio(samples: Iterable[Sample]) -> float | None:
    """Cached over prompt tokens, over the requests whose server said what it cached."""
    told = [s for s in samples if s.prompt_tokens and s.cached_tokens is not None]
    return ratio(total(s.cached_tokens for s in told), total(s.prompt_tokens for s in told))


def summarize(
    result: ScenarioResult,
    held: dict[str, dict[str, list[Any]]],
    next_turn: str = "",
    kinds: Sequence[str] = (),
) -> None:
    """The rows; `kinds`: each turn's kind (turn_kind), by its step, for the rows by kind."""
    warm = {k: result.of(k)[1:] for k in KEYS}
    ttft = {k: mean(s.ttft_s for s in v) for k, v in warm.items()}
    decode = {k: decode_rate(result.of(k)) for k in KEYS}
    hits = {k: hit_ratio(v) for k, v in warm.items()}
    two, one = f"{RANKS} ranks", "ours on 1 rank"
    vs_one = f"ours {RANKS} ranks / 1 rank"
    result.rows += [
        Row(HEADLINE, {"ours": ttft["ours"], "mlx_lm": ttft["mlx_lm"]},
            {"mlx_lm / ours": ratio(ttft["mlx_lm"], ttft["ours"])},
            note="every call but the first of the agent trace (tool rounds, new questions, "
            f"a second session); {TARGETS}"),
        Row(f"mean TTFT of warm agent turns (2..N), {two}, mlx_lm.server under our launcher (s)",
            {"ours": ttft["ours"], "mlx_lm": ttft["mlx_lm_quiet"]},
            {"mlx_lm / ours": ratio(ttft["mlx_lm_quiet"], ttft["ours"])},
            note="the same turns; mlx_lm.server's ranks started by quiet_launch.py, as ours "
            "are, instead of mlx.launch, whose relay spins a core: what is left is the cache's "
            "and the engine's share"),
        Row(f"mean TTFT of warm agent turns (2..N), {one} (s)", {"ours": ttft["ours_1rank"]},
            {vs_one: ratio(ttft["ours"], ttft["ours_1rank"])},
            note="the same server, the model whole in one process"),
        Row(f"decode tok/s, {two}", {"ours": decode["ours"], "mlx_lm": decode["mlx_lm"]},
            {"ours / mlx_lm": ratio(decode["ours"], decode["mlx_lm"])},
            note="tokens streamed after the first / seconds after the first token, over "
            "every turn"),
        Row(f"decode tok/s, {two}, mlx_lm.server under our launcher",
            {"ours": decode["ours"], "mlx_lm": decode["mlx_lm_quiet"]},
            {"ours / mlx_lm": ratio(decode["ours"], decode["mlx_lm_quiet"])}),
        Row(f"decode tok/s, {one}", {"ours": decode["ours_1rank"]},
            {vs_one: ratio(decode["ours"], decode["ours_1rank"])}),
        Row(f"token hit ratio of warm turns (cached / prompt tokens), {two}",
            {"ours": hits["ours"], "mlx_lm": hits["mlx_lm"]}),
        Row(f"token hit ratio of warm turns, {one}", {"ours": hits["ours_1rank"]}),
    ]  # fmt: skip
    _kind_rows(result, warm, kinds)
    _restart_rows(result, next_turn)
    _holding_rows(result, held)
    result.metrics |= {
        "warm_ttft_mlx_lm_over_ours": ratio(ttft["mlx_lm"], ttft["ours"]),
        "warm_ttft_mlx_lm_quiet_over_ours": ratio(ttft["mlx_lm_quiet"], ttft["ours"]),
        "decode_ours_over_mlx_lm_quiet": ratio(decode["ours"], decode["mlx_lm_quiet"]),
        "warm_ttft_ours_2ranks_over_1rank": ratio(ttft["ours"], ttft["ours_1rank"]),
        "decode_ours_over_mlx_lm": ratio(decode["ours"], decode["mlx_lm"]),
        "decode_ours_2ranks_over_1rank": ratio(decode["ours"], decode["ours_1rank"]),
    }
    result.metrics |= {f"completion_tokens_{k}": total(s.completion_tokens for s in result.of(k))
                       for k in KEYS}  # fmt: skip
    pairs = zip(result.of("ours"), result.of("ours_1rank"), strict=False)
    same = [a.output == b.output for a, b in pairs if a.ok and b.ok]
    # Greedy, the split answers as the whole model does (mlx_lm's prompts differ a little).
    result.metrics["greedy_outputs_equal_2ranks_vs_1rank"] = sum(same) / len(same) if same else None
    if all(s.cached_tokens is None for s in result.of("mlx_lm")):
        result.notes.append("mlx_lm.server reported no cached tokens: its hit ratio is null")


def _kind_rows(result: ScenarioResult, warm: dict[str, list[Sample]], kinds: Sequence[str]) -> None:
    """The warm turns' TTFT and hit ratio by kind of turn, on 2 ranks: where each server's
    cache keeps up (a tool round appends to the last prompt on both) and where it does not."""
    for kind in (TOOL_ROUND, NEW_QUESTION, NEW_SESSION):
        of = {k: [s for s in warm[k] if s.step < len(kinds) and kinds[s.step] == kind]
              for k in ("ours", "mlx_lm", "mlx_lm_quiet")}  # fmt: skip
        if not of["ours"]:
            continue
        quiet = mean(s.ttft_s for s in of.pop("mlx_lm_quiet"))
        ttft = {k: mean(s.ttft_s for s in v) for k, v in of.items()}
        hits = {k: hit_ratio(v) for k, v in of.items()}
        result.rows.append(
            Row(f"mean TTFT of warm turns: {kind} ({len(of['ours'])}), {RANKS} ranks (s)", ttft,
                {"mlx_lm / ours": ratio(ttft["mlx_lm"], ttft["ours"]),
                 "mlx_lm under our launcher / ours": ratio(quiet, ttft["ours"])},
                note="hit ratio (cached / prompt tokens): "
                + ", ".join(f"{k} {_fmt(v)}" for k, v in hits.items()))
        )  # fmt: skip
        key = kind.replace(" ", "_")
        result.metrics[f"warm_ttft_{key}_mlx_lm_over_ours"] = ratio(ttft["mlx_lm"], ttft["ours"])


def _fmt(value: float | None) -> str:
    return "null" if value is None else f"{value:.3f}"


def _restart_rows(result: ScenarioResult, next_turn: str) -> None:
    after = {k: (result.of(k, RESTARTED) or [None])[0] for k in ("ours", "mlx_lm")}
    ttft = {k: s.ttft_s if s else None for k, s in after.items()}
    cached = {k: s.cached_tokens if s else None for k, s in after.items()}
    share = {k: ratio(s.cached_tokens, s.prompt_tokens) if s else None for k, s in after.items()}
    ours, last = after["ours"], (result.of("ours") or [None])[-1]
    told = (
        f"ours: {ours.cached_tokens} of {ours.prompt_tokens} prompt tokens from its cache "
        f"(x-prompt-cache-source: {ours.source}); the last turn before the restart had "
        f"{last.prompt_tokens if last else None} prompt tokens"
        if ours
        else "ours: no sample"
    )
    result.rows += [
        Row(RESTART_TTFT, ttft, {"mlx_lm / ours": ratio(ttft["mlx_lm"], ttft["ours"])},
            note=f"{next_turn or 'the next call'}, after every rank of each "
            f"{RANKS}-rank world was stopped (SIGTERM; ours drains each rank's SSD writes) "
            "and started again (ours on the same cache dir, mlx_lm.server with the same "
            "arguments; both on fresh ports); a warm-up request pays the model load, not "
            "these numbers"),
        Row(f"cached / prompt tokens of the next turn after a restart, {RANKS} ranks", share,
            note=told + "; mlx_lm.server keeps its cache in RAM only: expected cold"),
    ]  # fmt: skip
    result.metrics |= {
        "after_restart_ttft_mlx_lm_over_ours": ratio(ttft["mlx_lm"], ttft["ours"]),
        "after_restart_cached_tokens_ours": cached["ours"],
        "after_restart_cached_tokens_mlx_lm": cached["mlx_lm"],
        "after_restart_source_ours": ours.source if ours else None,
    }


def _holding_rows(result: ScenarioResult, held: dict[str, dict[str, list[Any]]]) -> None:
    split, whole = held.get("ours") or {}, held.get("ours_1rank") or {}
    whole_ram = (whole.get("ram_bytes") or [None])[0]
    for i, (layout, ram) in enumerate(
        zip(split.get("layout") or [], split.get("ram_bytes") or [], strict=False)
    ):
        result.rows.append(
            Row(
                f"cache RAM bytes held by rank {i} ({layout})",
                {"ours": ram},
                {f"rank {i} / 1 rank": ratio(ram, whole_ram)},
                note=""
                if i
                else "after the same turns as the 1-rank server, read "
                f"{FIGURES_SETTLE_S:g} s after the last (/v1/cache/stats ranks); target ≈ 1/2",
            )
        )
        result.metrics[f"rank{i}_ram_over_1rank"] = ratio(ram, whole_ram)
    result.rows.append(Row("cache RAM bytes, ours on 1 rank", {"ours": whole_ram}))
    for key, figures in (("2ranks", split), ("1rank", whole)):
        for i, ssd in enumerate(figures.get("ssd_bytes") or []):
            result.metrics[f"ssd_bytes_{key}_rank{i}"] = ssd
    if not split.get("ram_bytes"):
        result.notes.append("/v1/cache/stats of ours on 2 ranks had no `ranks` figures")
