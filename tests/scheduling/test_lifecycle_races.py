"""Races in a model's lifecycle end: two first loads making room for each other, an unload
while a request renders, and the MLX thread's loop when something escapes its handlers.

The loads run a real `Engine` on the demo models, with the machine simulated as in
test_memory_preflight.py; the loop's faults run a bare `Scheduler` over a fake model queue.
Every wait has a deadline, so a regression fails here instead of hanging the suite.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from engine_bridge.engine import Engine
from engine_bridge.models.loading import ModelRef
from engine_bridge.prompting.render import RenderedPrompt
from engine_bridge.scheduling.jobs import Failed, Job, Pending
from engine_bridge.scheduling.scheduler import Scheduler
from engine_bridge.types import EngineError, GenerationRequest

# The machine, the engine on the two demo models and the request the preflight tests use.
from tests.sessions.test_memory_preflight import GB, SimulatedMachine, _engine, _generate

LLAMA, HYBRID = "demo-llama", "demo-hybrid"
DEADLINE_S = 20.0


async def within(aw, what: str):
    """`aw`'s result, or a failure naming `what` once it passes the deadline. The task is
    cancelled, not awaited: a hung request may not end on one cancel."""
    task = asyncio.ensure_future(aw)
    done, _ = await asyncio.wait({task}, timeout=DEADLINE_S)
    if not done:
        task.cancel()
        pytest.fail(f"{what} hung for {DEADLINE_S:.0f} s")
    return task.result()


async def _lm_studio_unload(ref: ModelRef) -> None:
    """`before_load` as the proxy sets it: a call to LM Studio, during which the event loop
    runs other requests (here, the other first load)."""
    await asyncio.sleep(0)


def _both_first_loads(engine: Engine, sizes: dict[str, int]):
    engine.models.preflight.machine = SimulatedMachine(engine, 32 * GB, 6 * GB, sizes)
    engine.before_load = _lm_studio_unload
    both = asyncio.gather(
        _generate(engine, LLAMA), _generate(engine, HYBRID), return_exceptions=True
    )
    return within(both, "two first loads")


def test_two_first_loads_that_fit_neither_are_refused_not_deadlocked(demo_root, tmp_path):
    async def scenario():
        engine = _engine(demo_root, tmp_path)
        try:
            # 30 GB of weights each: less than the RAM, more than the 24.4 GB free, so each
            # load first tries to unload the other model for room.
            outcomes = await _both_first_loads(engine, {LLAMA: 30 * GB, HYBRID: 30 * GB})
            # Nothing is left stuck behind them: the idle janitor, a later request.
            janitor = await within(engine.models.unload_idle(0.0), "the idle janitor")
            later = asyncio.gather(_generate(engine, LLAMA), return_exceptions=True)
            return outcomes, janitor, (await within(later, "a later request"))[0]
        finally:
            await engine.close()

    (llama, hybrid), janitor, later = asyncio.run(scenario())
    for model, e in ((LLAMA, llama), (HYBRID, hybrid), (LLAMA, later)):
        assert isinstance(e, EngineError), e
        assert e.status == 503 and e.message.startswith(f"not enough memory to load {model}:")
    assert janitor == []


def test_two_first_loads_that_fit_one_at_a_time_load_one_and_refuse_the_other(demo_root, tmp_path):
    async def scenario():
        engine = _engine(demo_root, tmp_path)
        try:
            # 14 GB each: either fits the 24.4 GB free, both do not.
            outcomes = await _both_first_loads(engine, {LLAMA: 14 * GB, HYBRID: 14 * GB})
            loaded = [m for m in (LLAMA, HYBRID) if engine.models.loaded(m) is not None]
            janitor = await within(engine.models.unload_idle(0.0), "the idle janitor")
            return outcomes, loaded, janitor
        finally:
            await engine.close()

    outcomes, loaded, janitor = asyncio.run(scenario())
    # The second load's preflight saw the first model's weights: it was refused (the
    # first was busy, not idle) rather than both loading into swap.
    answered = [m for m, o in zip((LLAMA, HYBRID), outcomes, strict=True) if isinstance(o, str)]
    refused = [o for o in outcomes if isinstance(o, EngineError)]
    assert len(answered) == 1 and loaded == answered, outcomes
    assert len(refused) == 1 and refused[0].status == 503, outcomes
    assert "not enough memory to load" in refused[0].message
    assert janitor == answered  # once its request ended, nothing held it


def test_an_unload_while_a_request_renders_spares_its_model(demo_root, tmp_path, monkeypatch):
    release = threading.Event()

    async def scenario():
        engine = _engine(demo_root, tmp_path)
        try:
            await within(engine.load(LLAMA), "the load")
            loop, rendering = asyncio.get_running_loop(), asyncio.Event()
            prepare = engine.turns.prepare

            def held(loaded, req):  # on the tokenize thread, after runner() returned
                loop.call_soon_threadsafe(rendering.set)
                release.wait(DEADLINE_S)
                return prepare(loaded, req)

            monkeypatch.setattr(engine.turns, "prepare", held)
            request = asyncio.ensure_future(_generate(engine, LLAMA))
            await within(rendering.wait(), "the render")
            during = await within(engine.models.unload_idle(0.0), "the idle janitor")
            release.set()
            text = await within(request, "the request")
            after = await within(engine.models.unload_idle(0.0), "the idle janitor")
            return during, text, after
        finally:
            release.set()
            await engine.close()

    during, text, after = asyncio.run(scenario())
    assert during == []  # the request had found its runner: the model stays for it
    assert text  # and it ran
    assert after == [LLAMA]  # idle once it ended


# -- the MLX thread's loop, over a fake model queue ------------------------------------------


class FakeQueue:
    """One model's queue as the scheduler sees it; `step` and `live_bytes` call `fault`."""

    model_id, max_batch, active = "fake", 4, 0

    def __init__(self) -> None:
        self.waiting: list[Pending] = []
        self.running: list = []
        self.prefilling: list = []
        self.fault = None  # raises in step
        self.count_fault = None  # raises in live_bytes (the loop's own bookkeeping)
        self.hold = True  # keep what is waiting (work to step) until released

    @property
    def n_waiting(self) -> int:
        return len(self.waiting)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting)

    def live_bytes(self) -> int:
        if self.count_fault is not None:
            self.count_fault()
        return 0

    def enqueue(self, pending: Pending) -> None:
        self.waiting.append(pending)

    def step(self) -> bool:
        if self.fault is not None:
            self.fault()
        if self.hold:
            return False
        return self.fail_all(None) > 0

    def fail_all(self, error: BaseException | None) -> int:
        ended, self.waiting = self.waiting, []
        for p in ended:
            if error is not None:
                p.emit(Failed(error))
            p.emit(None)
        return len(ended)

    def cancel_all(self) -> None:
        self.hold = False


