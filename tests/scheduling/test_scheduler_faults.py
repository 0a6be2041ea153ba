"""A model whose step raises past the runner's own handlers: its requests end with the
error instead of hanging while the loop retries, and other models keep serving.

A real `Engine` on the demo models; the fault is one runner's `_decode` raising from its
third call on, so the stream has started (mid-stream error) when it fires.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from engine_bridge.engine import Engine, EngineSettings
from engine_bridge.scheduling.runner import Runner
from engine_bridge.types import GenerationFailed, GenerationRequest, Message, Sampling, TokenEvent
from tests.conftest import fresh_cache_dir

BROKEN, OTHER = "demo-llama", "demo-hybrid"


def _request(model: str, n: int) -> GenerationRequest:
    return GenerationRequest(
        model=model,
        messages=[Message("user", "Tell me about the sea.")],
        max_tokens=n,
        sampling=Sampling(temperature=0.0),
    )


async def _tokens(engine: Engine, req: GenerationRequest) -> list[int]:
    stream = await engine.start(req)
    return [e.token async for e in stream if isinstance(e, TokenEvent)]


def break_decode(runner: Runner, after: int) -> list[int]:
    """Make `runner`'s decode raise from call `after` on; returns the call counter."""
    calls = [0]
    real = runner._decode

    def decode() -> bool:
        calls[0] += 1
        if calls[0] > after:
            raise RuntimeError("injected fault: the decode step broke")
        return real()

    runner._decode = decode  # type: ignore[method-assign]
    return calls


@pytest.fixture
def engine(demo_root, tmp_path):
    loop = asyncio.Runner()
    e = Engine(
        EngineSettings(
            cache_dir=fresh_cache_dir(demo_root, tmp_path / "cache"),
            model_specs=[BROKEN, OTHER],
            ssd_enabled=False,
        )
    )
    yield loop, e
    loop.run(e.close())
    loop.close()


def test_a_step_that_always_raises_fails_its_requests_once_and_others_go_on(engine, caplog):
    loop, e = engine

    async def scenario():
        broken = await e.models.runner(BROKEN)
        await e.models.runner(OTHER)
        calls = break_decode(broken, after=2)
        other = asyncio.create_task(_tokens(e, _request(OTHER, 40)))
        stream = await e.start(_request(BROKEN, 40))
        got = []
        with pytest.raises(GenerationFailed, match="injected fault") as failed:
            async with asyncio.timeout(30):  # before the fix: hangs, the log floods
                async for event in stream:
                    got.append(event)
        # The other model's request ran on through the fault.
        other_tokens = await asyncio.wait_for(other, 60)
        await asyncio.sleep(0.3)  # a retrying loop would log again meanwhile
        failed_calls = calls[0]
        del broken._decode  # the fault is gone: the model serves again
        again = await asyncio.wait_for(_tokens(e, _request(BROKEN, 5)), 60)
        left = (broken.running, broken.prefilling, broken.n_waiting, broken.batch.size)
        return got, failed.value, other_tokens, failed_calls, again, left

    with caplog.at_level(logging.ERROR, logger="engine_bridge.scheduling.scheduler"):
        got, error, other_tokens, failed_calls, again, left = loop.run(scenario())
    assert any(isinstance(ev, TokenEvent) for ev in got), "the stream had started"
    assert isinstance(error.__cause__, RuntimeError)
    assert failed_calls == 3  # two good steps, one failing step, never retried
    failures = [r for r in caplog.records if "scheduler step failed" in r.getMessage()]
    assert len(failures) == 1, [r.getMessage() for r in caplog.records]
    assert failures[0].getMessage() == f"{BROKEN}: scheduler step failed; ended its 1 requests"
    assert failures[0].exc_info is not None and "injected fault" in str(failures[0].exc_info[1])
    assert other_tokens and again
    assert left == ([], [], 0, 0)


def test_a_failing_step_ends_the_waiting_requests_of_that_model_too(engine, caplog):
    """With one batch slot, a second request waits; the failure ends it as well."""
    loop, e = engine

    async def scenario():
        broken = await e.models.runner(BROKEN)
        broken.max_batch = 1
        break_decode(broken, after=2)
        first = asyncio.create_task(_tokens(e, _request(BROKEN, 40)))
        second = asyncio.create_task(_tokens(e, _request(BROKEN, 40)))
        done = await asyncio.wait_for(asyncio.gather(first, second, return_exceptions=True), 30)
        return done

    with caplog.at_level(logging.ERROR, logger="engine_bridge.scheduling.scheduler"):
        first, second = loop.run(scenario())
    assert isinstance(first, GenerationFailed) and "injected fault" in str(first)
    assert isinstance(second, GenerationFailed) and "injected fault" in str(second)
    failures = [r.getMessage() for r in caplog.records if "step failed" in r.getMessage()]
    assert failures == [f"{BROKEN}: scheduler step failed; ended its 2 requests"], failures
