"""Load soak: many concurrent clients against one live proxy, watching for leaks and errors.

Shared by tests/ops/test_soak.py (a short CI run) and scripts/soak (the full count):

    python -m tests.tools.soak [--requests N] [--clients C] [--seed S] [--out DIR]

Each client is a thread with its own official ``openai`` and ``anthropic`` SDK clients. It
keeps a few conversations going (system prompts shared between sessions, short to long,
turns appended as the replies come back) on every demo model, in both dialects. About half
the requests stream; 10% of all requests hang up after the first chunks. A sample of greedy
answers is replayed at the end with ``x-prompt-cache: bypass`` and must match.

A monitor samples the server's RSS and open file descriptors twice a second. The run
passes when there are no errors (client side, or ERROR lines in the server log), RSS stays
under the stated bound with no growth in the second half, the descriptors at the end equal
those at the start, and every sampled answer equals its bypass replay.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import random
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import psutil

from tests.tools.soak_report import Sample, evaluate, write_report

DEFAULT_SEED = 20261201
MODELS = ("demo-llama", "demo-hybrid", "demo-swa")
RAM_BUDGET = 64_000_000  # small, so the RAM tier is full and evicting for most of the run
# The SSD tier too: 10,000 requests write about 720 MB, so it is full from a fifth of the
# way in. An SSD tier still filling up holds a growing index and a growing session registry,
# which would read as a leak.
SSD_MAX_BYTES = 128_000_000
# Headroom over the RSS at ready plus the RAM budget: live K/V of a full batch, the SSD
# writer's queue, MLX's buffer cache and allocator slack. Stated here, reported with the run.
MARGIN_BYTES = 256_000_000
BYPASS = {"x-prompt-cache": "bypass"}
WORDS = (
    "cache block token prefix model layer state tensor agent tool call result file read "
    "write edit search build test shell python return value error retry stream batch queue "
    "memory disk index hash session tenant prompt system user assistant turn reply context"
).split()
SIZES = {"short": 20, "medium": 250, "long": 1200}  # system prompt words (~1.3 tokens each)
TURNS_PER_CONVERSATION = 10


@dataclass
class Settings:
    requests: int = 2000
    clients: int = 16
    seed: int = DEFAULT_SEED
    disconnect_share: float = 0.10
    stream_share: float = 0.5
    sample_share: float = 0.03
    ram_budget: int = RAM_BUDGET
    ssd_max: int = SSD_MAX_BYTES
    margin: int = MARGIN_BYTES


@dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    streamed: int = 0
    disconnected: int = 0
    by_dialect: dict[str, int] = field(default_factory=lambda: {"openai": 0, "anthropic": 0})
    by_size: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SIZES, 0))
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


@dataclass
class Conversation:
    model: str
    dialect: str
    size: str
    system: str
    messages: list[dict[str, str]] = field(default_factory=list)


@dataclass
class Answer:
    """A greedy request kept for the bypass replay."""

    dialect: str
    stream: bool
    body: dict[str, Any]
    text: str


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def system_prompts(seed: int) -> dict[str, list[str]]:
    """Three system prompts per size, shared by many sessions as agents share theirs."""
    rng = random.Random(seed)
    return {size: [words(rng, n) for _ in range(3)] for size, n in SIZES.items()}


class Client:
    """One simulated user: a thread keeping two conversations going."""

    def __init__(
        self, index: int, url: str, settings: Settings, systems: dict[str, list[str]]
    ) -> None:
        self.rng = random.Random(settings.seed * 1000 + index)
        self.index = index
        self.settings = settings
        self.systems = systems
        self.openai = openai.OpenAI(
            base_url=url + "/v1", api_key="soak", max_retries=0, timeout=300
        )
        self.anthropic = anthropic.Anthropic(
            base_url=url, api_key="soak", max_retries=0, timeout=300
        )
        self.conversations = [self._new(k) for k in range(2)]
        self.answers: list[Answer] = []

    def _new(self, k: int) -> Conversation:
        n = self.index * 2 + k
        size = self.rng.choice(list(SIZES))
        return Conversation(
            model=MODELS[n % len(MODELS)],
            dialect=("openai", "anthropic")[(n // len(MODELS)) % 2],
            size=size,
            system=self.rng.choice(self.systems[size]),
        )

    def close(self) -> None:
        self.openai.close()
        self.anthropic.close()

    def run(self, counter: itertools.count, tally: Tally) -> None:
        s = self.settings
        for i in counter:
            if i >= s.requests:
                return
            k = i % 2
            conv = self.conversations[k]
            conv.messages.append(
                {"role": "user", "content": words(self.rng, self.rng.randint(5, 80))}
            )
            disconnect = self.rng.random() < s.disconnect_share
            stream = disconnect or self.rng.random() < s.stream_share
            sample = not disconnect and self.rng.random() < s.sample_share
            greedy = sample or self.rng.random() < 0.7
            body = {
                "model": conv.model,
                "max_tokens": 64 if disconnect else self.rng.choice((8, 16, 32)),
                "temperature": 0.0 if greedy else 0.8,
            }
            with tally.lock:
                tally.sent += 1
                tally.by_dialect[conv.dialect] += 1
                tally.by_size[conv.size] += 1
            try:
                text = self._send(conv, body, stream, disconnect)
            except Exception as exc:  # noqa: BLE001 - every failure is a soak finding
                with tally.lock:
                    tally.errors.append(f"request {i} ({conv.dialect}, {conv.model}): {exc!r}")
                conv.messages.pop()
                continue
            with tally.lock:
                tally.completed += 1
                tally.streamed += stream
                tally.disconnected += disconnect
            if disconnect:
                conv.messages.pop()  # the user gave up on this turn and asks again later
                continue
            if sample:
                self.answers.append(Answer(conv.dialect, stream, self._body(conv, body), text))
            conv.messages.append({"role": "assistant", "content": text or "ok"})
            if len(conv.messages) >= 2 * TURNS_PER_CONVERSATION:
                self.conversations[k] = self._new(k)

    @staticmethod
    def _body(conv: Conversation, body: dict[str, Any]) -> dict[str, Any]:
        messages = copy.deepcopy(conv.messages)
        if conv.dialect == "anthropic":
            return {**body, "system": conv.system, "messages": messages}
        return {**body, "messages": [{"role": "system", "content": conv.system}, *messages]}

    def _send(
        self, conv: Conversation, body: dict[str, Any], stream: bool, disconnect: bool
    ) -> str:
        full = self._body(conv, body)
        if conv.dialect == "anthropic":
            return anthropic_text(
                self.anthropic, full, stream, hang_up_after=2 if disconnect else None
            )
        return openai_text(self.openai, full, stream, hang_up_after=2 if disconnect else None)


def openai_text(
    client: openai.OpenAI,
    body: dict[str, Any],
    stream: bool,
    hang_up_after: int | None = None,
    headers: dict[str, str] | None = None,
) -> str:
    if not stream:
        reply = client.chat.completions.create(**body, extra_headers=headers)
        return reply.choices[0].message.content or ""
    parts: list[str] = []
    events = client.chat.completions.create(**body, stream=True, extra_headers=headers)
    try:
        for n, chunk in enumerate(events):
            if hang_up_after is not None and n >= hang_up_after:
                break
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
    finally:
        events.close()
    return "".join(parts)


def anthropic_text(
    client: anthropic.Anthropic,
    body: dict[str, Any],
    stream: bool,
    hang_up_after: int | None = None,
    headers: dict[str, str] | None = None,
) -> str:
    # This SDK has no sampling parameters any more; the proxy still reads them from the body.
    body = dict(body)
    extra = {k: body.pop(k) for k in ("temperature", "top_p", "top_k") if k in body}
    if not stream:
        reply = client.messages.create(**body, extra_headers=headers, extra_body=extra)
        return "".join(b.text for b in reply.content if b.type == "text")
    parts: list[str] = []
    events = client.messages.create(**body, stream=True, extra_headers=headers, extra_body=extra)
    try:
        for n, event in enumerate(events):
            if hang_up_after is not None and n >= hang_up_after:
                break
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                parts.append(event.delta.text)
    finally:
        events.close()
    return "".join(parts)


class Monitor:
    """Samples the server process's RSS and open descriptors on a thread."""

    def __init__(self, url: str, pid: int, tally: Tally, period: float = 0.5) -> None:
        self.url = url
        self.mlx = (0, 0, 0, 0)
        self.process = psutil.Process(pid)
        self.tally = tally
        self.period = period
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-monitor", daemon=True)
        self._t0 = time.monotonic()

    def sample(self) -> Sample:
        return Sample(
            t=round(time.monotonic() - self._t0, 2),
            rss=self.process.memory_info().rss,
            fds=self.process.num_fds(),
            done=self.tally.completed + len(self.tally.errors),
            mlx_active=self.mlx[0],
            mlx_cache=self.mlx[1],
            heap_in_use=self.mlx[2],
            heap_free=self.mlx[3],
        )

    def _poll_mlx(self) -> None:
        memory = httpx.get(self.url + "/v1/cache/stats", timeout=30).json()["memory"]
        self.mlx = (
            memory["mlx_active_bytes"],
            memory["mlx_cache_bytes"],
            memory.get("heap_in_use_bytes", 0),
            memory.get("heap_free_bytes", 0),
        )

    def _run(self) -> None:
        for n in itertools.count():
            if self._stop.wait(self.period):
                return
            if n % 10 == 0:
                self._poll_mlx()
            self.samples.append(self.sample())

    def __enter__(self) -> Monitor:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def warm_up(url: str) -> None:
    """One request per model and dialect, so lazily opened files are open before counting."""
    oa = openai.OpenAI(base_url=url + "/v1", api_key="soak", max_retries=0, timeout=300)
    an = anthropic.Anthropic(base_url=url, api_key="soak", max_retries=0, timeout=300)
    try:
        for model in MODELS:
            msgs = [{"role": "user", "content": "warm up"}]
            openai_text(oa, {"model": model, "max_tokens": 2, "messages": msgs}, stream=True)
            anthropic_text(an, {"model": model, "max_tokens": 2, "messages": msgs}, stream=True)
    finally:
        oa.close()
        an.close()


