"""The speculative scenario: decode speed when the model copies from its prompt.

A Claude Code Edit writes back a span of a file it was shown, with a small change. Here the
prompt holds a source file (plausible Python, generated from the bench seed) and the model
is forced, through its logits (engine_bridge/scheduling/forced_output.py), to re-emit a long span of
it with one number changed. Each demo model decodes that span with speculation off, with
prompt lookup (the real drafter), with an oracle that proposes exactly the forced tokens
(the upper bound), and with a drafter that is always wrong (the overhead), interleaved
(off, lookup, oracle, wrong, off, ...) so drift on a shared machine falls on all alike;
tok/s are medians, and each ratio is the median over the repeats of that repeat's run
against the same repeat's run with speculation off.

Decode speed is (completion tokens - 1) / (generation time - TTFT), from the engine's own
GenerationResult. The engine runs in-process in a process of its own (`python -m
bench.scenarios.speculative`): the bench process never imports mlx, and the forced output is read
from the environment when the Engine is built.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engine_bridge.ops.blas import cpu_blas, mapped_blas, openblas_env

from ..results import Number, Row, Sample, ScenarioResult, median, ratio
from ..servers import REPO

# demo-qwen36: a verify pass through experts and a 248k-row head, our user's model shape.
MODELS = ("demo-llama", "demo-hybrid", "demo-swa", "demo-qwen36")
CONFIGS = ("off", "lookup", "oracle", "wrong")
LABELS = {
    "off": "speculation off",
    "lookup": "prompt lookup",
    "oracle": "oracle drafter (upper bound)",
    "wrong": "always-wrong drafter (overhead)",
}
# The targets: lookup at least twice plain decode on a copy; a drafter that is
# never right costs at most 5%.
LOOKUP_TARGET = 2.0
WRONG_TARGET = 0.95
STATS = ("decode_steps", "decode_tokens", "spec_rounds", "spec_drafted", "spec_accepted",
         "spec_replays")  # fmt: skip


@dataclass(frozen=True, slots=True)
class Sizes:
    lines: int  # of the source file in the prompt
    span_tokens: int  # at least this many tokens re-emitted
    repeats: int  # timed runs of each configuration

    @classmethod
    def of(cls, settings) -> Sizes:
        return settings.size(cls(300, 300, 3), cls(600, 800, 5))


# Small enough for a test on a 2-core CPU; every configuration still runs on every model.
TINY = Sizes(30, 40, 1)


# --- The case: a file, an edit of one of its spans, and the request (no mlx here) ---

_NOUNS = ("order", "invoice", "customer", "ledger", "entry", "account", "payment", "refund",
          "batch", "record", "item", "line", "balance", "rate", "window", "cursor", "session",
          "report", "shipment", "quota")  # fmt: skip
_VERBS = ("load", "parse", "merge", "apply", "check", "render", "collect", "split", "close",
          "price", "settle", "filter", "group", "count", "round", "match", "fetch", "store")  # fmt: skip
_ATTRS = ("amount", "created_at", "status", "owner", "currency", "due", "weight", "region",
          "priority", "label", "count", "limit")  # fmt: skip


@dataclass(frozen=True, slots=True)
class Case:
    path: str
    source: str  # the whole file, as the prompt shows it
    span: str  # the lines the model writes back, before the edit
    edited: str  # what it writes: the span with one number changed
    old: str
    new: str

    def messages(self) -> list[dict[str, str]]:
        return [
            {"role": "system", "content": "You are a coding agent. To edit a file, write "
             "back the span you change, exactly as it is apart from the change."},
            {"role": "user", "content": f"Here is {self.path}:\n\n```python\n{self.source}"
             f"```\n\nChange `{self.old}` to `{self.new}` and write back the span from "
             f"`{self.span.splitlines()[0]}` with the change."},
        ]  # fmt: skip


def source_file(seed: int, lines: int) -> str:
    """A module of dataclasses and small functions, `lines` lines or a few more."""
    rng = random.Random(f"speculative/{seed}")
    out = ['"""Billing helpers: orders, invoices and their ledgers."""', "",
           "from __future__ import annotations", "", "import math",
           "from dataclasses import dataclass, field", ""]  # fmt: skip
    while len(out) < lines:
        out += ["", "", *_block(rng)]
    return "\n".join(out) + "\n"


def _block(rng: random.Random) -> list[str]:
    noun, other = rng.sample(_NOUNS, 2)
    verb = rng.choice(_VERBS)
    a, b, c = rng.sample(_ATTRS, 3)
    cls = "".join(w.title() for w in (other, noun))
    n, d = rng.randint(2, 500), rng.randint(1, 4)
    shape = rng.randrange(4)
    if shape == 0:
        return [
            "@dataclass(slots=True)", f"class {cls}:", f'    """One {noun} of a {other}."""', "",
            f"    {a}: int", f'    {b}: str = ""', f"    {c}: float = {n}.0",
            "    tags: list[str] = field(default_factory=list)", "",
            f"    def {verb}(self) -> bool:",
            f"        return self.{a} > {n} and bool(self.{b})",
        ]  # fmt: skip
    if shape == 1:
        return [
            f"def {verb}_{noun}s({noun}s: list, limit: int = {n}) -> list:",
            f'    """{verb.title()} the {noun}s up to `limit`, oldest first."""',
            "    out = []", f"    for {noun} in sorted({noun}s, key=lambda x: x.{a}):",
            "        if len(out) >= limit:", "            break",
            f"        if {noun}.{b} is None:", "            continue",
            f"        out.append({noun})", "    return out",
        ]  # fmt: skip
    if shape == 2:
        return [
            f"def {verb}_{other}_{a}({other}, scale: float = {d}.5) -> float:",
            f'    """The {a} of a {other}, over its {noun}s, rounded to {d} places."""',
            "    total = 0.0", f"    for {noun} in {other}.{noun}s:",
            f"        if {noun}.{b} == {other}.{b}:", f"            total += {noun}.{a} * scale",
            f"        elif {noun}.{c} > {n}:", f"            total -= math.sqrt({noun}.{c})",
            f"    return round(total, {d})",
        ]  # fmt: skip
    return [
        f"def {noun}s_by_{a}({noun}s) -> dict:",
        f'    """The {noun}s grouped by {a}; groups under {n} are merged into "other"."""',
        "    groups: dict = {}", f"    for {noun} in {noun}s:",
        f"        groups.setdefault({noun}.{a}, []).append({noun})",
        f'    small = [k for k, v in groups.items() if len(v) < {n}]',
        "    for k in small:", '        groups.setdefault("other", []).extend(groups.pop(k))',
        "    return groups",
    ]  # fmt: skip


def make_case(seed: int, lines: int, span_tokens: int, count_tokens) -> Case:
    """The file and the span an edit writes back: from a definition a third of the way in,
    whole lines until `count_tokens` says it holds `span_tokens`, one number changed in the
    middle."""
    source = source_file(seed, lines)
    rows = source.splitlines(keepends=True)
    starts = [i for i, r in enumerate(rows) if r.startswith(("def ", "@dataclass"))]
    first = next((i for i in starts if i >= len(rows) // 3), starts[0])
    end = first + 1
    while end < len(rows) and count_tokens("".join(rows[first:end])) < span_tokens:
        end += 1
    span = rows[first:end]
    middle = (first + end) // 2
    at = next(
        (i for i in [*range(middle, end), *range(first, middle)] if re.search(r"\d", rows[i])),
        None,
    )
    assert at is not None, "a span with no number in it"
    m = re.search(r"\d+", rows[at])
    assert m is not None, rows[at]
    old = rows[at].strip()
    changed = rows[at][: m.start()] + str(int(m.group()) + 1) + rows[at][m.end() :]
    edited = [*span[: at - first], changed, *span[at - first + 1 :]]
    return Case("billing/helpers.py", source, "".join(span), "".join(edited), old,
                changed.strip())  # fmt: skip


# --- In the measuring process: the engine, the drafters, the interleaved runs ---


class Oracle:
    """Proposes the forced tokens that follow the output so far."""

    def __init__(self, truth: list[int]):
        self.truth = truth

    def propose(self, out, k: int) -> list[int]:
        return self.truth[len(out) : len(out) + k]


class Wrong:
    """Proposes a token the forced output never holds: every draft is rejected."""

    def __init__(self, token: int):
        self.token = token

    def propose(self, out, k: int) -> list[int]:
        return [self.token] * k


def _progress(line: str) -> None:
    print(f"speculative: {line}", file=sys.stderr, flush=True)


async def _generate(engine, req):
    stream = await engine.start(req)
    async for _ in stream:
        pass
    assert stream.result is not None, req.model
    return stream.result


def measure_model(model_id: str, root: Path, case: Case, sizes: Sizes) -> dict[str, Any]:
    """Every configuration on one model, interleaved; the forced output must already be
    in the environment."""
    from engine_bridge.engine import Engine, EngineSettings
    from engine_bridge.scheduling.speculation.control import Mode

    with tempfile.TemporaryDirectory(prefix="bench-speculative-") as tmp:
        cache_dir = Path(tmp)
        (cache_dir / "models").symlink_to(root / "models")
        engine = Engine(EngineSettings(cache_dir=cache_dir, model_specs=[model_id],
                                       ssd_enabled=False))  # fmt: skip
        # Measured against plain decode whatever "auto" would pick on this device.
        engine.scheduler.settings.speculation.mode = Mode.PROMPT_LOOKUP
        loop = asyncio.Runner()
        try:
            return loop.run(_measure(engine, model_id, case, sizes))
        finally:
            loop.run(engine.close())
            loop.close()


async def _measure(engine, model_id: str, case: Case, sizes: Sizes) -> dict[str, Any]:
    from engine_bridge.types import GenerationRequest, Message, Sampling

    tokenizer = (await engine.models.runner(model_id)).loaded.tokenizer
    # What the forced-output rule scripts, then end of sequence (output_rules.py).
    truth = list(tokenizer.encode(case.edited, add_special_tokens=False))
    eos = getattr(tokenizer, "eos_token_id", None)
    truth.append(int(eos if eos is not None else min(tokenizer.eos_token_ids)))
    used = set(truth)
    wrong = next(t for t in range(1, len(truth) + 2) if t not in used)
    spec = engine.scheduler.settings.speculation
    drafters = {"off": None, "lookup": None, "oracle": lambda p: Oracle(truth),
                "wrong": lambda p: Wrong(wrong)}  # fmt: skip
    messages = [Message(m["role"], m["content"]) for m in case.messages()]
    stats = engine.scheduler.stats
    runs = []
    # One untimed round first: the model loads and every kernel shape is built.
    order = [(-1, c) for c in CONFIGS] + [(r, c) for r in range(sizes.repeats) for c in CONFIGS]
    for repeat, config in order:
        spec.drafter = drafters[config]
        req = GenerationRequest(
            model=model_id, messages=messages, max_tokens=len(truth) + 16,
            sampling=Sampling(temperature=0.0), use_cache=False,
            speculative=config != "off",
        )  # fmt: skip
        before = {k: getattr(stats, k) for k in STATS}
        r = await _generate(engine, req)
        delta = {k: getattr(stats, k) - before[k] for k in STATS}
        decode_s = r.generation_s - r.ttft_s
        runs.append({
            "config": config, "repeat": repeat, "ttft_s": r.ttft_s,
            "generation_s": r.generation_s, "prompt_tokens": r.prompt_tokens,
            "completion_tokens": r.completion_tokens, "finish_reason": str(r.finish_reason),
            "decode_tok_s": (r.completion_tokens - 1) / decode_s if decode_s > 0 else None,
            "text": r.text, **delta,
        })  # fmt: skip
        if repeat >= 0:
            tok_s = runs[-1]["decode_tok_s"] or 0.0
            _progress(f"{model_id} {config} {repeat + 1}/{sizes.repeats}: {tok_s:.0f} tok/s, "
                      f"{delta['decode_tokens']}/{delta['decode_steps']} tokens/steps")  # fmt: skip
    spec.drafter = None
    return {"model": model_id, "forced_tokens": len(truth), "runs": runs}


# --- In the bench process: run the above, turn its answer into the report's rows ---


def scenario(settings, model, sizes: Sizes | None = None) -> list[ScenarioResult]:
    """The bench's `speculative` scenario: one result per demo model and CPU BLAS.

    On Linux, where the mlx[cpu] wheel's reference BLAS costs linearly in the rows a pass
    carries (engine_bridge/ops/blas.py), the models run once on it and once more with a system
    OpenBLAS preloaded, whose cost, like a Mac's, barely grows from 1 row to 9."""
    sizes = sizes or Sizes.of(settings)
    # Reuse the bench's demo builds when --model is one; else build them under --out.
    root = model.path.parent.parent if model.is_demo else settings.out
    results = []
    for label, env in blas_runs():
        out = settings.out / "work" / "speculative" / f"speculative{label and '-' + label}.json"
        results += _run_child(settings, root, out, sizes, label, env)
    return results


