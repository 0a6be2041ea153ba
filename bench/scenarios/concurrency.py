"""The concurrency scenario: several clients at once against one server.

Three parts, run against each server in turn with the same requests:

- head of line: a long cold prompt, then three short requests a moment into its prefill.
  A server that runs one request at a time makes them wait for the whole prefill.
- streams: eight distinct short prompts sent together, each generating dozens of tokens;
  aggregate output tokens per second from the first send to the last finish.
- sessions: four coding-agent sessions at once (one shared system prompt and tools, a
  billing header of their own), each sequential within itself.

Requests go out from threads, one connection each, through the same streaming client as
every other scenario, so TTFT and usage are measured the same way.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .. import corpus, traces
from ..harness import Harness, Settings, chars_per_token
from ..results import Row, Sample, ScenarioResult, mean, ratio, total
from ..servers import KINDS, Kind, ModelSpec, Server

SHORTS = 3
STREAMS = 8
SESSIONS = 4

# The headline numbers, one per part: plots.py finds the rows by these names.
HOL_ROW = f"mean TTFT of {SHORTS} short requests sent during a long cold prefill (s)"
STREAMS_ROW = f"aggregate output tok/s, {STREAMS} concurrent streams"
SESSIONS_ROW = f"wall time of {SESSIONS} concurrent agent sessions (s)"


@dataclass(frozen=True, slots=True)
class Sizes:
    """How big each part is; the scenario's shape (3 shorts, 8 streams, 4 sessions) is fixed."""

    long_tokens: int  # the head-of-line prompt
    short_tokens: int  # each short prompt, head of line and streams
    short_output: int  # max_tokens of the head-of-line short requests
    delay_s: float  # how long after the long prompt the short ones are sent
    stream_output: tuple[int, int]  # max_tokens of the first and the last stream
    calls_per_session: int
    system_chars: int
    result_chars: int
    tool_detail_chars: int = 0
    compact_tools: bool = True

    @classmethod
    def of(cls, settings: Settings) -> Sizes:
        if settings.quick:
            return cls(6000, 100, 24, 1.0, (32, 96), 3, 2000, 800)
        return cls(20_000, 100, 32, 1.0, (64, 200), 6, 9000, 3000, 300, False)


# Small enough for a test on a 2-core CPU; every part still runs.
TINY = Sizes(400, 30, 4, 0.2, (4, 8), 2, 300, 200)


@dataclass(slots=True)
class Timed:
    """A sample and when its request was sent, in seconds since its part began."""

    sent_s: float
    sample: Sample

    @property
    def done_s(self) -> float:
        return self.sent_s + self.sample.total_s


