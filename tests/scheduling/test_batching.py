"""The scheduler: sequences decode as one batch, and each still gets its own answer.

In-process `Engine`s on the three demo models. What is checked is behaviour and order of
events (who started, who finished, what each produced), never a wall time.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import QuantizedKVCache, RotatingKVCache, make_prompt_cache

from engine_bridge import kv
from engine_bridge.engine import Engine, EngineSettings
from engine_bridge.models import loading as models
from engine_bridge.types import (
    EngineError,
    GenerationRequest,
    GenerationResult,
    Message,
    Sampling,
    TokenEvent,
)
from tests.conftest import DEMO_IDS, QWEN36, fresh_cache_dir

# float32 demo models: a row's logits inside a left-padded batch match its logits alone to
# within rounding. Measured: 0.0 on demo-llama and demo-hybrid, 3.8e-6 on demo-swa (its
# rotating window re-orders the padded rows), against logits of magnitude up to ~8.
MAX_LOGIT_DIFF = 1e-4
# And our user's model shape: its experts (SwitchGLU's gather_mm) route each row alone.
MODELS = (*DEMO_IDS, QWEN36)

PROMPTS = [
    "Tell me about the sea.",
    "A much longer question, about the mountains, the rivers that run from them, "
    "and the towns along those rivers, one after another, all the way to the coast.",
    "Hi",
    "Count to ten, slowly, and explain each number as you go.",
]


def _request(model: str, text: str, n: int = 12, **kw) -> GenerationRequest:
    sampling = kw.pop("sampling", Sampling(temperature=0.0))
    return GenerationRequest(
        model=model, messages=[Message("user", text)], max_tokens=n, sampling=sampling, **kw
    )


async def _collect(engine: Engine, req: GenerationRequest, log: list | None = None):
    stream = await engine.start(req)
    tokens = []
    async for event in stream:
        if isinstance(event, TokenEvent):
            tokens.append(event.token)
            if log is not None and len(tokens) == 1:
                log.append(("first", req.request_id))
    if log is not None:
        log.append(("done", req.request_id))
    assert stream.result is not None
    return tokens, stream.result


@pytest.fixture
def make_engine(demo_root: Path, tmp_path: Path):
    loop = asyncio.Runner()
    engines = []

    def make(**settings) -> tuple[asyncio.Runner, Engine]:
        cache_dir = fresh_cache_dir(demo_root, tmp_path / f"cache{len(engines)}")
        defaults = {"ssd_enabled": False, "model_specs": list(MODELS)}
        engine = Engine(EngineSettings(cache_dir=cache_dir, **(defaults | settings)))
        engines.append(engine)
        return loop, engine

    yield make
    for e in engines:
        loop.run(e.close())
    loop.close()


# --- kv.Batch: a row inside a batch computes what it computes alone -------------------------


@pytest.mark.parametrize("model_id", MODELS)
def test_batched_logits_match_alone_within_rounding(demo_root, model_id):
    model = models.load(models.resolve(model_id, demo_root, [])).model
    # Different lengths, so the batch left-pads; one is past demo-swa's sliding window.
    prompts = [list(range(5, 5 + n)) for n in (40, 300, 7)]

    def prefill(p: list[int]) -> list:
        cache = make_prompt_cache(model)
        model(mx.array(p[:-1])[None], cache=cache)
        mx.eval([c.state for c in cache])
        return cache

    steps = 6
    alone = []
    for p in prompts:
        batch = kv.Batch()
        batch.join(prefill(p))
        y, rows = p[-1], []
        for _ in range(steps):
            logits = model(mx.array([[y]]), cache=batch.cache)[0, -1]
            rows.append(logits)
            y = int(mx.argmax(logits).item())
        alone.append(rows)

    batch = kv.Batch()
    for p in prompts:
        batch.join(prefill(p))
    ys = [p[-1] for p in prompts]
    worst = 0.0
    for step in range(steps):
        logits = model(mx.array([[y] for y in ys]), cache=batch.cache)[:, -1]
        for i in range(len(prompts)):
            worst = max(worst, mx.max(mx.abs(logits[i] - alone[i][step])).item())
        ys = [int(mx.argmax(alone[i][step]).item()) for i in range(len(prompts))]
    assert worst <= MAX_LOGIT_DIFF, f"{model_id}: largest logit difference {worst}"

    # A row leaves, the rest go on unchanged; an extracted row is an ordinary cache.
    extracted = batch.extract(1)
    assert all(not isinstance(c, kv.Batch) for c in extracted)
    batch.keep([0, 2])
    assert batch.size == 2


def test_batch_blocker_names_what_cannot_batch():
    assert kv.batch_blocker([QuantizedKVCache(group_size=32, bits=8)]) is not None
    assert "keep" in kv.batch_blocker([RotatingKVCache(max_size=64, keep=4)])
    assert kv.batch_blocker([RotatingKVCache(max_size=64)]) is None


# --- the engine: batched greedy output equals each request alone ---------------------------


@pytest.mark.parametrize("model_id", MODELS)
def test_concurrent_greedy_output_equals_alone(make_engine, model_id):
    loop, engine = make_engine()
    alone = [loop.run(_collect(engine, _request(model_id, p))) for p in PROMPTS]

    async def together():
        return await asyncio.gather(*[_collect(engine, _request(model_id, p)) for p in PROMPTS])

    batched = loop.run(together())
    for (a, _), (b, result) in zip(alone, batched, strict=True):
        assert a == b
        assert result.finish_reason in ("length", "stop")
    stats = engine.stats()["scheduler"]
    assert stats["largest_batch"] >= 2, stats  # they really shared decode steps
    assert stats["decode_tokens"] > stats["decode_steps"]


@pytest.mark.parametrize("size", [1, 3, 8])
def test_qwen36_batches_of_one_to_eight_equal_each_request_alone(make_engine, size):
    """Experts in a batch: each row is routed to its own top-2 of 8, whatever its
    neighbours; the 248k-row head is read for each row."""
    loop, engine = make_engine(max_batch=8)
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} ({i})" for i in range(size)]
    alone = [loop.run(_collect(engine, _request(QWEN36, p, n=8))) for p in prompts]

    async def together():
        return await asyncio.gather(*[_collect(engine, _request(QWEN36, p, n=8)) for p in prompts])

    batched = loop.run(together())
    assert [t for t, _ in batched] == [t for t, _ in alone]
    stats = engine.stats()["scheduler"]
    assert stats["largest_batch"] >= min(size, 2), stats


def test_cached_output_equals_bypass_inside_a_batch(make_engine):
    """Turn 2 of three conversations at once, restored from the cache, equals bypass."""
    loop, engine = make_engine()
    model = "demo-hybrid"
    firsts = [loop.run(_collect(engine, _request(model, p, n=6))) for p in PROMPTS[:3]]

    def turn2(i: int, use_cache: bool) -> GenerationRequest:
        msgs = [
            Message("user", PROMPTS[i]),
            Message("assistant", f"answer {firsts[i][1].text}"),
            Message("user", "And then?"),
        ]
        return GenerationRequest(
            model=model,
            messages=msgs,
            max_tokens=10,
            sampling=Sampling(temperature=0.0),
            use_cache=use_cache,
        )

    bypass = [loop.run(_collect(engine, turn2(i, False)))[0] for i in range(3)]

    async def together():
        return await asyncio.gather(*[_collect(engine, turn2(i, True)) for i in range(3)])

    cached = loop.run(together())
    assert [t for t, _ in cached] == bypass
    assert all(r.cached_tokens > 0 for _, r in cached)


# --- cancel, sampling, fairness, admission --------------------------------------------------


def test_cancelling_one_member_frees_its_slot_and_leaves_the_others_unchanged(make_engine):
    loop, engine = make_engine()
    model = "demo-llama"
    alone = [loop.run(_collect(engine, _request(model, p, n=40)))[0] for p in PROMPTS[:2]]

    async def scenario():
        streams = [await engine.start(_request(model, p, n=40)) for p in PROMPTS[:3]]
        victim = streams[2]
        got = 0
        async for event in victim:
            got += isinstance(event, TokenEvent)
            if got == 3:
                break
        await victim.aclose()  # returns once the scheduler has let the sequence go
        runner = await engine.models.runner(model)
        # Cancels are reaped at the start of every step: the slot is free already.
        assert len(runner.running) + len(runner.prefilling) == 2
        assert runner.batch.size == 2
        outs = []
        for s in streams[:2]:
            tokens = [e.token async for e in s if isinstance(e, TokenEvent)]
            outs.append(tokens)
        return outs

    outs = loop.run(scenario())
    # Each survivor may have emitted some tokens before we started reading it: compare ends.
    for full, tail in zip(alone, outs, strict=True):
        assert full[len(full) - len(tail) :] == tail
    assert engine.requests.cancelled == 1
    assert engine.requests.last_cancelled_completion_tokens < 40


def test_a_seeded_request_is_deterministic_whatever_shares_its_batch(make_engine):
    loop, engine = make_engine()
    model = "demo-llama"
    seeded = Sampling(temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    alone, _ = loop.run(_collect(engine, _request(model, PROMPTS[0], n=24, sampling=seeded)))
    assert (
        alone == loop.run(_collect(engine, _request(model, PROMPTS[0], n=24, sampling=seeded)))[0]
    )

    async def crowded():
        others = [
            _request(model, PROMPTS[1], n=30, sampling=Sampling(temperature=1.0)),
            _request(model, PROMPTS[2], n=30, sampling=Sampling(temperature=0.0)),
            _request(model, PROMPTS[3], n=30, sampling=Sampling(temperature=0.7, min_p=0.1)),
        ]
        mine = _request(model, PROMPTS[0], n=24, sampling=seeded)
        results = await asyncio.gather(*[_collect(engine, r) for r in [*others, mine]])
        return results[-1][0]

    assert loop.run(crowded()) == alone


def test_per_request_parameters_inside_a_batch(make_engine):
    """max_tokens, stop strings and repetition penalty apply to their own row only."""
    loop, engine = make_engine()
    model = "demo-llama"
    plain, plain_result = loop.run(_collect(engine, _request(model, PROMPTS[0], n=30)))
    stop = plain_result.text[10:14]
    penalized_alone = loop.run(
        _collect(
            engine,
            _request(
                model, PROMPTS[3], n=20, sampling=Sampling(temperature=0, repetition_penalty=1.5)
            ),
        )
    )[0]

    async def together():
        return await asyncio.gather(
            _collect(engine, _request(model, PROMPTS[0], n=30, stop=[stop])),
            _collect(engine, _request(model, PROMPTS[1], n=5)),
            _collect(
                engine,
                _request(
                    model,
                    PROMPTS[3],
                    n=20,
                    sampling=Sampling(temperature=0, repetition_penalty=1.5),
                ),
            ),
        )

    (_, stopped), (short, short_result), (penalized, _) = loop.run(together())
    assert stopped.finish_reason == "stop_string" and stopped.stop_string == stop
    assert stopped.text == plain_result.text[: plain_result.text.index(stop)]
    assert short_result.completion_tokens == 5 and short_result.finish_reason == "length"
    assert penalized == penalized_alone


def test_sessions_take_turns_for_admission(make_engine):
    """One session's flood waits behind another session's single request."""
    loop, engine = make_engine(max_batch=1)
    model = "demo-llama"
    order: list = []

    async def scenario():
        loop_ = asyncio.get_running_loop()
        await engine.models.runner(model)
        flood = [
            _request(model, PROMPTS[i % 4], n=8, session="flood", request_id=f"a{i}")
            for i in range(4)
        ]
        tasks = [loop_.create_task(_collect(engine, r, order)) for r in flood]
        await asyncio.sleep(0)  # the flood is queued first
        other = _request(model, PROMPTS[2], n=8, session="other", request_id="b0")
        tasks.append(loop_.create_task(_collect(engine, other, order)))
        await asyncio.gather(*tasks)

    loop.run(scenario())
    done = [rid for what, rid in order if what == "done"]
    # a0 may already be running; b0 is next in line, not fifth.
    assert done.index("b0") <= 2, done


def test_a_short_request_decodes_during_a_long_cold_prefill(make_engine):
    loop, engine = make_engine(prefill_chunk=128)
    model = "demo-llama"
    order: list = []
    long_text = " ".join(f"word{i}" for i in range(900))

    async def scenario():
        loop_ = asyncio.get_running_loop()
        await engine.models.runner(model)
        long = loop_.create_task(
            _collect(engine, _request(model, long_text, n=4, request_id="long"), order)
        )
        while engine.scheduler.stats.prefill_tokens == 0:
            await asyncio.sleep(0.001)
        short = _request(model, "Hi", n=4, request_id="short")
        await _collect(engine, short, order)
        await long

    loop.run(scenario())
    assert order.index(("done", "short")) < order.index(("first", "long")), order


def test_a_full_queue_answers_429_with_retry_after(make_engine):
    loop, engine = make_engine(max_batch=1, max_queue=1)
    model = "demo-llama"

    async def scenario():
        await engine.models.runner(model)
        first = await engine.start(_request(model, PROMPTS[0], n=2000))
        second = asyncio.get_running_loop().create_task(
            engine.start(_request(model, PROMPTS[1], n=4))
        )
        await asyncio.sleep(0.05)
        with pytest.raises(EngineError) as refused:
            await engine.start(_request(model, PROMPTS[2], n=4))
        await first.aclose()
        await (await second).aclose()
        return refused.value

    err = loop.run(scenario())
    assert err.status == 429 and err.retry_after_s and err.retry_after_s >= 1
    assert engine.stats()["scheduler"]["rejected"] == 1


def test_admission_waits_for_memory_instead_of_overcommitting(make_engine):
    loop, engine = make_engine(kv_memory_bytes=1)
    model = "demo-llama"
    loop.run(_collect(engine, _request(model, PROMPTS[0], n=4)))  # learns bytes per token

    async def together():
        return await asyncio.gather(*[_collect(engine, _request(model, p, n=6)) for p in PROMPTS])

    results = loop.run(together())
    assert all(r.completion_tokens == 6 or r.finish_reason == "stop" for _, r in results)
    stats = engine.stats()["scheduler"]
    assert stats["largest_batch"] == 1 and stats["admission_waits"] > 0, stats


def test_a_model_whose_cache_cannot_batch_runs_one_at_a_time(make_engine, caplog, monkeypatch):
    """mlx-lm's batch rotating cache drops `keep`: such a model decodes one at a time."""
    loop, engine = make_engine()
    model = "demo-swa"
    load = models.load

    def keep_four(ref):
        loaded = load(ref)
        make = loaded.model.make_cache

        def with_keep():
            return [
                RotatingKVCache(max_size=c.max_size, keep=4)
                if isinstance(c, RotatingKVCache)
                else c
                for c in make()
            ]

        loaded.model.make_cache = with_keep
        return loaded

    monkeypatch.setattr(models, "load", keep_four)
    with caplog.at_level(logging.WARNING, logger="engine_bridge.scheduling.runner"):
        alone = [loop.run(_collect(engine, _request(model, p)))[0] for p in PROMPTS[:3]]

        async def together():
            return await asyncio.gather(
                *[_collect(engine, _request(model, p)) for p in PROMPTS[:3]]
            )

        outs = loop.run(together())
    assert [t for t, _ in outs] == alone
    assert engine.stats()["scheduler"]["largest_batch"] == 1
    assert any("one sequence at a time" in r.message for r in caplog.records)
    assert engine.model_info(model).max_batch == 1
    assert isinstance(outs[0][1], GenerationResult)