def blas_runs() -> list[tuple[str, dict[str, str] | None]]:
    """(label, environment) per child: "" for the BLAS this process would use, then
    "openblas" with it preloaded where the first is the wheel's reference BLAS."""
    blas = cpu_blas()
    runs: list[tuple[str, dict[str, str] | None]] = [("", None)]
    if blas.reference and blas.openblas is not None:
        runs.append(("openblas", openblas_env(blas.openblas)))
    return runs


def _run_child(settings, root: Path, out: Path, sizes: Sizes, label: str,
               env: dict[str, str] | None) -> list[ScenarioResult]:  # fmt: skip
    cmd = [sys.executable, "-m", "bench.scenarios.speculative", "--root", str(root), "--out", str(out),
           "--seed", str(settings.seed), "--lines", str(sizes.lines),
           "--span-tokens", str(sizes.span_tokens), "--repeats", str(sizes.repeats)]  # fmt: skip
    on = f" on {BLAS_LABELS[label]}" if label else ""
    settings.progress(f"[speculative] {', '.join(MODELS)}{on}: {sizes.repeats} interleaved runs "
                      f"of {', '.join(CONFIGS)}")  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=env)  # fmt: skip
    assert proc.stderr is not None
    tail: deque[str] = deque(maxlen=40)
    for line in proc.stderr:
        tail.append(line)
        if line.startswith("speculative: "):
            settings.progress("[speculative] " + line.removeprefix("speculative: ").rstrip())
    if proc.wait() != 0 or not out.is_file():
        failed = ScenarioResult("speculative", _name(",".join(MODELS), label))
        failed.errors.append(
            f"bench.scenarios.speculative exited {proc.returncode}: {''.join(tail)}"
        )
        return [failed.finish()]
    answer = json.loads(out.read_text())
    return [summarize(answer, m, label) for m in answer["models"]]


