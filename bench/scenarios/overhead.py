"""The overhead and tier-stall scenarios: what the cache costs the request that uses it,
and what a slow tier's lookup costs the requests decoding meanwhile.

overhead: each prompt is sent once to our proxy with the cache on (a miss: every prompt
starts with its own line, so no block is shared), to the --no-cache server, and to bare
mlx-lm in a process of its own with the same model and the same rendered tokens.

tier-stall (issue 33): four streams decode on demo-hybrid while a fifth request, whose
system prompt is on the SSD, looks up: (c) with every tier answering, (a) with the Redis
port gone black (the relay in front of redis-server holds every reply back: it accepts and
never answers), (b) with the SSD's entry-file reads hanging. Decode tok/s of the four over
the longest tier deadline from the fifth's send, per case, as ratios against (c), each
repeat against its own (c). The engine runs in-process in a process of its own
(`python -m bench.scenarios.overhead`), as the bench never imports mlx.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .. import corpus, traces
from ..harness import Harness, Settings, chars_per_token, probe
from ..prerequisites import REDIS, REDIS_SERVER
from ..results import Row, Sample, ScenarioResult, median, ratio
from ..servers import REPO, ModelSpec


def overhead(settings: Settings, model: ModelSpec) -> ScenarioResult:
    result = ScenarioResult("overhead", model.id)
    n = settings.size(5, 8)
    tokens = settings.size(1000, 4000)
    trace = traces.chat_trace(settings.seed + 3, n, tokens, chars_per_token(model))
    prompts = []
    for k in range(n):
        messages = trace.session(k)
        messages[0] = {**messages[0], "content": f"Overhead probe {k}.\n" + messages[0]["content"]}
        prompts.append(messages)
    with Harness(settings, result, model) as h:
        for kind in ("ours", "nocache"):
            with h.serve(kind) as server:
                for k, messages in enumerate(prompts):
                    sample = h.send(server, "openai", {"messages": messages}, k)
                    h.progress(f"prompt {k + 1}/{n}", server, sample)
    # The servers are down before bare mlx-lm runs: nothing else competes for the CPU.
    h.progress("bare mlx-lm and lookup timing", "in-process")
    prompt_file = h.work / "overhead-prompts.json"
    prompt_file.parent.mkdir(parents=True, exist_ok=True)
    prompt_file.write_text(json.dumps(prompts))
    repeats = 3
    lookup_tokens = 32_768
    measured = probe(
        "overhead", str(model.path), str(prompt_file), "--repeats", str(repeats),
        "--lookup-tokens", str(lookup_tokens),
    )  # fmt: skip
    bare = measured["bare"]
    for k, b in enumerate(bare):
        result.samples += _bare_samples(k, b)
    ours = median(s.ttft_s for s in result.of("ours"))
    plain = median(s.ttft_s for s in result.of("nocache"))
    bare_ttft = median(b["median_s"] for b in bare)
    result.rows.append(
        Row(
            "median miss-path TTFT (s)",
            {"ours": ours, "nocache": plain, "bare": bare_ttft},
            {
                "ours / bare mlx-lm": ratio(ours, bare_ttft),
                "no-cache / bare": ratio(plain, bare_ttft),
            },
            note="bare = mlx_lm.stream_generate in-process, same model and tokens, median of "
            f"{repeats} runs per prompt after one warm-up; it prefills in 2048-token steps, "
            "the proxy in 512-token steps",
        )
    )
    lookup = measured["lookup"]
    result.metrics |= {f"lookup_{k}": v for k, v in lookup.items()}
    per = f"{lookup_tokens // 1024}k tokens (ms)"
    for metric, key in (
        (f"hash the chain, {per}", "hash_chain_s"),
        (f"cold miss: hash + lookup over RAM and SSD, {per}", "lookup_miss_s"),
        (f"full RAM hit: hash + lookup + pin, {per}", "lookup_hit_s"),
        (f"full SSD hit: hash + lookup (index only), {per}", "lookup_ssd_s"),
        (f"full SSD hit: hash + lookup + promote (file reads), {per}", "promote_ssd_s"),
    ):
        result.rows.append(
            Row(metric, {"ours": lookup[key] * 1e3}, note="engine_bridge.probes.lookup")
        )
    _render_rows(measured["render"], result)
    _cold_series(settings, model, result)
    tokens_ours = [s.prompt_tokens for s in result.of("ours")]
    result.metrics["prompt_tokens_equal_ours_vs_bare"] = float(
        tokens_ours == [b["prompt_tokens"] for b in bare]
    )
    return result.finish()


def _render_rows(render: dict, result: ScenarioResult) -> None:
    """Chat template to token ids and message starts, on a 201-message agent session."""
    n = int(render["messages"])
    one = render["template_s"]
    tokenized = render["template_tokenized_s"]
    result.metrics |= {f"render_{k}": v for k, v in render.items()}
    note = "engine_bridge.probes.render; ratios against one apply_chat_template call"
    for metric, key in (
        ("one apply_chat_template, text only", "template_s"),
        ("one apply_chat_template, tokenized (its default)", "template_tokenized_s"),
        ("render_chat, cold: token ids and message starts", "render_chat_cold_s"),
        ("render_chat, the next turn (prefix memo warm)", "render_chat_next_turn_s"),
        ("before: one render per message prefix", "per_prefix_renders_s"),
    ):
        t = render[key]
        result.rows.append(
            Row(
                f"{metric}, {n} messages with tools (ms)",
                {"ours": t * 1e3},
                {"/ text only": ratio(t, one), "/ tokenized": ratio(t, tokenized)},
                note=note,
            )
        )


def _cold_series(settings: Settings, model: ModelSpec, result: ScenarioResult) -> None:
    """Fresh long prompts in a row, each a full miss, while the cache fills with the earlier
    ones: the miss path must not slow down as the cache grows.

    Both servers run at once and take each prompt in turn, alternating which goes first, so
    drift on a shared machine falls on both alike.
    """
    n = 5
    tokens = settings.size(1500, 20_000)
    cpt = chars_per_token(model)
    # The corpus starts every document alike: a first line of its own makes each prompt
    # share nothing past a few tokens, with our block chain or mlx_lm.server's token prefix.
    prompts = []
    for k in range(n):
        system, user = traces.chat_trace(settings.seed + 100 + k, 1, tokens, cpt).session(0)
        system = {**system, "content": f"{k * 7919 % 1000:03d} cold series\n{system['content']}"}
        prompts.append([system, user])
    with Harness(settings, result, model) as h, h.serve("ours") as ours, h.serve("mlx_lm") as base:
        for k, messages in enumerate(prompts):
            for server in (ours, base) if k % 2 == 0 else (base, ours):
                sample = h.send(
                    server, "openai", {"messages": messages, "max_tokens": 1}, k, "cold"
                )
                h.progress(f"cold prompt {k + 1}/{n}", server, sample)
    ttft = {kind: [s.ttft_s for s in result.of(kind, "cold")] for kind in ("ours", "mlx_lm")}
    per_prompt = [ratio(a, b) for a, b in zip(ttft["ours"], ttft["mlx_lm"], strict=True)]
    result.metrics |= {f"cold_{k + 1}_ours_over_mlx_lm": r for k, r in enumerate(per_prompt)}
    prompt_tokens = result.of("ours", "cold")[-1].prompt_tokens
    result.rows.append(
        Row(
            f"TTFT of the fifth fresh {prompt_tokens}-token prompt in a row, cache holding "
            "the first four (s)",
            {"ours": ttft["ours"][-1], "mlx_lm": ttft["mlx_lm"][-1]},
            {
                "ours / mlx_lm, fifth": per_prompt[-1],
                "ours / mlx_lm, first": per_prompt[0],
            },
            note="per prompt: " + ", ".join(f"{r:.3f}" for r in per_prompt if r is not None),
        )
    )


def _bare_samples(k: int, bare: dict) -> list[Sample]:
    """Every timed run of bare mlx-lm on prompt `k`, as samples of the "bare" server."""
    return [
        Sample("bare", k, t, t, bare["prompt_tokens"], 0, 1, None, ok=True, label="turn")
        for t in bare["ttft_s"]
    ]


# --- tier-stall ------------------------------------------------------------------------------

STALL_MODEL = "demo-hybrid"
STREAMS = 4
STALL_CASES = ("normal", "redis", "ssd")  # (c), then (a) and (b) against it
STALL_LABELS = {
    "normal": "(c) normal: the fifth's prefix from the SSD, Redis answering",
    "redis": "(a) the Redis port black-holed",
    "ssd": "(b) the SSD's entry reads hang",
}
STALL_TARGET = 0.9
REDIS_TIMEOUT_S = 1.0  # [cache.shared] timeout of the measured engine: the store's deadline
SSD_STALL_S = 2.0  # engine_bridge.cache.tier_reads.SSD_STALL_S, the SSD's deadline


@dataclass(frozen=True, slots=True)
class StallSizes:
    prefix_chars: int  # the fifth request's system prompt, on the SSD
    repeats: int  # of the three cases, interleaved
    ssd_read_s: float  # each hung entry-file read: past the SSD's deadline

    @classmethod
    def of(cls, settings: Settings) -> StallSizes:
        return settings.size(cls(2400, 3, 3.0), cls(9000, 7, 3.0))


def tier_stall(
    settings: Settings, model: ModelSpec, sizes: StallSizes | None = None
) -> ScenarioResult:
    """Decode tok/s of four streams while a fifth request's lookup waits on a slow tier."""
    sizes = sizes or StallSizes.of(settings)
    result = ScenarioResult("tier-stall", STALL_MODEL)
    # Reuse the bench's demo builds when --model is one; else build demo-hybrid under --out.
    root = model.path.parent.parent if model.is_demo else settings.out
    out = settings.out / "work" / "tier-stall" / "tier-stall.json"
    cmd = [sys.executable, "-m", "bench.scenarios.overhead", "--root", str(root),
           "--out", str(out), "--seed", str(settings.seed), "--prefix-chars",
           str(sizes.prefix_chars), "--repeats", str(sizes.repeats),
           "--ssd-read-s", str(sizes.ssd_read_s)]  # fmt: skip
    settings.progress(f"[tier-stall] {STALL_MODEL}: {sizes.repeats} interleaved runs of "
                      f"{', '.join(STALL_CASES)}")  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0 or not out.is_file():
        result.errors.append(f"bench.scenarios.overhead exited {proc.returncode}: "
                             f"{proc.stderr[-3000:]}")  # fmt: skip
        return result.finish()
    _stall_rows(json.loads(out.read_text()), result)
    return result.finish()


