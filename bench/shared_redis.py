"""A throwaway `redis-server` on a free port and a temp dir, nothing saved to disk: for the
shared-tier bench and tests (Debian's redis-server package; Homebrew's on a Mac)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

REDIS_SERVER = shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RedisServer:
    dir: Path
    port: int = field(default_factory=free_port)
    args: tuple[str, ...] = ()
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        if REDIS_SERVER is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        log = (self.dir / "redis.log").open("a")
        self.proc = subprocess.Popen(
            [
                REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.dir), "--save", "", "--appendonly", "no", *self.args,
            ],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if self.client().ping():
                    return self
            except redis.ConnectionError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not start:\n{(self.dir / 'redis.log').read_text()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None

    def client(self) -> redis.Redis:
        args = list(self.args)
        password = args[args.index("--requirepass") + 1] if "--requirepass" in args else None
        return redis.Redis(host="127.0.0.1", port=self.port, password=password)

    def calls(self, command: str) -> int:
        """How many times the server ran `command` (INFO commandstats)."""
        stats = self.client().info("commandstats")
        return stats.get(f"cmdstat_{command}", {}).get("calls", 0)