BLAS_LABELS = {"openblas": "OpenBLAS (preloaded)"}


def _name(model: str, label: str) -> str:
    return f"{model} [{BLAS_LABELS[label]}]" if label else model


def summarize(answer: dict[str, Any], measured: dict[str, Any], label: str = "") -> ScenarioResult:
    """One model's runs as the report's rows; a changed output is an error, and so is a
    preload that did not take."""
    result = ScenarioResult("speculative", _name(measured["model"], label))
    result.seconds = measured.get("seconds", 0.0)
    if "error" in measured:
        result.errors.append(measured["error"])
        return result
    case, sizes = answer["case"], answer["sizes"]
    mapped = answer.get("blas", [])
    if label == "openblas" and not any("openblas" in p.lower() for p in mapped):
        result.errors.append(f"OpenBLAS was to be preloaded but the process mapped {mapped}")
    runs = measured["runs"]
    expected = case["edited"]
    changed = [r for r in runs if r["text"] != expected or r["completion_tokens"]
               != runs[0]["completion_tokens"] or r["finish_reason"] != runs[0]["finish_reason"]]  # fmt: skip
    for r in changed:
        which = "warm-up" if r["repeat"] < 0 else f"run {r['repeat'] + 1}"
        result.errors.append(
            f"speculation changed the greedy output: {r['config']} {which} wrote "
            f"{r['completion_tokens']} tokens ({r['finish_reason']}) "
            f"{'a different text' if r['text'] != expected else 'the same text'}; off wrote "
            f"{runs[0]['completion_tokens']} ({runs[0]['finish_reason']})"
        )
    result.metrics["outputs_identical"] = float(not changed)
    timed = [r for r in runs if r["repeat"] >= 0]
    for r in timed:
        result.samples.append(Sample(
            "ours", r["repeat"], r["ttft_s"], r["generation_s"], r["prompt_tokens"], 0,
            r["completion_tokens"], None, ok=True, label=r["config"], output=r["text"],
        ))  # fmt: skip
    tok_s: dict[str, Number] = {}
    for c in CONFIGS:
        mine = [r for r in timed if r["config"] == c]
        tok_s[c] = median(r["decode_tok_s"] for r in mine)
        sums = {k: sum(r[k] for r in mine) for k in STATS}
        result.metrics |= {
            f"{c}_decode_tok_s": tok_s[c],
            f"{c}_tokens_per_step": ratio(sums["decode_tokens"], sums["decode_steps"]),
            f"{c}_acceptance": ratio(sums["spec_accepted"], sums["spec_drafted"]),
            f"{c}_spec_rounds": sums["spec_rounds"],
            f"{c}_spec_replays": sums["spec_replays"],
        }
    # Each repeat's run against the "off" run of the same repeat, a few seconds apart: this
    # machine's speed drifts by a third between repeats, and a ratio of the medians would
    # carry that drift into the ratio.
    off = {r["repeat"]: r["decode_tok_s"] for r in timed if r["config"] == "off"}
    vs = {c: median(ratio(r["decode_tok_s"], off.get(r["repeat"])) for r in timed
                    if r["config"] == c) for c in CONFIGS}  # fmt: skip
    result.metrics |= {f"{c}_over_off": vs[c] for c in CONFIGS if c != "off"}
    tokens = runs[0]["completion_tokens"]
    result.rows.append(
        Row(
            f"decode tok/s, {tokens}-token edit copied from the prompt, speculation off",
            {"ours": tok_s["off"]},
            {f"{c} / off": vs[c] for c in CONFIGS if c != "off"},
            note=f"median of {sizes['repeats']} interleaved runs per configuration, ratios the "
            "median of each repeat's run over that repeat's off run; a "
            f"{sizes['lines']}-line file in a {runs[0]['prompt_tokens']}-token prompt; decode ="
            " (completion tokens - 1) / (generation - TTFT)",
        )
    )
    targets = {"lookup": LOOKUP_TARGET, "wrong": WRONG_TARGET}
    for c in CONFIGS[1:]:
        m = result.metrics
        note = f"acceptance {_fmt(m[f'{c}_acceptance'])}, {_fmt(m[f'{c}_tokens_per_step'])} "
        note += "tokens per model step"
        if c in targets:
            met = vs[c] is not None and vs[c] >= targets[c]
            note += f"; target ≥ {targets[c]:g}× off: {'met' if met else 'MISSED'}"
        result.rows.append(
            Row(
                f"decode tok/s, {LABELS[c]}",
                {"ours": tok_s[c]},
                {f"{c} / off": vs[c]},
                note=note,
            )  # fmt: skip
        )
    result.notes.append(
        "In-process engine, one request at a time, greedy, no prompt cache; the model is "
        "forced (through its logits) to write the span back with one number changed, so "
        "every configuration must write the same text: "
        + ("it did." if not changed else "IT DID NOT (see the errors).")
    )
    result.notes.append(f"CPU BLAS: {answer.get('blas_name', '?')}; mapped: "
                        f"{', '.join(Path(p).name for p in mapped) or 'none'}.")  # fmt: skip
    return result