@pytest.mark.parametrize("model_id", ["demo-llama", "demo-hybrid"])
def test_sessions_that_start_together_compute_a_shared_prefix_once(make_engine, model_id):
    """Three conversations with one long system prompt, sent at once: the first computes
    it, the other two wait for it and restore it from the cache (and still equal bypass)."""
    loop, engine = make_engine(prefill_chunk=128)
    system = " ".join(f"rule{i}" for i in range(300))

    def req(i: int, use_cache: bool = True) -> GenerationRequest:
        return GenerationRequest(
            model=model_id,
            messages=[Message("system", system), Message("user", PROMPTS[i])],
            max_tokens=6,
            sampling=Sampling(temperature=0.0),
            use_cache=use_cache,
            session=f"s{i}",
        )

    async def together():
        await engine.models.runner(model_id)
        return await asyncio.gather(*[_collect(engine, req(i)) for i in range(3)])

    results = loop.run(together())
    cached = sorted(r.cached_tokens for _, r in results)
    shared = engine.scheduler.stats.prefill_tokens
    assert cached[0] == 0 and cached[1] > 500 and cached[2] > 500, cached
    # Prefilled once, plus each prompt's own end: far less than three whole prompts.
    assert shared < sum(r.prompt_tokens for _, r in results) - 1000, shared
    for i, (tokens, _) in enumerate(results):
        assert tokens == loop.run(_collect(engine, req(i, use_cache=False)))[0]


def test_long_prompts_prefill_in_admission_order_so_none_starves(make_engine):
    """A shorter long prompt admitted later does not overtake one already prefilling."""
    loop, engine = make_engine(prefill_chunk=128)
    model = "demo-llama"
    order: list = []
    first = " ".join(f"alpha{i}" for i in range(600))
    second = " ".join(f"beta{i}" for i in range(250))

    async def scenario():
        loop_ = asyncio.get_running_loop()
        await engine.models.runner(model)
        a = loop_.create_task(_collect(engine, _request(model, first, n=2, request_id="a"), order))
        while engine.scheduler.stats.prefill_tokens == 0:
            await asyncio.sleep(0.001)
        await _collect(engine, _request(model, second, n=2, request_id="b"), order)
        await a

    loop.run(scenario())
    assert order.index(("first", "a")) < order.index(("first", "b")), order