def concurrency(settings: Settings, model: ModelSpec, sizes: Sizes | None = None) -> ScenarioResult:
    """Head of line, 8 streams and 4 agent sessions, each at once, on every server."""
    sizes = sizes or Sizes.of(settings)
    result = ScenarioResult("concurrency", model.id)
    cpt = chars_per_token(model)
    rng = random.Random(f"concurrency/{settings.seed}")
    # A first line of its own: the long prompt shares no block with the warm-up or the rest.
    system, user = traces.chat_trace(settings.seed + 200, 1, sizes.long_tokens, cpt).session(0)
    long_prompt = [{**system, "content": "Head of line.\n" + system["content"]}, user]
    shorts = [_short(rng, f"Question {k + 1}", sizes.short_tokens, cpt) for k in range(SHORTS)]
    streams = [_short(rng, f"Stream {k + 1}", sizes.short_tokens, cpt) for k in range(STREAMS)]
    lo, hi = sizes.stream_output
    stream_output = [lo + (hi - lo) * k // (STREAMS - 1) for k in range(STREAMS)]
    trace = traces.agent_trace(
        settings.seed,
        calls_per_session=(sizes.calls_per_session,) * SESSIONS,
        system_chars=sizes.system_chars,
        tool_detail_chars=sizes.tool_detail_chars,
        result_chars=sizes.result_chars,
        compact_tools=sizes.compact_tools,
    )
    walls: dict[str, dict[Kind, float]] = {"streams": {}, "sessions": {}}
    with Harness(settings, result, model) as h:
        for kind in KINDS:
            with h.serve(kind) as server:
                _head_of_line(h, server, long_prompt, shorts, sizes)
                walls["streams"][kind] = _streams(h, server, streams, stream_output)
                walls["sessions"][kind] = _sessions(h, server, trace, settings.max_tokens)
    _summarize(result, sizes, walls)
    return result.finish()


def _short(rng: random.Random, tag: str, tokens: int, cpt: float) -> list[dict[str, Any]]:
    text = corpus.prose(rng, int(tokens * cpt))[: int(tokens * cpt)]
    return [{"role": "user", "content": f"{tag}: {text}\nAnswer in one paragraph."}]


def _send(h: Harness, server: Server, t0: float, dialect, body, step, label, session=0) -> Timed:
    sent = time.perf_counter() - t0
    return Timed(sent, h.send(server, dialect, body, step, label, session))


def _at_once(jobs: list[Callable[[], Any]]) -> list[Any]:
    """Run every job in a thread of its own, all started together; results in job order."""
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(job) for job in jobs]
        return [f.result() for f in futures]


def _head_of_line(h: Harness, server: Server, long_prompt, shorts, sizes: Sizes) -> None:
    t0 = time.perf_counter()
    body = {"messages": long_prompt, "max_tokens": h.settings.max_tokens}
    with ThreadPoolExecutor(1 + len(shorts)) as pool:
        long = pool.submit(_send, h, server, t0, "openai", body, 0, "hol-long")
        time.sleep(sizes.delay_s)
        jobs = [
            pool.submit(
                _send, h, server, t0, "openai",
                {"messages": m, "max_tokens": sizes.short_output}, k, "hol-short",
            )
            for k, m in enumerate(shorts)
        ]  # fmt: skip
        for k, job in enumerate(jobs):
            h.progress(f"head of line: short {k + 1}/{len(jobs)}", server, job.result().sample)
        h.progress("head of line: long prompt", server, long.result().sample)


def _streams(h: Harness, server: Server, prompts, outputs: list[int]) -> float:
    t0 = time.perf_counter()
    done = _at_once(
        [
            lambda k=k, m=m, n=n: _send(
                h, server, t0, "openai", {"messages": m, "max_tokens": n}, k, "stream"
            )
            for k, (m, n) in enumerate(zip(prompts, outputs, strict=True))
        ]
    )
    for k, t in enumerate(done):
        h.progress(f"stream {k + 1}/{len(done)}", server, t.sample)
    wall = max(t.done_s for t in done) - min(t.sent_s for t in done)
    tokens = total(t.sample.completion_tokens for t in done) or 0
    h.progress(f"streams: {tokens:.0f} tokens in {wall:.2f}s", server)
    return wall


def _sessions(h: Harness, server: Server, trace: traces.AgentTrace, max_tokens: int) -> float:
    t0 = time.perf_counter()
    lock = threading.Lock()
    per_session = [
        [(i, c) for i, c in enumerate(trace.calls) if c.session == s] for s in range(SESSIONS)
    ]

    def run(calls: list[tuple[int, traces.AgentCall]]) -> list[Timed]:
        out = []
        for step, call in calls:
            body = call.anthropic(server.model_name, max_tokens)
            if server.kind == "mlx_lm":
                t = _send(h, server, t0, "openai", traces.to_openai(body), step, "session",
                          call.session)  # fmt: skip
            else:
                t = _send(h, server, t0, "anthropic", body, step, "session", call.session)
            with lock:  # progress lines whole, not interleaved
                h.progress(
                    f"session {call.session + 1} request {call.index + 1}/{len(calls)}",
                    server,
                    t.sample,
                )
            out.append(t)
        return out

    done = [t for ts in _at_once([lambda c=c: run(c) for c in per_session]) for t in ts]
    wall = max(t.done_s for t in done) - min(t.sent_s for t in done)
    h.progress(f"sessions: {len(done)} requests in {wall:.2f}s", server)
    return wall