def settled_fds(monitor: Monitor, target: int, wait_s: float = 10.0) -> int:
    """Open descriptors once closed connections have been reaped (up to ``wait_s``)."""
    deadline = time.monotonic() + wait_s
    fds = monitor.sample().fds
    while fds != target and time.monotonic() < deadline:
        time.sleep(0.25)
        fds = monitor.sample().fds
    return fds


def replay(url: str, answers: list[Answer]) -> list[str]:
    """Each sampled answer against the same body with the cache bypassed; the mismatches."""
    oa = openai.OpenAI(base_url=url + "/v1", api_key="soak", max_retries=0, timeout=300)
    an = anthropic.Anthropic(base_url=url, api_key="soak", max_retries=0, timeout=300)
    mismatches = []
    try:
        for a in answers:
            send = anthropic_text if a.dialect == "anthropic" else openai_text
            fresh = send(an if a.dialect == "anthropic" else oa, a.body, a.stream, headers=BYPASS)
            if fresh != a.text:
                mismatches.append(f"{a.dialect} {a.body['model']}: cached {a.text!r} != {fresh!r}")
    finally:
        oa.close()
        an.close()
    return mismatches


def soak(url: str, pid: int, settings: Settings, progress=sys.stderr) -> dict[str, Any]:
    """Run the soak against a live server and return the figures (see ``evaluate``)."""
    warm_up(url)
    tally = Tally()
    systems = system_prompts(settings.seed)
    clients = [Client(i, url, settings, systems) for i in range(settings.clients)]
    counter = itertools.count()  # next() on a count is atomic under the GIL
    with Monitor(url, pid, tally) as monitor:
        time.sleep(1.0)
        start = monitor.sample()
        t0 = time.monotonic()
        threads = [
            threading.Thread(target=c.run, args=(counter, tally), name=f"soak-client-{c.index}")
            for c in clients
        ]
        for t in threads:
            t.start()
        printed = time.monotonic()
        # A progress line every 5 s; the wait ends as soon as the last client is done.
        while alive := [t for t in threads if t.is_alive()]:
            alive[0].join(max(0.0, printed + 5.0 - time.monotonic()))
            if time.monotonic() - printed < 5.0:
                continue
            printed = time.monotonic()
            last = monitor.samples[-1] if monitor.samples else start
            rate = tally.completed / max(time.monotonic() - t0, 1e-9)
            print(
                f"[soak] {tally.completed + len(tally.errors)}/{settings.requests} requests, "
                f"{rate:.1f}/s, rss {last.rss / 1e6:.0f} MB (mlx cache {last.mlx_cache / 1e6:.0f} MB), "
                f"fds {last.fds}, "
                f"errors {len(tally.errors)}",
                file=progress,
                flush=True,
            )
        elapsed = time.monotonic() - t0
        for c in clients:
            c.close()
        end_fds = settled_fds(monitor, start.fds)
    answers = [a for c in clients for a in c.answers]
    for error in tally.errors[:5]:
        print(f"[soak] error: {error}", file=progress)
    print(f"[soak] replaying {len(answers)} sampled answers with the cache bypassed", file=progress)
    mismatches = replay(url, answers)
    stats = httpx.get(url + "/v1/cache/stats", timeout=30).json()
    return evaluate(
        settings=asdict(settings),
        tally={k: getattr(tally, k) for k in Tally.__dataclass_fields__ if k != "lock"},
        elapsed_s=elapsed,
        samples=[start, *monitor.samples],
        start_fds=start.fds,
        end_fds=end_fds,
        compared=len(answers),
        mismatches=mismatches,
        stats=stats,
    )


