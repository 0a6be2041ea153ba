"""The shared scenario (issue 14): proxy B's first turn on a prefix proxy A computed.

One redis-server for the run. Proxy A (its own cache folder) answers a long prompt cold
and sends its entries to Redis; A stops, and proxy B (another, empty cache folder) gets
the same prompt: its blocks come from Redis, not from a prefill. B then answers the same
prompt with `x-prompt-cache: bypass`, a cold prefill on the same machine. Done with Redis
on loopback, and through a relay that delays each direction (a LAN round trip), with the
bytes B moved and the time its promotions took from B's /v1/cache/stats.

Then the write policies' bandwidth: A runs a short chat under `all` and under
`second-use`, and the bytes each sent to Redis are set side by side.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .. import servers, traces
from ..harness import Harness, Settings, chars_per_token, stats
from ..results import Row, ScenarioResult, ratio
from ..servers import ModelSpec, Server
from .shared_redis import RedisServer
from .shared_relay import DelayRelay

# One-way delays the relay adds: loopback as it is, then a wired LAN's round trip.
NETWORKS = (("loopback", 0.0), ("LAN, +2 ms round trip", 0.001))


def shared(settings: Settings, model: ModelSpec) -> ScenarioResult:
    result = ScenarioResult("shared", model.id)
    prefix = settings.size(1500, 8000)
    trace = traces.chat_trace(settings.seed + 3, 3, prefix, chars_per_token(model))
    first = {"messages": trace.messages(0)}
    with tempfile.TemporaryDirectory() as tmp, Harness(settings, result, model) as h:
        redis = RedisServer(Path(tmp)).start()
        try:
            for i, (name, delay) in enumerate(NETWORKS):
                _first_turn_on_b(h, redis, name, delay, f"net{i}", first)
            for policy in ("all", "second-use"):
                _policy_bytes(h, redis, policy, trace)
        finally:
            redis.stop()
    _summarize(result)
    return result.finish()


def _first_turn_on_b(
    h: Harness, redis: RedisServer, name: str, delay: float, namespace: str, body: dict
) -> None:
    relay = DelayRelay(("127.0.0.1", redis.port), delay)
    try:
        with _proxy(h, "a", redis.url, namespace, "all") as a:
            sample = h.send(a, "openai", body, 0, f"A cold ({name})")
            h.progress(f"A computes the prefix ({name})", a, sample)
            _drain(a)
        with _proxy(h, "b", relay.url, namespace, "all") as b:
            before = stats(b).get("shared") or {}
            sample = h.send(b, "openai", body, 0, f"B from shared ({name})")
            h.progress(f"B's first turn ({name})", b, sample)
            after = stats(b).get("shared") or {}
            cold = h.send(b, "openai", body, 1, f"B cold ({name})", headers=_BYPASS)
            h.progress(f"B cold prefill ({name})", b, cold)
    finally:
        relay.close()
    m = h.result.metrics
    m[f"{name}: B ttft_s"] = sample.ttft_s
    m[f"{name}: B cold ttft_s"] = cold.ttft_s
    m[f"{name}: B cached_tokens"] = sample.cached_tokens
    m[f"{name}: B source"] = sample.source
    m[f"{name}: bytes moved"] = after.get("bytes_read", 0) - before.get("bytes_read", 0)
    m[f"{name}: promotions"] = after.get("promotions", 0) - before.get("promotions", 0)
    seconds = after.get("promotion_seconds_sum", 0.0) - before.get("promotion_seconds_sum", 0.0)
    m[f"{name}: promotion_ms"] = seconds * 1000
    m[f"{name}: output equals bypass"] = int(sample.output == cold.output)


def _policy_bytes(h: Harness, redis: RedisServer, policy: str, trace) -> None:
    """Bytes A sends to Redis over the trace's turns under `policy`."""
    with _proxy(h, f"policy-{policy}", redis.url, f"policy-{policy}", policy) as a:
        for t in range(len(trace.users)):
            sample = h.send(a, "openai", {"messages": trace.messages(t)}, t, f"{policy} turn")
            h.progress(f"{policy}: turn {t + 1}", a, sample)
        s = _drain(a)
    h.result.metrics[f"{policy}: bytes sent"] = s.get("bytes_written")
    h.result.metrics[f"{policy}: entries sent"] = s.get("writes")


_BYPASS = {"x-prompt-cache": "bypass"}


@contextmanager
def _proxy(h: Harness, name: str, url: str, namespace: str, policy: str) -> Iterator[Server]:
    """Our proxy on a fresh cache folder, pointed at Redis through `url`."""
    config = h.work / f"{name}-{namespace}.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(
        f'[cache.shared]\nurl = "{url}"\nnamespace = "{namespace}"\n'
        f'write_policy = "{policy}"\ntimeout = "5s"\n'
    )
    cache_dir = servers.fresh_cache_dir(h.work, name, h.model)
    args = (*h.settings.proxy_args, "--config", str(config))
    server = h.fleet.add(servers.start("ours", h.model, h.logs, cache_dir, name, args))
    try:
        h.warm(server, f"{name}-{namespace}")
        yield server
    finally:
        server.stop()
        h.fleet.servers.remove(server)


def _drain(server: Server, timeout_s: float = 120.0) -> dict:
    """Wait until the proxy has sent everything it queued for Redis; its shared stats."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = stats(server).get("shared") or {}
        if not s.get("queued") or time.monotonic() > deadline:
            return s
        time.sleep(0.1)


def _summarize(result: ScenarioResult) -> None:
    """Rows in the report's columns: ours = B served from Redis, nocache = B's cold
    prefill of the same prompt (x-prompt-cache: bypass, same process)."""
    m = result.metrics
    for name, _ in NETWORKS:
        shared_s, cold_s = m.get(f"{name}: B ttft_s"), m.get(f"{name}: B cold ttft_s")
        result.rows.append(
            Row(
                f"TTFT of B's first turn on a prefix A computed, Redis {name} (s)",
                {"ours": shared_s, "nocache": cold_s},
                {"cold / shared": ratio(cold_s, shared_s)},
                note="B never saw the prompt; nocache = B's cold prefill of it (bypass)",
            )
        )
    for name, _ in NETWORKS:
        result.rows.append(
            Row(
                f"bytes B read from Redis for it, {name}",
                {"ours": m.get(f"{name}: bytes moved")},
            )
        )
        result.rows.append(
            Row(
                f"time of B's promotions from Redis, {name} (ms)",
                {"ours": m.get(f"{name}: promotion_ms")},
                note="read round trips, one per run of entries, checksums included",
            )
        )
    sent = {p: m.get(f"{p}: bytes sent") for p in ("all", "second-use")}
    result.rows.append(Row("bytes A sent to Redis over a 3-turn chat, all", {"ours": sent["all"]}))
    result.rows.append(
        Row(
            "bytes A sent to Redis over a 3-turn chat, second-use",
            {"ours": sent["second-use"]},
            {"all / second-use": ratio(sent["all"], sent["second-use"])},
            note="second-use sends an entry when a later request reuses it",
        )
    )
