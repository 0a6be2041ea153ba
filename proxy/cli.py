"""`mlx-prompt-cache` command line: serve, cache, models, doctor, bench."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from .ranks.supervisor import RANK_LOST_EXIT  # rank 0's exit once it lost the others

log = logging.getLogger("proxy.cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlx-prompt-cache",
        description="A tiered, persistent prompt cache proxy for MLX models in front of LM Studio.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve models over OpenAI and Anthropic APIs")
    serve.add_argument("--config", type=Path, help="TOML config file")
    serve.add_argument("--host", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 1235)")
    serve.add_argument(
        "--model",
        action="append",
        dest="models",
        metavar="PATH_OR_ID",
        help="model to serve in-process (repeatable): demo id, MLX directory or LM Studio key",
    )
    serve.add_argument(
        "--cache-dir", type=Path, help="cache directory (default ~/.cache/mlx-prompt-cache)"
    )
    serve.add_argument(
        "--upstream", help="LM Studio URL for everything else (default http://127.0.0.1:1234)"
    )
    serve.add_argument("--no-cache", action="store_true", help="disable the prompt cache")
    serve.add_argument(
        "--insecure",
        action="store_true",
        help="allow a non-loopback --host without [tenants] api_keys (anyone on the network "
        "can then use the server)",
    )
    serve.add_argument("--log-level", help="debug, info, warning, error")
    serve.add_argument("--max-body-bytes", type=int, help="largest accepted request body")
    serve.add_argument(
        "--ram-budget", help='RAM tier budget: "20%%" of available or a size like "8GB"'
    )
    serve.add_argument(
        "--max-batch",
        type=int,
        metavar="N",
        help="sequences of one model decoded together (default 8)",
    )
    serve.add_argument(
        "--ranks",
        type=int,
        metavar="N",
        help="split each model across N processes on this machine (docs/distributed.md)",
    )
    serve.add_argument(
        "--hostfile", type=Path, help="mlx.launch hostfile: split each model across its hosts"
    )
    serve.add_argument("--backend", choices=("ring", "jaccl"), help="link between the ranks")
    serve.add_argument(
        "--split", choices=("tensor", "pipeline"), help="split by heads (tensor) or by layers"
    )
    serve.add_argument(
        "--print-config", action="store_true", help="print the effective config as TOML and exit"
    )
    models = sub.add_parser("models", help="list models found in LM Studio's folders")
    models.add_argument("--config", type=Path, help="TOML config file")
    models.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    cache = sub.add_parser("cache", help="inspect or clear the SSD cache (no server needed)")
    cache.add_argument("action", choices=("stats", "ls", "clear"))
    cache.add_argument("--config", type=Path, help="TOML config file")
    cache.add_argument("--cache-dir", type=Path, help="cache directory (default from config)")
    cache.add_argument("--model", help="clear: only this model fingerprint")
    cache.add_argument("--json", action="store_true", help="machine-readable output")
    doctor = sub.add_parser(
        "doctor",
        help="what is loaded where (here and in LM Studio), memory figures, extras and servers",
    )
    doctor.add_argument("--config", type=Path, help="TOML config file")
    doctor.add_argument("--json", action="store_true", help="one JSON object instead of text")
    # Listed for --help only: main() hands `bench ARGS` to the bench package's own parser,
    # so that serve never imports the benchmark.
    sub.add_parser(
        "bench", help="measure TTFT, hit ratio, restarts and memory against mlx_lm.server"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from bench import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args, argv)
    if args.command == "models":
        return list_models(args)
    if args.command == "cache":
        return cache_command(args)
    if args.command == "doctor":
        return doctor_command(args)
    return 2


def _load(args: argparse.Namespace, overrides: dict[str, Any] | None = None):
    from .config.loader import load_config
    from .config.schema import ConfigError

    try:
        return load_config(args.config, os.environ, overrides or {})
    except ConfigError as e:
        print(f"mlx-prompt-cache: config error: {e}", file=sys.stderr)
        return None


def cache_command(args: argparse.Namespace) -> int:
    """`cache stats|ls|clear` on the cache dir, offline: reads the SSD index directly."""
    import json

    from engine_bridge.offline import offline_clear, offline_ls, offline_stats

    overrides = {"cache.ssd.dir": str(args.cache_dir) if args.cache_dir else None}
    config = _load(args, overrides)
    if config is None:
        return 2
    root = config.cache.ssd.path
    if args.action == "stats":
        stats = offline_stats(root)
        if args.json:
            print(json.dumps(stats))
        else:
            for key, value in stats.items():
                print(f"{key:18} {_human(key, value)}")
    elif args.action == "ls":
        groups = offline_ls(root)
        if args.json:
            for g in groups:
                print(json.dumps(g))
        elif not groups:
            print(f"no cache entries under {root}")
        else:
            print(f"{'MODEL':34} {'TENANT':26} {'BLOCKS':>7} {'CKPTS':>6} {'SIZE':>10}  LAST USED")
            for g in groups:
                print(
                    f"{g['model']:34} {g['tenant']:26} {g['blocks']:>7} {g['checkpoints']:>6} "
                    f"{_human('bytes', g['bytes']):>10}  {_human('last_access', g['last_access'])}"
                )
    else:
        removed = offline_clear(root, args.model)
        print(
            json.dumps({"removed": removed})
            if args.json
            else f"removed {removed} entries from {root}"
        )
    return 0


def doctor_command(args: argparse.Namespace) -> int:
    """`doctor`: what is loaded where, memory, extras and servers (proxy/doctor.py)."""
    import json

    from .doctor import diagnose, render

    config = _load(args)
    if config is None:
        return 2
    report = asyncio.run(diagnose(config))
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


def _human(key: str, value: Any) -> str:
    import time

    if value is None:
        return "-"
    if "bytes" in key and isinstance(value, int):
        for unit in ("B", "KB", "MB", "GB", "TB"):
            if value < 1000 or unit == "TB":
                return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
            value /= 1000
    if key == "last_access":
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(value)))
    return str(value)


def list_models(args: argparse.Namespace) -> int:
    """What LM Studio's folders hold, and which of it this proxy serves in-process."""
    import json

    from engine_bridge.offline import scan

    config = _load(args)
    if config is None:
        return 2
    roots = [Path(d) for d in config.models.lmstudio_dirs]
    served = set(config.models.serve)
    rows = []
    for m in scan(roots):
        local = m.format == "mlx" and (
            config.models.serve_all_mlx or m.id in served or str(m.path) in served
        )
        where = "local" if local else ("upstream" if m.format == "gguf" else "not served")
        rows.append(
            {
                "id": m.id,
                "format": m.format,
                "architecture": m.architecture,
                "cache": m.cache_kind,
                "vision": m.vision,
                "served": where,
                "size_gb": round(m.size_bytes / 1e9, 2),
                "path": str(m.path),
            }
        )
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    if not rows:
        print("no models found under " + ", ".join(str(r.expanduser()) for r in roots))
        return 0
    cols = ("id", "format", "architecture", "cache", "vision", "served", "size_gb")
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    print("  ".join(c.upper().ljust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(str(r[c]).ljust(widths[c]) for c in cols))
    return 0


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Flags as dotted config keys; None means the flag was not given."""
    return {
        "server.host": args.host,
        "server.port": args.port,
        "server.max_body_bytes": args.max_body_bytes,
        "server.log_level": args.log_level,
        "models.serve": args.models,
        "cache.ssd.dir": str(args.cache_dir) if args.cache_dir else None,
        "cache.ram.budget": args.ram_budget,
        "engine.max_batch": args.max_batch,
        "upstream.url": args.upstream,
        "cache.enabled": False if args.no_cache else None,
        "server.insecure": True if args.insecure else None,
        "distributed.ranks": args.ranks,
        "distributed.hostfile": str(args.hostfile) if args.hostfile else None,
        "distributed.backend": args.backend,
        "distributed.mode": args.split,
    }


def serve(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    from .config.loader import check_exposure, config_to_toml
    from .config.schema import ConfigError

    config = _load(args, _overrides(args))
    if config is None:
        return 2
    if args.print_config:
        print(config_to_toml(config), end="")
        print(_effective_model_settings(config), end="")
        return 0
    try:
        check_exposure(config)
    except ConfigError as e:
        print(f"mlx-prompt-cache: config error: {e}", file=sys.stderr)
        return 2

    from .app import create_app
    from .logs import setup_logging
    from .security import browser_policy, is_loopback_bind
    from .wiring import before_load_hook, engine_settings, proxy_settings

    setup_logging(config.server.log_level, config.server.log_json)
    server = config.server
    exposed = not is_loopback_bind(server.host)
    if exposed and not config.tenants.api_keys:
        log.warning(
            "INSECURE: listening on %s without [tenants] api_keys (--insecure): anyone who "
            "can reach port %d can run the models and read or clear the prompt cache",
            server.host,
            server.port,
        )
    policy = browser_policy(
        server.host, server.allowed_hosts, server.cors_origins, config.tenants.api_keys
    )
    if "*" in server.cors_origins or "*" in server.allowed_hosts:
        log.warning(
            'INSECURE: %s contains "*": web pages on any site can use this server',
            "server.cors_origins" if "*" in server.cors_origins else "server.allowed_hosts",
        )
    split = config.distributed.ranks > 1 or config.distributed.hostfile is not None
    if split and not launched_rank():
        # This process is the front: it starts the ranks and relays to rank 0.
        from .ranks.front import serve_front

        return serve_front(config, argv or sys.argv[1:], policy)
    from engine_bridge.engine import Engine
    from engine_bridge.types import EngineError

    try:
        engine = Engine(engine_settings(config, rank=split))
    except EngineError as e:
        print(f"mlx-prompt-cache: {e.message}", file=sys.stderr)
        return 2
    ranks = engine.ranks()
    if ranks is not None and ranks["rank"] != 0:
        return follow(engine, ranks)
    engine.before_load = before_load_hook(config)
    from engine_bridge.offline import cpu_blas

    if (advice := cpu_blas().advice()) is not None:  # Linux on mlx[cpu] only
        log.warning("%s", advice)
    app = create_app(engine, proxy_settings(config), config.upstream, policy)
    halted = engine.halted if ranks is not None else None
    asyncio.run(_run(app, config.server.host, config.server.port, halted))
    # Rank 0 that lost the other ranks says so to the front, which starts them again.
    _exit(RANK_LOST_EXIT if ranks is not None and engine.halted() else 0)


def launched_rank() -> bool:
    """Whether mlx.launch started this process as one rank of a split model."""
    return "MLX_RANK" in os.environ


def follow(engine: Any, ranks: dict) -> int:
    """A rank past the first: no HTTP, only rank 0's steps, until rank 0 ends (or a stop,
    which keeps what this rank's slices wrote to its SSD tier)."""

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    log.info("rank %d of %d (%s) follows rank 0", ranks["rank"], ranks["size"], ranks["mode"])
    try:
        engine.follow()
    except SystemExit:
        log.info("rank %d stopped", ranks["rank"])
    _exit(0)
    return 0


def _exit(code: int) -> None:
    # Everything is drained and closed by now. Skip interpreter finalization: MLX frees a
    # finished generation thread's thread-local state late, and when that races the
    # interpreter's teardown the process aborts (SIGABRT) after a clean shutdown.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _effective_model_settings(config: Any) -> str:
    """Comments after --print-config's TOML: what each served model's settings resolve to."""
    from .config.tomltext import inline
    from .doctor import served_settings

    lines = [
        "",
        '# What each served model gets: its [model."<pattern>"] settings, over the template',
        "# kwargs the engine sets by default (such as preserve_thinking):",
    ]
    lines += [f"# {inline(model_id)} = {inline(s)}" for model_id, s in served_settings(config)]
    return "\n".join(lines) + "\n"


async def _run(
    app: web.Application, host: str, port: int, halted: Callable[[], str | None] | None = None
) -> None:
    # handler_cancellation: a client that disconnects cancels its handler, which cancels
    # its generation within one decode step.
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=10.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    log.info("serving on http://%s:%d", host, port)
    print(f"mlx-prompt-cache serving on http://{host}:{port}", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    watch = asyncio.create_task(_watch_ranks(halted, stop)) if halted is not None else None
    await stop.wait()
    if watch is not None:
        watch.cancel()
    log.info("shutting down")
    await runner.cleanup()


async def _watch_ranks(halted: Callable[[], str | None], stop: asyncio.Event) -> None:
    """Rank 0: once the engine lost the other ranks (its requests already answered 503),
    shut down, so that the front starts every rank again."""
    while (reason := halted()) is None:
        await asyncio.sleep(0.25)
    log.error("%s; rank 0 is shutting down", reason)
    await asyncio.sleep(1.0)  # the 503s go out first
    stop.set()


if __name__ == "__main__":
    sys.exit(main())
