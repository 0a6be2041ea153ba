"""Tier I/O off the MLX thread (issue 33, item 4): a request whose lookup waits on a slow
tier costs only itself. A request decoding meanwhile keeps its pace; the waiting one, once
its tier's deadline passes, misses that tier and answers as the bypass does.

An in-process Engine on demo-llama. The faults sit below the code under test: a relay in
front of a real redis-server that stops answering (it accepts and never replies, as a
black-holed port does), and an SSD whose entry-file reads hang.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace

from bench.scenarios.shared_relay import DelayRelay
from engine_bridge.cache.shared.config import SharedConfig
from engine_bridge.cache.ssd import store as ssd_store
from engine_bridge.engine import Engine, EngineSettings
from engine_bridge.types import GenerationRequest, Message, Sampling, TokenEvent
from engine_bridge.warm_ahead import WarmAheadSettings
from tests.conftest import fresh_cache_dir
from tests.support.redis_helpers import redis_server_fixture  # noqa: F401 - a fixture

MODEL = "demo-llama"
# The request that decodes while the other looks up: long enough to outlast that lookup.
DECODE_TOKENS = 3000
# Decoded tokens before the other request is sent: the decoding one is in full flow.
WARM_EVENTS = 20
SSD_READ_S = 2.0  # how long each entry-file read hangs
SSD_STALL_S = 0.4  # the SSD phase's deadline in the test (default 2 s)
REDIS_TIMEOUT_S = 1.0  # [cache.shared] timeout: the shared phase's deadline


def request(content: str, max_tokens: int, *, use_cache: bool = True) -> GenerationRequest:
    return GenerationRequest(
        model=MODEL,
        messages=[Message.from_template({"role": "user", "content": content})],
        max_tokens=max_tokens,
        sampling=Sampling(temperature=0.0),
        use_cache=use_cache,
    )


DECODING = request("Tell a long story about a lighthouse keeper and the sea. " * 3, DECODE_TOKENS)
WAITING = request("Explain in detail how a tiered prompt cache finds a prefix. " * 12, 16)


@dataclass(slots=True)
class Race:
    """Token arrival times of the decoding request, and the waiting request's timeline."""

    times: list[float]
    sent: float  # the waiting request went to the engine
    admitted: float  # its lookup was done: `Engine.start` returned
    cached: int
    source: str
    text: str

    def gaps_while_waiting(self) -> list[float]:
        """Gaps between the decoding request's token events that overlap the wait (the
        one across the admission too: a lookup on the MLX thread ends there)."""
        pairs = zip(self.times, self.times[1:], strict=False)
        return [b - a for a, b in pairs if a < self.admitted and b > self.sent]


async def text_of(engine: Engine, req: GenerationRequest) -> str:
    stream = await engine.start(req)
    return "".join([e.text async for e in stream if isinstance(e, TokenEvent)])


async def race(engine: Engine, fault=lambda: None) -> Race:
    """DECODING streams; once it is in flow, `fault()`, then WAITING is sent and run to
    its end."""
    times: list[float] = []
    flowing = asyncio.Event()
    decoding = await engine.start(DECODING)

    async def consume() -> None:
        async for event in decoding:
            if isinstance(event, TokenEvent):
                times.append(time.perf_counter())
                if len(times) == WARM_EVENTS:
                    flowing.set()

    consumer = asyncio.create_task(consume())
    await flowing.wait()
    fault()
    sent = time.perf_counter()
    waiting = await engine.start(WAITING)
    admitted = time.perf_counter()
    text = "".join([e.text async for e in waiting if isinstance(e, TokenEvent)])
    assert not consumer.done(), "the decoding request ended before the other was admitted"
    consumer.cancel()
    await asyncio.gather(consumer, return_exceptions=True)
    await decoding.aclose()
    return Race(times, sent, admitted, waiting.cached_tokens, waiting.source, text)


