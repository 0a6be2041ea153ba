"""A throwaway `redis-server` on a free port and a temp dir, nothing saved to disk: for the
shared-tier bench and tests (Debian's redis-server package; Homebrew's on a Mac)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
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
    # A folder with ca.pem, server.pem and server.key (make_certs): TLS only, on `port`.
    tls: Path | None = None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        import redis  # the shared extra: imported where used, as the bench may run without it

        if REDIS_SERVER is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        log = (self.dir / "redis.log").open("a")
        ports = ["--port", str(self.port)]
        if self.tls is not None:
            ports = ["--port", "0", "--tls-port", str(self.port), "--tls-auth-clients", "no"]
            for flag, name in (("cert", "server.pem"), ("key", "server.key"), ("ca-cert", "ca.pem")):  # fmt: skip
                ports += [f"--tls-{flag}-file", str(self.tls / name)]
        self.proc = subprocess.Popen(
            [
                REDIS_SERVER, *ports, "--bind", "127.0.0.1",
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
        import redis

        args = list(self.args)
        password = args[args.index("--requirepass") + 1] if "--requirepass" in args else None
        if self.tls is None:
            return redis.Redis(host="127.0.0.1", port=self.port, password=password)
        return redis.Redis(
            host="127.0.0.1", port=self.port, password=password,
            ssl=True, ssl_ca_certs=str(self.tls / "ca.pem"),
        )  # fmt: skip

    def calls(self, command: str) -> int:
        """How many times the server ran `command` (INFO commandstats)."""
        stats = self.client().info("commandstats")
        return stats.get(f"cmdstat_{command}", {}).get("calls", 0)


def make_certs(folder: Path) -> Path:
    """A throwaway CA and a server certificate for 127.0.0.1 (the openssl command line)."""
    folder.mkdir(parents=True, exist_ok=True)

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key",
            "-out", "ca.pem", "-days", "2", "-subj", "/CN=mlx-prompt-cache test CA")  # fmt: skip
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key",
            "-out", "server.csr", "-subj", "/CN=127.0.0.1")  # fmt: skip
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "server.pem", "-days", "2", "-extfile", "san.ext")  # fmt: skip
    return folder
