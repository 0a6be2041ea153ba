"""Render the LaunchAgent plist from ``launchd/com.mlx-prompt-cache.plist.template``.

Used by ``scripts/launchd-agent``: ``python -m proxy.launchd render --cli … --config …``.
Standard library only, and Python 3.9-compatible, so macOS's own python3 can run it too.
"""

from __future__ import annotations

import argparse
import os
import plistlib
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

LABEL = "com.mlx-prompt-cache"
TEMPLATE = Path(__file__).resolve().parent.parent / "launchd" / f"{LABEL}.plist.template"
DEFAULT_LOG_DIR = Path("~/Library/Logs/mlx-prompt-cache")
DEFAULT_CONFIG = Path("~/.config/mlx-prompt-cache/config.toml")
# Homebrew (Apple Silicon, then Intel) before the system: launchd's own PATH has neither.
SYSTEM_PATH = "/opt/homebrew/bin:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"


def _absolute(path: Path | str) -> str:
    # launchd takes paths literally: no ~, no $HOME, no relative paths.
    return str(Path(path).expanduser().absolute())


def render_plist(
    cli_path: Path | str,
    config_path: Path | str,
    log_dir: Path | str,
    env: Mapping[str, str] | None = None,
    *,
    working_dir: Path | str | None = None,
    template: Path = TEMPLATE,
) -> bytes:
    """The plist as XML bytes: the installed CLI serving ``config_path``, logs in ``log_dir``.

    ``env`` adds to (or replaces) the template's EnvironmentVariables; PATH starts with the
    CLI's own bin folder so tools installed next to it are found.
    """
    cli = _absolute(cli_path)
    values = {
        "@CLI@": cli,
        "@CONFIG@": _absolute(config_path),
        "@LOG_DIR@": _absolute(log_dir),
        "@WORKDIR@": _absolute(working_dir if working_dir is not None else Path.home()),
        "@PATH@": f"{Path(cli).parent}:{SYSTEM_PATH}",
    }

    def fill(node: Any) -> Any:
        if isinstance(node, str):
            for placeholder, value in values.items():
                node = node.replace(placeholder, value)
            return node
        if isinstance(node, list):
            return [fill(item) for item in node]
        if isinstance(node, dict):
            return {key: fill(item) for key, item in node.items()}
        return node

    raw = template.read_bytes()
    unknown = set(re.findall(r"@[A-Z_]+@", raw.decode())) - values.keys()
    assert not unknown, f"template {template} has placeholders nobody fills: {unknown}"
    plist = fill(plistlib.loads(raw))
    assert plist["Label"] == LABEL, plist["Label"]
    plist["EnvironmentVariables"].update(env or {})
    return plistlib.dumps(plist, fmt=plistlib.FMT_XML, sort_keys=False)


def _parse_env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--env expects KEY=VALUE, got {pair!r}")
        env[key] = value
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m proxy.launchd")
    sub = parser.add_subparsers(dest="command", required=True)
    render = sub.add_parser("render", help="print the LaunchAgent plist")
    render.add_argument("--cli", required=True, help="installed mlx-prompt-cache executable")
    render.add_argument("--config", default=str(DEFAULT_CONFIG), help="config file to serve")
    render.add_argument("--log-dir", default=str(DEFAULT_LOG_DIR), help="stdout/stderr folder")
    render.add_argument("--workdir", default=None, help="working directory (default: home)")
    render.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    render.add_argument("--output", "-o", default="-", help="file to write (default: stdout)")
    args = parser.parse_args(argv)

    data = render_plist(
        args.cli, args.config, args.log_dir, _parse_env(args.env), working_dir=args.workdir
    )
    if args.output == "-":
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    else:
        # Write then rename, so launchd never reads a half-written plist.
        tmp = f"{args.output}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