class Client:
    """A pending request's events, as the MLX thread emits them."""

    def __init__(self) -> None:
        self.events: list = []
        self.ended = threading.Event()
        req = GenerationRequest(model="fake", prompt="x", max_tokens=1)
        self.pending = Pending(Job(req, RenderedPrompt([1], "x"), 1), self.emit)

    def emit(self, event) -> None:
        self.events.append(event)
        if event is None:
            self.ended.set()


async def _waited(event: threading.Event, what: str) -> None:
    assert await within(asyncio.to_thread(event.wait, DEADLINE_S), what), f"no {what}"


def test_a_job_queued_to_a_runner_the_scheduler_dropped_is_refused():
    scheduler = Scheduler()
    queue = FakeQueue()
    try:
        with pytest.raises(EngineError) as refused:  # an unloaded model's, say
            scheduler.submit(queue, Client().pending)
        assert refused.value.status == 503 and refused.value.message == "fake was unloaded; retry"
        assert queue.waiting == []
    finally:
        scheduler.close()


@pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit, asyncio.CancelledError])
def test_a_stop_on_the_mlx_thread_ends_every_request_and_refuses_new_work(stop, caplog):
    caplog.set_level(logging.ERROR, logger="engine_bridge.scheduling.scheduler")
    scheduler = Scheduler()
    queue, client = FakeQueue(), Client()

    def fault() -> None:
        raise stop()

    async def scenario():
        scheduler.add(queue)
        scheduler.submit(queue, client.pending)
        await _waited(client.ended, "end of the request")
        await within(asyncio.to_thread(scheduler._thread.join, DEADLINE_S), "the thread")

    queue.fault = fault
    try:
        asyncio.run(scenario())
        assert not scheduler._thread.is_alive()  # stopped, not retrying
        failed, end = client.events
        message = f"the engine stopped: {stop.__name__} on the MLX thread"
        assert end is None and isinstance(failed.error, EngineError), failed.error
        assert failed.error.status == 503 and failed.error.message == message
        with pytest.raises(EngineError, match=message) as refused:
            scheduler.submit(queue, Client().pending)
        assert refused.value.status == 503
        with pytest.raises(RuntimeError, match=message):
            scheduler.call(print)
        stops = [r for r in caplog.records if r.name == "engine_bridge.scheduling.scheduler"]
        assert [r.getMessage() for r in stops] == [
            f"{queue.model_id}: scheduler step failed; ended its 1 requests",
            f"scheduler stopped by {stop()!r}; ending its requests",
        ]
    finally:
        scheduler.close()


def test_a_loop_failure_that_repeats_is_logged_at_doublings_and_backs_off(caplog):
    caplog.set_level(logging.ERROR, logger="engine_bridge.scheduling.scheduler")
    scheduler = Scheduler()
    queue, client = FakeQueue(), Client()
    failures, fifth = [], threading.Event()

    def broken_count() -> None:
        failures.append(time.monotonic())
        if len(failures) == 5:
            fifth.set()
        raise RuntimeError("injected fault: the counts broke")

    async def scenario():
        scheduler.add(queue)
        scheduler.submit(queue, client.pending)  # work to step, so every pass counts
        await _waited(fifth, "fifth failure")
        logged = [r.getMessage() for r in caplog.records]
        queue.count_fault, queue.hold = None, False  # fixed: the loop goes on
        await _waited(client.ended, "end of the request")
        return logged, await within(scheduler.run(lambda: 42), "a call")

    queue.count_fault = broken_count
    try:
        logged, answer = asyncio.run(scenario())
    finally:
        scheduler.close()
    assert logged == [f"scheduler loop failed ({n} times in a row)" for n in (1, 2, 4)]
    # Paused 0.05, 0.1, 0.2 then 0.4 s between them, not 0.05 s each.
    gaps = [b - a for a, b in zip(failures[:4], failures[1:5], strict=True)]
    assert all(g >= 0.95 * p for g, p in zip(gaps, (0.05, 0.1, 0.2, 0.4), strict=True)), gaps
    assert answer == 42 and client.events == [None]
