"""`mlx-prompt-cache` command line: serve, cache, models, bench."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    return 2


def serve(args: argparse.Namespace) -> int:
    from engine_bridge.engine import Engine, EngineSettings

    from .app import create_app
    from .logs import setup_logging
    from .state import ProxySettings

    setup_logging(args.log_level or "info")
    cache_dir = (args.cache_dir or Path("~/.cache/mlx-prompt-cache")).expanduser()
    engine = Engine(
        EngineSettings(
            cache_dir=cache_dir,
            model_specs=args.models or [],
            lmstudio_dirs=[Path("~/.lmstudio/models"), Path("~/.cache/lm-studio/models")],
            cache_enabled=not args.no_cache,
            ram_budget_bytes=_default_ram_budget(),
        )
    )
    settings = ProxySettings(
        cache_enabled=not args.no_cache,
        upstream_url=args.upstream or "http://127.0.0.1:1234",
        max_body_bytes=args.max_body_bytes or 32 << 20,
    )
    app = create_app(engine, settings)
    asyncio.run(_run(app, args.host or "127.0.0.1", args.port or 1235))
    return 0


def _default_ram_budget() -> int:
    import psutil

    # 20% of what is available now, but never under 100 MB.
    return max(100 << 20, int(psutil.virtual_memory().available * 0.2))


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