def make_engine(cache_dir, **settings) -> Engine:
    return Engine(
        EngineSettings(
            cache_dir=cache_dir,
            model_specs=[MODEL],
            ram_budget_bytes=1 << 30,
            warm_ahead=WarmAheadSettings(enabled=False),
            **settings,
        )
    )


def assert_decoding_kept_its_pace(r: Race, stall_s: float) -> None:
    gaps = r.gaps_while_waiting()
    # Tokens kept coming while the other request waited, and none waited on its tier.
    assert len(gaps) >= 3, (len(gaps), r.admitted - r.sent)
    assert max(gaps) < 0.8 * stall_s, (max(gaps), stall_s)


def test_a_hung_ssd_read_costs_only_the_request_that_waits_for_it(demo_root, tmp_path, monkeypatch):
    engine = make_engine(fresh_cache_dir(demo_root, tmp_path / "cache"))
    runner = asyncio.Runner()
    try:
        bypass = runner.run(text_of(engine, replace(WAITING, use_cache=False)))
        runner.run(text_of(engine, WAITING))  # stored, and written through to the SSD
        assert engine.tiers.ssd.flush(30.0)
        runner.run(engine.scheduler.run(empty_ram, engine))
        probe = runner.run(engine.probe(WAITING))
        assert probe.ram_tokens == 0 and probe.ssd_tokens > 0, probe  # a hit on the SSD only

        real_read = ssd_store.read_file

        def hung_read(*args, **kwargs):
            time.sleep(SSD_READ_S)
            return real_read(*args, **kwargs)

        monkeypatch.setattr(ssd_store, "read_file", hung_read)
        engine.tiers.reads.ssd_stall_s = SSD_STALL_S
        r = runner.run(race(engine))
        assert_decoding_kept_its_pace(r, SSD_READ_S)
        # The waiting request went on at its deadline, not at the read's end: a miss on the
        # SSD, then a cold prefill that answers as the bypass does.
        assert r.admitted - r.sent < 0.8 * SSD_READ_S, r.admitted - r.sent
        assert r.source in ("none", "ram"), r.source  # RAM: the template's opening tokens
        assert r.text == bypass
        reads = engine.tiers.reads.stats()
        assert (reads.late_ssd, reads.late_shared) == (1, 0), reads
    finally:
        runner.run(engine.close())
        runner.close()


def test_a_redis_that_never_answers_costs_only_the_request_that_asks_it(
    demo_root, tmp_path, redis_server
):
    relay = DelayRelay(("127.0.0.1", redis_server.port), delay_s=0.0)
    shared = SharedConfig(relay.url, timeout_s=REDIS_TIMEOUT_S)
    engine = make_engine(fresh_cache_dir(demo_root, tmp_path / "cache"), shared=shared)
    runner = asyncio.Runner()
    try:
        bypass = runner.run(text_of(engine, replace(WAITING, use_cache=False)))
        assert engine.tiers.shared.stats().available
        # Once the decoding request is in flow, the relay holds every reply back far past
        # the timeout: the port accepts and answers nothing.
        r = runner.run(race(engine, fault=lambda: setattr(relay, "delay_s", 60.0)))
        assert_decoding_kept_its_pace(r, REDIS_TIMEOUT_S)
        assert r.admitted - r.sent >= 0.8 * REDIS_TIMEOUT_S, "the store was not asked"
        assert r.source in ("none", "ram"), r.source
        assert r.text == bypass
        reads, store = engine.tiers.reads.stats(), engine.tiers.shared.stats()
        # Whichever came first, the phase's deadline or the client's timeout, the store
        # was a miss for that request.
        assert reads.late_shared + store.errors["timeout"] >= 1, (reads, store.errors)
        assert reads.late_ssd == 0, reads
    finally:
        runner.run(engine.close())
        runner.close()
        relay.close()


def empty_ram(engine: Engine) -> None:
    """Evict every entry RAM holds (they are on the SSD), on the MLX thread."""
    ram = engine.tiers.ram
    budget = ram.budget_bytes
    ram.set_budget(0)
    ram.set_budget(budget)
    assert ram.stats().blocks == 0
