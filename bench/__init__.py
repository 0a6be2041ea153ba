"""`mlx-prompt-cache bench`: TTFT, hit ratio, restarts and memory against the baselines.

It starts the servers it compares (our proxy on a fresh cache dir, our proxy with
--no-cache, and mlx_lm.server) on free ports, drives them with the same requests, and
writes results.json, results.md and PNG plots into --out.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

SCENARIOS = (
    "chat",
    "agent",
    "agent-templates",
    "restart",
    "share",
    "hybrid",
    "overhead",
    "concurrency",
    "shared",
    "wear",
    "vision",
    "speculative",
    "tier-stall",
    "distributed",
    "autotune",
)
HYBRID_DEFAULT = ("demo-hybrid", "demo-swa", "demo-qwen36")


def main(argv: list[str] | None = None) -> int:
    """`mlx-prompt-cache bench ARGS`: parse ARGS and run the scenarios they name."""
    return run(build_parser().parse_args(argv))


def build_parser() -> argparse.ArgumentParser:
    from engine_bridge.probes.shapes import SHAPES

    p = argparse.ArgumentParser(
        prog="mlx-prompt-cache bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        default="demo-llama",
        metavar="ID_OR_PATH",
        help="demo model id or MLX model directory (default demo-llama)",
    )
    p.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        help="build a random-weight model with this real model's configuration and "
        "use it instead of --model (large: meant for a machine with a GPU)",
    )
    p.add_argument(
        "--scenarios",
        nargs="+",
        default=list(SCENARIOS),
        metavar="NAME",
        help=f"any of {', '.join(SCENARIOS)}; comma or space separated (default all)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="shrink every scenario: about five minutes on a 2-core CPU",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("bench-out/latest"),
        help="output folder (default bench-out/latest)",
    )
    p.add_argument(
        "--models-dir",
        type=Path,
        help="where demo and --shape models are built (default OUT/models)",
    )
    p.add_argument(
        "--hybrid-models",
        nargs="+",
        default=list(HYBRID_DEFAULT),
        metavar="ID_OR_PATH",
        help="models of the hybrid scenario (default demo-hybrid demo-swa demo-qwen36)",
    )
    p.add_argument(
        "--proxy-args",
        default="",
        metavar="FLAGS",
        help="extra flags for our proxy's serve command, e.g. --proxy-args='--max-batch 4' "
        "once serve has it (default: none, the proxy's own defaults)",
    )
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request")
    p.add_argument("--seed", type=int, default=0, help="seed of the traces")
    return p  # fmt: skip


def scenario_names(values: list[str]) -> list[str]:
    names = [n.strip() for v in values for n in v.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise SystemExit(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(SCENARIOS)}")
    return list(dict.fromkeys(names))


def command_line(args: argparse.Namespace, names: list[str]) -> str:
    """The command that reproduces this run."""
    parts = [
        "mlx-prompt-cache bench",
        f"--shape {args.shape}" if args.shape else f"--model {args.model}",
    ]
    parts.append("--scenarios " + ",".join(names))
    if args.quick:
        parts.append("--quick")
    if args.proxy_args:
        parts.append(f"--proxy-args={shlex.quote(args.proxy_args)}")
    parts.append(f"--out {args.out}")
    return " ".join(parts)


def run(args: argparse.Namespace) -> int:
    from . import report
    from .harness import Settings
    from .scenarios.registry import run_one

    names = scenario_names(args.scenarios)
    out: Path = args.out.resolve()
    models_dir = (args.models_dir or out / "models").resolve()
    # The probes build demos and shapes under ROOT/models, like the proxy's cache dir.
    if models_dir.name != "models":
        models_dir = models_dir / "models"
    started = time.perf_counter()
    started_at = datetime.now(UTC).isoformat(timespec="seconds")

    def progress(line: str) -> None:
        print(f"{time.perf_counter() - started:7.1f}s {line}", file=sys.stderr, flush=True)

    progress(f"[bench] preparing models in {models_dir}")
    from .harness import resolve_model

    model = resolve_model(args.model, models_dir, args.shape)
    hybrid = [resolve_model(m, models_dir) for m in args.hybrid_models] if "hybrid" in names else []
    from .corpus import digest

    settings = Settings(
        out, model, hybrid, args.quick, args.seed, args.max_tokens, progress,
        tuple(shlex.split(args.proxy_args)),
    )  # fmt: skip
    meta: dict[str, Any] = {
        "command": command_line(args, names),
        "started_at": started_at,
        "quick": args.quick,
        "scenarios": names,
        "seed": args.seed,
        "max_tokens": args.max_tokens,
        "proxy_args": settings.proxy_args,
        "model": {"id": model.id, "path": str(model.path), "shape": args.shape},
        "hybrid_models": [m.id for m in hybrid],
        "corpus_digest": digest(),
        "machine": report.machine(),
        "versions": report.versions(),
    }
    results = []
    for name in names:
        progress(f"[{name}] starting")
        produced = run_one(name, settings)
        results += produced
        for r in produced:
            if r.skipped is not None:
                progress(f"[{name}] skipped: {r.skipped}")
                continue
            head = report.main_table([r]).splitlines()[-1]
            progress(f"[{name}] done in {r.seconds:.0f}s {head}")
        meta["duration_s"] = time.perf_counter() - started
        report.write(out, results, meta)  # after each scenario: an interrupted run keeps data
    meta["duration_s"] = time.perf_counter() - started
    meta["load_avg_1m_end"] = report.load_avg()
    written = report.write(out, results, meta)
    print(report.main_table(results))
    print(f"\nresults: {out / 'results.md'}, {out / 'results.json'}")
    for p in written["plots"]:
        print(f"plot: {p}")
    if written["plot_note"]:
        print(written["plot_note"])
    for r in results:
        if r.skipped is not None:
            print(f"skipped: {r.scenario}: {r.skipped}", file=sys.stderr)
    # A skipped scenario has no errors: the status is that of the scenarios that ran.
    errors = [f"{r.scenario} ({r.model}): {e}" for r in results for e in r.errors]
    for e in errors:
        print(f"error: {e}", file=sys.stderr)
    return 1 if errors else 0
