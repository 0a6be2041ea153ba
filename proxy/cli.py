"""`mlx-prompt-cache` command line: serve, cache, models, bench."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from aiohttp import web

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
    serve.add_argument("--log-level", help="debug, info, warning, error")
    serve.add_argument("--max-body-bytes", type=int, help="largest accepted request body")
    serve.add_argument("--ram-budget", help='RAM tier budget: "20%%" of available or a size like "8GB"')
    serve.add_argument(
        "--print-config", action="store_true", help="print the effective config as TOML and exit"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    return 2


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
        "upstream.url": args.upstream,
        "cache.enabled": False if args.no_cache else None,
    }


def serve(args: argparse.Namespace) -> int:
    from .config import ConfigError, config_to_toml, load_config

    try:
        config = load_config(args.config, os.environ, _overrides(args))
    except ConfigError as e:
        print(f"mlx-prompt-cache: config error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(config_to_toml(config), end="")
        return 0

    from .app import create_app
    from .logs import setup_logging
    from .wiring import engine_settings, proxy_settings

    setup_logging(config.server.log_level, config.server.log_json)
    from engine_bridge.engine import Engine
    from engine_bridge.types import EngineError

    try:
        engine = Engine(engine_settings(config))
    except EngineError as e:
        print(f"mlx-prompt-cache: {e.message}", file=sys.stderr)
        return 2
    app = create_app(engine, proxy_settings(config), config.upstream)
    asyncio.run(_run(app, config.server.host, config.server.port))
    return 0


async def _run(app: web.Application, host: str, port: int) -> None:
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
    await stop.wait()
    log.info("shutting down")
    await runner.cleanup()


if __name__ == "__main__":
    sys.exit(main())