def _summarize(result: ScenarioResult, sizes: Sizes, walls: dict[str, dict[Kind, float]]) -> None:
    def vs(values: dict[Kind, float | None]) -> dict[str, float | None]:
        return {
            "ours / mlx_lm": ratio(values.get("ours"), values.get("mlx_lm")),
            "ours / no-cache": ratio(values.get("ours"), values.get("nocache")),
        }

    hol = {k: mean(s.ttft_s for s in result.of(k, "hol-short")) for k in KINDS}
    long_ttft = {k: mean(s.ttft_s for s in result.of(k, "hol-long")) for k in KINDS}
    long_tokens = next((s.prompt_tokens for s in result.of("ours", "hol-long")), None)
    result.rows.append(
        Row(
            HOL_ROW,
            hol,
            vs(hol),
            note=f"long prompt: {long_tokens} tokens; shorts: ~{sizes.short_tokens} prompt "
            f"tokens, max_tokens={sizes.short_output}, sent together {sizes.delay_s:g} s after "
            "it; TTFT from each short request's own send; target ours / mlx_lm ≤ 0.5",
        )
    )
    result.rows.append(Row("TTFT of the long prompt itself (s)", long_ttft, vs(long_ttft)))
    tokens = {k: total(s.completion_tokens for s in result.of(k, "stream")) for k in KINDS}
    tok_s = {k: ratio(tokens[k], walls["streams"].get(k)) for k in KINDS}
    lo, hi = sizes.stream_output
    result.rows.append(
        Row(
            STREAMS_ROW,
            tok_s,
            vs(tok_s),
            note=f"completion tokens from each server's usage / seconds from the first send to "
            f"the last finish; max_tokens {lo}..{hi}; target ours / mlx_lm ≥ 1.0",
        )
    )
    streams_ttft = {k: mean(s.ttft_s for s in result.of(k, "stream")) for k in KINDS}
    result.rows.append(
        Row(f"mean TTFT, {STREAMS} concurrent streams (s)", streams_ttft, vs(streams_ttft))
    )
    sessions = {k: walls["sessions"].get(k) for k in KINDS}
    result.rows.append(
        Row(
            SESSIONS_ROW,
            sessions,
            vs(sessions),
            note=f"{sizes.calls_per_session} requests per session, sequential within it, "
            "the sessions at once; ours and --no-cache get the Anthropic request, "
            "mlx_lm.server the same call as OpenAI",
        )
    )
    session_ttft = {k: mean(s.ttft_s for s in result.of(k, "session")) for k in KINDS}
    result.rows.append(
        Row("mean TTFT of the agent sessions' requests (s)", session_ttft, vs(session_ttft))
    )
    result.metrics |= {
        "hol_short_ttft_ours_over_mlx_lm": ratio(hol["ours"], hol["mlx_lm"]),
        "streams8_tok_s_ours_over_mlx_lm": ratio(tok_s["ours"], tok_s["mlx_lm"]),
        "sessions4_wall_ours_over_mlx_lm": ratio(sessions["ours"], sessions["mlx_lm"]),
        "sessions4_wall_ours_over_nocache": ratio(sessions["ours"], sessions["nocache"]),
    }
    result.metrics |= {f"streams8_completion_tokens_{k}": tokens[k] for k in KINDS}
    if len({tokens[k] for k in KINDS}) > 1:
        result.notes.append(
            "the servers generated different numbers of stream tokens ("
            + ", ".join(f"{k} {tokens[k]}" for k in KINDS)
            + "): tok/s compares their rates, not the same work"
        )