def _stall_rows(answer: dict[str, Any], result: ScenarioResult) -> None:
    runs, window = answer["runs"], answer["window_s"]
    cases = [c for c in STALL_CASES if any(r["case"] == c for r in runs)]
    tok_s = {c: median(r["tok_s"] for r in runs if r["case"] == c) for c in cases}
    normal = {r["repeat"]: r["tok_s"] for r in runs if r["case"] == "normal"}
    vs = {c: median(ratio(r["tok_s"], normal.get(r["repeat"])) for r in runs if r["case"] == c)
          for c in cases}  # fmt: skip
    for c in cases:
        mine = [r for r in runs if r["case"] == c]
        result.metrics |= {
            f"{c}_tok_s": tok_s[c], f"{c}_over_normal": vs[c],
            f"{c}_max_gap_s": max(r["max_gap_s"] for r in mine),
            f"{c}_fifth_wait_s": median(r["fifth_wait_s"] for r in mine),
        }  # fmt: skip
        for r in mine:
            if not r["streams_alive"]:
                result.errors.append(f"{c} run {r['repeat'] + 1}: a stream ended inside the window")
            result.samples.append(Sample(
                "ours", r["repeat"], r["fifth_wait_s"], r["fifth_total_s"], r["fifth_prompt"],
                r["fifth_cached"], r["fifth_completion"], r["fifth_source"], ok=True, label=c,
            ))  # fmt: skip
    ratios = {f"{STALL_LABELS[c][:3]} / (c)": vs[c] for c in cases if c != "normal"}
    met = all(v is not None and v >= STALL_TARGET for v in ratios.values())
    result.rows.append(
        Row(
            f"decode tok/s of {STREAMS} streams while a 5th request looks up, (c) normal",
            {"ours": tok_s.get("normal")},
            ratios,
            note=f"over {window:g} s from the 5th request's send (the longest tier deadline); "
            f"medians of {answer['repeats']} interleaved runs, each ratio against its own "
            f"run's (c); target ≥ {STALL_TARGET:g}: {'met' if met else 'MISSED'}",
        )
    )
    for c in cases:
        mine = [r for r in runs if r["case"] == c]
        result.rows.append(
            Row(
                f"decode tok/s, {STALL_LABELS[c]}",
                {"ours": tok_s[c]},
                {"/ (c)": vs[c]} if c != "normal" else {},
                note=f"longest gap between a stream's tokens in the window "
                f"{result.metrics[f'{c}_max_gap_s']:.3f} s; the 5th waited "
                f"{result.metrics[f'{c}_fifth_wait_s']:.2f} s for its lookup, got "
                + ", ".join(f"{r['fifth_cached']} tokens from {r['fifth_source']}" for r in mine),
            )
        )
    if answer.get("redis_missing"):
        result.notes.append(f"(a) not run: {answer['redis_missing']}")
    result.notes.append(
        f"deadlines: the shared store's timeout ({REDIS_TIMEOUT_S:g} s), the SSD's "
        f"{SSD_STALL_S:g} s without progress; hung SSD reads take {answer['ssd_read_s']:g} s each"
    )