class demo_server:
    """A proxy on the demo models in a scratch cache dir, upstream off, RAM tier small."""

    def __init__(self, ram_budget: int, ssd_max: int = SSD_MAX_BYTES) -> None:
        self.ram_budget = ram_budget
        self.ssd_max = ssd_max

    def __enter__(self):
        from engine_bridge.models.demo import ensure_demo_model
        from tests.conftest import start_server

        self._tmp = tempfile.TemporaryDirectory(prefix="mlx-soak-")
        root = Path(self._tmp.name)
        for name in MODELS:
            ensure_demo_model(name, root)
        env = {
            "MLX_PROMPT_CACHE_UPSTREAM_ENABLED": "false",
            "MLX_PROMPT_CACHE_CACHE_SSD_MAX_SIZE": str(self.ssd_max),
        }
        self.server = start_server(root, "--ram-budget", str(self.ram_budget), env=env)
        return self.server

    def __exit__(self, *exc) -> None:
        self.server.stop()
        self._tmp.cleanup()


def server_errors(log: str) -> list[str]:
    """ERROR and CRITICAL lines, and tracebacks, in the server's log."""
    return [
        line
        for line in log.splitlines()
        if " ERROR " in line or " CRITICAL " in line or line.startswith("Traceback")
    ]


def run(settings: Settings, out: Path | None = None) -> dict[str, Any]:
    with demo_server(settings.ram_budget, settings.ssd_max) as server:
        result = soak(server.url, server.proc.pid, settings)
        result["server_log_errors"] = server_errors(server.log())
        result["server_alive"] = server.proc.poll() is None
    result["passed"] = (
        result["passed"] and not result["server_log_errors"] and result["server_alive"]
    )
    if out is not None:
        write_report(result, out)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="soak", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=Settings.requests)
    parser.add_argument("--clients", type=int, default=Settings.clients)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--out", type=Path, help="write soak.json, soak.md (and soak.png)")
    args = parser.parse_args(argv)
    settings = Settings(requests=args.requests, clients=args.clients, seed=args.seed)
    result = run(settings, args.out)
    print(json.dumps(result["summary"], indent=2))
    for problem in result["problems"] + result["server_log_errors"]:
        print(f"FAIL: {problem}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
