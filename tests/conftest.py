"""Shared fixtures: demo models built once per session, and real proxy servers."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
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


# The longest test files, longest first (seconds on a 2-core CPU, from `--durations=0`
# summed by file). ./scripts/test keeps each file on one worker (--dist loadfile), and xdist
# hands out files with the most tests first, so a long file of one test (the soaks) would
# start last and run on one worker while the other sits idle. The workers take these first,
# then the rest by their number of tests, as xdist would: a list out of date costs balance,
# never a test.
SLOWEST_FILES = (
    "tests/ops/test_bench.py",  # 160
    "tests/distributed/test_serve_ranks.py",  # 107
    "tests/prompting/test_tool_formats.py",  # 106
    "tests/prompting/test_agent_templates.py",  # 106
    "tests/cache/test_diagnosis.py",  # 104
    "tests/cache/test_cache_equivalence.py",  # 91
    "tests/ssd/test_ssd_server.py",  # 70
    "tests/dialects/test_real_clients.py",  # 68
    "tests/ops/test_soak.py",  # 52
    "tests/distributed/test_lockstep.py",  # 51
    "tests/dialects/test_fuzz.py",  # 50
    "tests/distributed/test_sharded_load.py",  # 49
    "tests/ops/test_crash_soak.py",  # 46
    "tests/scheduling/test_speculative_mtp.py",  # 45
    "tests/dialects/test_stream_keepalive.py",  # 43
    "tests/scheduling/test_speculative.py",  # 30
    "tests/prompting/test_real_template_formats.py",  # 30
    "tests/scheduling/test_batching.py",  # 30
    "tests/prompting/test_qwen36_real_template.py",  # 27
    "tests/prompting/test_foreign_markup.py",  # 27
    "tests/distributed/test_ranks_shared.py",  # 25
    "tests/cache/test_cache_http.py",  # 25
    "tests/vision/test_vision_features.py",  # 21
    "tests/cache/test_warm_ahead.py",  # 20
    "tests/ssd/test_ssd_damage.py",  # 20
    "tests/scheduling/test_speculative_rules.py",  # 19
    "tests/cache_api/test_dashboard.py",  # 18
    "tests/upstream/test_upstream_routing.py",  # 16
    "tests/shared/test_shared_http.py",  # 15
    "tests/vision/test_bench_vision.py",  # 15
    "tests/cache/test_autotune.py",  # 15
)


def pytest_configure(config):
    # In the controller: hand out files in the order the workers collected them (below),
    # not re-sorted by their number of tests.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """In an xdist worker: the longest files first, then the rest by number of tests.

    Only the order of files changes; tests within a file keep theirs."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return

    def file_of(item) -> str:
        return item.nodeid.split("::")[0]

    per_file = Counter(map(file_of, items))
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}

    def key(item) -> tuple[int, int]:
        name = file_of(item)
        return (rank[name], 0) if name in rank else (len(rank), -per_file[name])

    items.sort(key=key)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI, a test skipped for a missing required part (tests/support/required.py) fails."""
    from tests.support import required

    outcome = yield
    report = outcome.get_result()
    if report.skipped and required.in_ci() and required.MARK in str(report.longrepr):
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, which must have every part: {report.longrepr}"