# --- in the child process: the engine, in-process ---------------------------------------------


def _stall_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.scenarios.overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--root", type=Path, required=True, help="holds (or gets) models/")
    p.add_argument("--out", type=Path, required=True, help="the JSON answer's path")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefix-chars", type=int, default=2400)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--ssd-read-s", type=float, default=3.0)
    args = p.parse_args(argv)
    from engine_bridge.models.demo import ensure_demo_model

    sizes = StallSizes(args.prefix_chars, args.repeats, args.ssd_read_s)
    root = args.root.resolve()
    ensure_demo_model(STALL_MODEL, root)
    redis_missing = "; ".join(r.reason for r in (REDIS_SERVER, REDIS) if not r.found())
    with tempfile.TemporaryDirectory() as tmp:
        cache_dir = Path(tmp) / "cache"
        cache_dir.mkdir()
        (cache_dir / "models").symlink_to(root / "models", target_is_directory=True)
        answer = _stall_run(cache_dir, Path(tmp), sizes, args.seed, not redis_missing)
    answer |= {"redis_missing": redis_missing, **asdict(sizes)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(answer, indent=1))
    return 0


def _stall_run(cache_dir: Path, tmp: Path, sizes: StallSizes, seed: int, redis: bool) -> dict:
    from engine_bridge.cache.shared.config import SharedConfig
    from engine_bridge.engine import Engine, EngineSettings

    from .shared_redis import RedisServer
    from .shared_relay import DelayRelay

    server = RedisServer(tmp).start() if redis else None
    relay = DelayRelay(("127.0.0.1", server.port), 0.0) if server is not None else None
    shared = None
    if relay is not None:  # back within a second of the relay answering again
        shared = SharedConfig(relay.url, timeout_s=REDIS_TIMEOUT_S, retry_s=0.2, retry_max_s=1.0)
    engine = Engine(EngineSettings(cache_dir=cache_dir, model_specs=[STALL_MODEL], shared=shared))
    loop = asyncio.Runner()
    try:
        return loop.run(_stall_measure(engine, relay, sizes, seed))
    finally:
        loop.run(engine.close())
        loop.close()
        if relay is not None:
            relay.close()
        if server is not None:
            server.stop()


