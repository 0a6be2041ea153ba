"""Start, stop and restart the servers a benchmark compares, each a subprocess on a free port.

Three kinds: our proxy on a fresh cache dir, our proxy with `--no-cache`, and mlx_lm.server,
the tool users run today; and for images, mlx-vlm's own server with its prefix cache on.
Logs go to the run's output folder so a failed run can be read.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from . import client

Kind = Literal["ours", "nocache", "mlx_lm", "mlx_vlm"]
KINDS: tuple[Kind, ...] = ("ours", "nocache", "mlx_lm")
LABELS: dict[str, str] = {
    "ours": "mlx-prompt-cache",
    "nocache": "mlx-prompt-cache --no-cache",
    "mlx_lm": "mlx_lm.server",
    "mlx_vlm": "mlx_vlm.server (APC on)",
}
# The other projects' servers, by kind: no cache dir of ours, started by module.
REFERENCE_SERVERS = {"mlx_lm": "mlx_lm.server", "mlx_vlm": "mlx_vlm.server"}
READY_TIMEOUT_S = 300.0
REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model as each server wants it: our proxy takes an id or a path, mlx_lm a path."""

    id: str
    path: Path
    is_demo: bool

    @property
    def proxy_arg(self) -> str:
        return self.id if self.is_demo else str(self.path)


@dataclass(slots=True)
class Server:
    kind: Kind
    url: str
    port: int
    proc: subprocess.Popen
    log_path: Path
    cmd: list[str]
    cache_dir: Path | None
    model: ModelSpec
    # perf_counter() at launch until ready, then the seconds from launch to ready.
    ready_s: float
    # What requests name as "model": our proxy's id, or mlx_lm.server's default.
    model_name: str = "default_model"
    stopped_rc: int | None = field(default=None)

    @property
    def label(self) -> str:
        return LABELS[self.kind]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> float:
        """Signal the server and wait for it to exit; returns the seconds that took."""
        start = time.perf_counter()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.stopped_rc = self.proc.returncode
        return time.perf_counter() - start

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fresh_cache_dir(root: Path, name: str, model: ModelSpec) -> Path:
    """An empty cache dir of its own, with the demo model copied in so nothing rebuilds it."""
    path = root / name
    n = 1
    while path.exists():
        n += 1
        path = root / f"{name}-{n}"
    path.mkdir(parents=True)
    if model.is_demo:
        shutil.copytree(model.path, path / "models" / model.id, symlinks=True)
    return path


def start(
    kind: Kind,
    model: ModelSpec,
    logs: Path,
    cache_dir: Path | None = None,
    tag: str = "",
    proxy_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> Server:
    """Start one server and wait until /health answers; raises with the log tail if it dies."""
    server = launch(kind, model, logs, cache_dir, tag, proxy_args, env)
    wait_ready(server)
    return server


def launch(
    kind: Kind,
    model: ModelSpec,
    logs: Path,
    cache_dir: Path | None = None,
    tag: str = "",
    proxy_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> Server:
    """Start one server; `proxy_args` go to our proxy's serve command (e.g. engine knobs),
    `env` to its environment (e.g. the test-only forced-output hook)."""
    port = free_port()
    if kind in REFERENCE_SERVERS:
        cmd = [sys.executable, "-m", REFERENCE_SERVERS[kind], "--model", str(model.path)]
        cmd += ["--host", "127.0.0.1", "--port", str(port)]
    else:
        assert cache_dir is not None, f"{kind} needs a cache dir"
        cmd = [sys.executable, "-m", "proxy.cli", "serve", "--port", str(port)]
        cmd += ["--cache-dir", str(cache_dir), "--model", model.proxy_arg]
        # Nothing upstream: a passthrough must fail fast, not wait on LM Studio.
        cmd += ["--upstream", "http://127.0.0.1:9"]
        if kind == "nocache":
            cmd.append("--no-cache")
        cmd += proxy_args
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"{kind}{'-' + tag if tag else ''}-{port}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if kind == "mlx_vlm":
        # Its automatic prefix cache (vision features by image hash included) is off by
        # default; its disk tier goes to the run's folder, not the user's cache.
        env |= {"APC_ENABLED": "1", "APC_DISK_PATH": str(logs / f"mlx_vlm-apc-{port}")}
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    return Server(kind, url, port, proc, log_path, cmd, cache_dir, model, time.perf_counter())


def restart(server: Server, tag: str = "restarted") -> tuple[Server, float]:
    """SIGTERM our proxy and start a new one on the same cache dir and model."""
    stop_s = server.stop(signal.SIGTERM)
    return start(server.kind, server.model, server.log_path.parent, server.cache_dir, tag), stop_s


def wait_ready(server: Server) -> None:
    """Poll /health until it answers; `ready_s` becomes the seconds since launch."""
    launched = server.ready_s
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if not server.alive():
            raise RuntimeError(
                f"{server.label} exited with {server.proc.returncode}; "
                f"log {server.log_path}:\n{server.log_tail()}"
            )
        try:
            health = client.get_json(server.url, "/health", timeout=2.0)
        except (OSError, RuntimeError, ValueError):
            time.sleep(0.1)
            continue
        server.ready_s = time.perf_counter() - launched
        if server.kind == "mlx_vlm":
            server.model_name = str(server.model.path)
        elif server.kind != "mlx_lm":
            server.model_name = (health.get("models") or [server.model.id])[0]
        return
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"{server.label} not ready in {READY_TIMEOUT_S:.0f}s; see {server.log_path}")


class Fleet:
    """The servers one scenario runs, stopped together however the scenario ends."""

    def __init__(self) -> None:
        self.servers: list[Server] = []

    def add(self, server: Server) -> Server:
        self.servers.append(server)
        return server

    def replace(self, old: Server, new: Server) -> Server:
        self.servers = [new if s is old else s for s in self.servers]
        return new

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc) -> None:
        for server in self.servers:
            server.stop()
