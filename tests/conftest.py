"""Shared fixtures: demo models built once per session, and real proxy servers."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parent.parent
DEMO_IDS = ("demo-llama", "demo-hybrid", "demo-swa")
# Our user's model shape (qwen3_5_moe, experts, the 248k vocabulary, an MTP head with
# experts): every path demo-hybrid takes runs on it too, or its test says why not.
QWEN36 = "demo-qwen36"
HYBRID_IDS = ("demo-hybrid", QWEN36)
# Warming ahead prefills between requests whenever a template rewrote history, so a test's
# next request would hit deeper than it predicts, by timing. Test servers run without it;
# the tests of warming ahead pass WARM_AHEAD_ON.
WARM_AHEAD_ENV = "MLX_PROMPT_CACHE_CACHE_WARM_AHEAD_ENABLED"
WARM_AHEAD_ON = {WARM_AHEAD_ENV: "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> int:
    """The first of `n` consecutive free ports (a ring of ranks listens on one each)."""
    while True:
        first = free_port()
        try:
            for p in range(first, first + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return first
        except OSError:
            continue


@pytest.fixture(scope="session")
def demo_root(tmp_path_factory) -> Path:
    """A cache dir whose models/ holds the demo models, built once."""
    from engine_bridge.models.demo import ensure_demo_model

    root = tmp_path_factory.mktemp("demo-root")
    for name in (*DEMO_IDS, QWEN36):
        ensure_demo_model(name, root)
    return root


def fresh_cache_dir(demo_root: Path, dest: Path) -> Path:
    """A new, empty cache dir that reuses the already-built demo models: the small ones
    copied, demo-qwen36's 130 MB linked (nothing writes into a built model's folder)."""
    dest.mkdir(parents=True, exist_ok=True)
    models = dest / "models"
    if not models.exists():
        shutil.copytree(demo_root / "models", models, ignore=shutil.ignore_patterns("demo-qwen36*"))
        for built in (demo_root / "models").glob("demo-qwen36*"):
            if built.is_dir():
                (models / built.name).symlink_to(built, target_is_directory=True)
    return dest


@dataclass
class Server:
    url: str
    port: int
    cache_dir: Path
    proc: subprocess.Popen
    log_path: Path
    args: list[str] = field(default_factory=list)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(
    cache_dir: Path,
    *args: str,
    log_path: Path | None = None,
    env: dict | None = None,
    prefix: tuple[str, ...] = (),
) -> Server:
    """`prefix` runs the server through a wrapper command (e.g. setpriv to drop privileges)."""
    port = free_port()
    log_path = log_path or cache_dir / f"server-{port}.log"
    cmd = [
        *prefix,
        sys.executable,
        "-m",
        "proxy.cli",
        "serve",
        "--port",
        str(port),
        "--cache-dir",
        str(cache_dir),
        *args,
    ]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", WARM_AHEAD_ENV: "0", **(env or {})}
    log_file = log_path.open("w")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT, env=full_env)
    server = Server(f"http://127.0.0.1:{port}", port, cache_dir, proc, log_path, list(args))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(server.url + "/health", timeout=1.0).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"server did not become healthy:\n{server.log()}")


@pytest.fixture(scope="session")
def server(demo_root, tmp_path_factory) -> Iterator[Server]:
    """One proxy serving the three demo models, shared by the API tests."""
    cache_dir = fresh_cache_dir(demo_root, tmp_path_factory.mktemp("server-cache"))
    s = start_server(cache_dir, "--upstream", "http://127.0.0.1:9")
    yield s
    s.stop()


@pytest.fixture
def openai_client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="test", max_retries=0, timeout=120)


@pytest.fixture
def anthropic_client(server):
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key="test", max_retries=0, timeout=120)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI, a test skipped for a missing required part (tests/support/required.py) fails."""
    from tests.support import required

    outcome = yield
    report = outcome.get_result()
    if report.skipped and required.in_ci() and required.MARK in str(report.longrepr):
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, which must have every part: {report.longrepr}"