async def _stall_measure(engine, relay, sizes: StallSizes, seed: int) -> dict[str, Any]:
    from engine_bridge.cache.ssd import store as ssd_store
    from engine_bridge.types import GenerationRequest, Message, Sampling

    def request(messages: list[tuple[str, str]], max_tokens: int) -> GenerationRequest:
        return GenerationRequest(model=STALL_MODEL, messages=[Message(r, c) for r, c in messages],
                                 max_tokens=max_tokens, sampling=Sampling(temperature=0.0))  # fmt: skip

    rng = random.Random(f"tier-stall/{seed}")
    system = ("system", "Tier stall.\n" + corpus.prose(rng, sizes.prefix_chars))
    streams = [request([("user", f"Stream {i}: {corpus.prose(rng, 400)}")], 4000)
               for i in range(STREAMS)]  # fmt: skip
    # A short question of its own after the stored system prompt: the fifth's own prefill
    # is a few tokens, so the window holds its lookup, not a long prefill.
    fifths = iter(request([system, ("user", f"Question {k}: what does the cache keep?")], 4)
                  for k in range(1000))  # fmt: skip
    await engine.load(STALL_MODEL)
    # Untimed: every kernel shape built, and the fifth's system prompt stored and on disk.
    for r in (next(fifths), *(_short(s) for s in streams)):
        await _drain(await engine.start(r))
    real_read = ssd_store.read_file

    def hung_read(*args: Any, **kwargs: Any) -> Any:
        time.sleep(sizes.ssd_read_s)
        return real_read(*args, **kwargs)

    def fault(case: str, on: bool) -> None:
        if case == "redis":
            relay.delay_s = 60.0 if on else 0.0  # one-way: far past the timeout
        elif case == "ssd":
            ssd_store.read_file = hung_read if on else real_read

    window = max(REDIS_TIMEOUT_S, SSD_STALL_S)
    cases = [c for c in STALL_CASES if c != "redis" or relay is not None]
    runs = []
    for repeat in range(sizes.repeats):
        for case in cases:
            await _only_on_ssd(engine)
            run = await _stall_case(engine, streams, next(fifths), window,
                                    lambda on, case=case: fault(case, on))  # fmt: skip
            runs.append({"case": case, "repeat": repeat, **run})
            print(f"tier-stall: {case} {repeat + 1}/{sizes.repeats}: {run['tok_s']:.0f} tok/s, "
                  f"gap {run['max_gap_s']:.3f} s, 5th waited {run['fifth_wait_s']:.2f} s",
                  file=sys.stderr, flush=True)  # fmt: skip
            if case == "redis":
                await _until(lambda: engine.tiers.shared.stats().available, 30.0)
    return {"runs": runs, "window_s": window}


