"""A real `redis-server` for the shared tier's tests: a free port, a temp dir, no saves.

Tests skip, saying why, only when the binary is absent (`.ci/run` installs Debian's
package; on a Mac, `brew install redis`).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from tests.conftest import free_port

REDIS_SERVER = shutil.which("redis-server")


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
        assert REDIS_SERVER is not None
        log = (self.dir / "redis.log").open("a")
        self.proc = subprocess.Popen(
            [
                REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.dir), "--save", "", "--appendonly", "no",
                "--enable-debug-command", "local", *self.args,
            ],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        password = self._password()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if self.client(password=password).ping():
                    return self
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start:\n{(self.dir / 'redis.log').read_text()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None

    def client(self, password: str | None = None) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=password or self._password())

    def _password(self) -> str | None:
        args = list(self.args)
        return args[args.index("--requirepass") + 1] if "--requirepass" in args else None

    def calls(self, command: str) -> int:
        """How many times the server ran `command` (INFO commandstats)."""
        stats = self.client().info("commandstats")
        return stats.get(f"cmdstat_{command}", {}).get("calls", 0)


def redis_fixture(tmp_path: Path, *args: str) -> Iterator[RedisServer]:
    if REDIS_SERVER is None:
        pytest.skip(
            "redis-server is not installed (apt-get install redis-server; brew install redis)"
        )
    server = RedisServer(tmp_path, args=args).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(name="redis_server")
def redis_server_fixture(tmp_path) -> Iterator[RedisServer]:
    """A fresh redis-server for one test."""
    yield from redis_fixture(tmp_path)