def _fmt(value: Number) -> str:
    return "—" if value is None else f"{value:.3g}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.scenarios.speculative", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--models", default=",".join(MODELS), help="comma separated demo ids")
    p.add_argument("--root", type=Path, required=True, help="holds (or gets) models/")
    p.add_argument("--out", type=Path, required=True, help="the JSON answer's path")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lines", type=int, default=300)
    p.add_argument("--span-tokens", type=int, default=300)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    from engine_bridge.models.demo import ensure_demo_model
    from engine_bridge.scheduling.forced_output import ENV

    sizes = Sizes(args.lines, args.span_tokens, args.repeats)
    models = [m for m in args.models.split(",") if m]
    root = args.root.resolve()
    for m in models:
        ensure_demo_model(m, root)
    from tokenizers import Tokenizer

    # The demo models share one tokenizer: the span is the same length for all of them.
    tok = Tokenizer.from_file(str(root / "models" / models[0] / "tokenizer.json"))
    case = make_case(args.seed, sizes.lines, sizes.span_tokens,
                     lambda text: len(tok.encode(text, add_special_tokens=False).ids))  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    forced = args.out.with_name(args.out.stem + "-forced.json")
    forced.write_text(json.dumps({"outputs": [{"match": f"Here is {case.path}",
                                               "text": case.edited}]}))  # fmt: skip
    os.environ[ENV] = str(forced)
    answer: dict[str, Any] = {"case": asdict(case), "sizes": asdict(sizes), "models": [],
                              "blas_name": cpu_blas().name}  # fmt: skip
    for m in models:
        started = time.perf_counter()
        try:
            measured = measure_model(m, root, case, sizes)
        except Exception as e:  # one model's failure is its row's error, not the run's
            measured = {"model": m, "error": f"{type(e).__name__}: {e}", "runs": []}
        measured["seconds"] = time.perf_counter() - started
        answer["models"].append(measured)
    answer["blas"] = mapped_blas()  # after the engine imported mlx
    args.out.write_text(json.dumps(answer, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