async def _stall_case(engine, streams, fifth, window: float, fault) -> dict[str, Any]:
    """The streams decode; once each is in flow the fault goes on, the fifth request is
    sent, and the streams' tokens are counted for `window` seconds from its send."""
    from engine_bridge.types import TokenEvent

    arrivals: list[list[tuple[float, int]]] = [[] for _ in streams]
    flowing = [asyncio.Event() for _ in streams]
    started = [await engine.start(r) for r in streams]

    async def consume(i: int) -> None:
        async for event in started[i]:
            if isinstance(event, TokenEvent):
                arrivals[i].append((time.perf_counter(), event.tokens))
                if len(arrivals[i]) == 8:
                    flowing[i].set()

    tasks = [asyncio.create_task(consume(i)) for i in range(len(streams))]
    await asyncio.gather(*(f.wait() for f in flowing))
    fault(True)
    t0 = time.perf_counter()
    fifth_task = asyncio.create_task(_timed(engine, fifth, t0))
    await asyncio.sleep(window)
    t1 = time.perf_counter()
    alive = not any(t.done() for t in tasks)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for s in started:
        await s.aclose()
    five = await fifth_task
    fault(False)
    tokens = sum(n for a in arrivals for t, n in a if t0 <= t < t1)
    gaps = [b - a for times in arrivals for (a, _), (b, _) in zip(times, times[1:], strict=False)
            if a < t1 and b > t0]  # fmt: skip
    # A stream still waiting for its next token when the window closed: that wait so far.
    gaps += [t1 - max(t for t, _ in times if t < t1) for times in arrivals]
    return {"tok_s": tokens / (t1 - t0), "max_gap_s": max(gaps, default=t1 - t0),
            "streams_alive": alive, **five}  # fmt: skip


async def _timed(engine, req, t0: float) -> dict[str, Any]:
    stream = await engine.start(req)
    admitted = time.perf_counter()
    await _drain(stream)
    r = stream.result
    return {"fifth_wait_s": admitted - t0, "fifth_total_s": time.perf_counter() - t0,
            "fifth_source": stream.source, "fifth_cached": stream.cached_tokens,
            "fifth_prompt": stream.prompt_tokens,
            "fifth_completion": r.completion_tokens if r is not None else None}  # fmt: skip


async def _only_on_ssd(engine) -> None:
    """Every entry written to the SSD and gone from RAM: the fifth's prefix is an SSD hit."""

    def evict() -> None:
        engine.tiers.deferred.flush(everything=True)
        ram = engine.tiers.ram
        budget = ram.budget_bytes
        ram.set_budget(0)
        ram.set_budget(budget)

    await engine.scheduler.run(evict)
    await asyncio.to_thread(engine.tiers.ssd.flush, 60.0)


async def _drain(stream) -> None:
    async for _ in stream:
        pass


async def _until(ready, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while not ready() and time.monotonic() < end:
        await asyncio.sleep(0.1)


def _short(req):
    from dataclasses import replace

    return replace(req, max_tokens=4)


if __name__ == "__main__":
    raise SystemExit(_stall_main())
