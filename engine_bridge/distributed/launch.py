"""The `mlx.launch` command line that starts every rank of one model.

`--ranks N` starts N ranks on this machine over loopback (the ring backend), for trying
a split out and for tests; a hostfile (mlx.launch's JSON: each host's ssh name, its IPs
for the ring backend, its RDMA devices for jaccl) starts one rank per host. MLX's own
launcher does the rest: the ssh, the ports, each rank's environment (run through
quiet_launch.py, which keeps its relay from spinning a core).

It loads no MLX: the proxy's front process, which starts the ranks and relays to rank 0,
imports it through `engine_bridge.offline`.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

BACKENDS = ("ring", "jaccl")  # world.Backend's values


class LaunchError(ValueError):
    """A hostfile or rank count that cannot start a world."""


@dataclass(frozen=True, slots=True)
class Ranks:
    """Where the ranks run: `count` on this machine, or one per host of `hostfile`."""

    backend: str = "ring"
    count: int | None = None
    hostfile: Path | None = None
    # The first TCP port the ranks listen on (each rank one more); None: mlx.launch's
    # default. Two worlds on one machine at once need ports apart.
    port: int | None = None

    def size(self) -> int:
        if self.hostfile is None:
            return self.count or 1
        return len(hosts(self.hostfile))


def hosts(hostfile: Path) -> list[dict]:
    """The hosts of an mlx.launch hostfile, checked enough to name what is wrong."""
    try:
        data = json.loads(hostfile.read_text(encoding="utf-8"))
    except OSError as e:
        raise LaunchError(f"hostfile {hostfile}: {e.strerror or e}") from e
    except json.JSONDecodeError as e:
        raise LaunchError(f"hostfile {hostfile}: not JSON ({e})") from e
    listed = data.get("hosts") if isinstance(data, dict) else data
    if not isinstance(listed, list) or not listed:
        raise LaunchError(f"hostfile {hostfile}: expected a list of hosts")
    for i, h in enumerate(listed):
        if not isinstance(h, dict) or not isinstance(h.get("ssh"), str):
            raise LaunchError(f'hostfile {hostfile}: host {i} has no "ssh" name')
    return listed


def launcher() -> list[str]:
    """MLX's launcher, run by this Python through quiet_launch.py: mlx.launch itself, with
    its relay waiting for output instead of spinning a core."""
    if importlib.util.find_spec("mlx") is None:
        raise LaunchError("mlx is not installed: it ships the launcher (mlx.launch)")
    return [sys.executable, "-m", "engine_bridge.distributed.quiet_launch"]


def first_host_is_here(hostfile: Path) -> bool:
    """Whether the hostfile's first host (rank 0, which answers HTTP) is this machine."""
    first = hosts(hostfile)[0]
    names = {first["ssh"].split("@")[-1], *first.get("ips", [])}
    here = {"localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()}
    here |= {f"{h}.local" for h in list(here)}
    try:
        import psutil

        here |= {a.address for addrs in psutil.net_if_addrs().values() for a in addrs}
    except ImportError:  # pragma: no cover - psutil is a base dependency
        pass
    return bool(names & here)


def command(ranks: Ranks, argv: list[str], env: Mapping[str, str] | None = None) -> list[str]:
    """The command that runs `argv` (a Python program's arguments) on every rank, with
    `env` set on each (a remote host sees only what mlx.launch passes it)."""
    if ranks.backend not in BACKENDS:
        raise LaunchError(f"backend must be one of {', '.join(BACKENDS)}, got {ranks.backend!r}")
    if ranks.hostfile is None:
        n = ranks.count or 1
        if n < 2:
            raise LaunchError(f"--ranks must be 2 or more, got {n}")
        if ranks.backend != "ring":
            raise LaunchError("ranks on this machine talk over loopback: backend must be ring")
        where = ["-n", str(n), "--hosts", "127.0.0.1"]
    else:
        hosts(ranks.hostfile)
        where = ["--hostfile", str(ranks.hostfile)]
    if ranks.port is not None:
        where += ["--starting-port", str(ranks.port)]
    for key, value in (env or {}).items():
        where += ["--env", f"{key}={value}"]
    return [
        *launcher(),
        "--backend",
        str(ranks.backend),
        *where,
        "--python",
        sys.executable,
        "--",
        *argv,
    ]
