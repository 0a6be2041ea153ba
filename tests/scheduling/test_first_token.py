"""The first token comes from the prefill's last chunk, not from a decode step after it.

A request's first token is its time to first token, and every model pass before it counts:
on a model split across ranks each pass waits on the links (tens of milliseconds apiece on
two ranks over loopback). So the last chunk runs to the prompt's very end and samples the
first token there; where a save point lies a few tokens before the end (Qwen3.6's
reasoning opener, a generation prompt's start), that chunk starts at it, one pass where
there were two and a decode step. Checked: the plan of chunk ends, the decode steps a
request takes (one fewer than its tokens), answers equal to a cache bypass on every cache
type, and the next turn still resumes where the prompt ended.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest

from engine_bridge.engine import Engine, EngineSettings
from engine_bridge.scheduling.sequence import LAST_CHUNK_MAX, prefill_plan
from engine_bridge.types import GenerationRequest, Message, Sampling, TokenEvent
from tests.conftest import DEMO_IDS, QWEN36, fresh_cache_dir


def test_the_last_chunk_runs_to_the_end_from_a_save_point_close_to_it():
    # A save point two tokens before the end (Qwen3.6's <think>) starts the last chunk.
    assert prefill_plan(0, 100, 512, [40, 98], sample=True) == ([40, 98, 100], 98)
    # None close to the end: the last chunk is the last token, as a decode step was.
    assert prefill_plan(0, 100, 512, [40], sample=True) == ([40, 99, 100], 99)
    far = 100 - LAST_CHUNK_MAX - 1
    assert prefill_plan(0, 100, 512, [far], sample=True) == ([far, 99, 100], 99)
    # The chunk grid and the cache's start still cut it; points behind the start do not.
    assert prefill_plan(30, 1100, 512, [20, 700, 1096], sample=True) == (
        [512, 700, 1024, 1096, 1100],
        1096,
    )
    # Restored up to the last token, or to the save point itself: one chunk to the end.
    assert prefill_plan(99, 100, 512, [98], sample=True) == ([100], 99)
    assert prefill_plan(98, 100, 512, [98], sample=True) == ([100], 98)
    # Without sampling (a warm-up, an MTP head, images): up to the last token, as before.
    assert prefill_plan(0, 100, 512, [40, 98], sample=False) == ([40, 98, 99], None)
    assert prefill_plan(99, 100, 512, [98], sample=False) == ([], None)


def _request(model: str, text: str, n: int, **kw) -> GenerationRequest:
    messages = [Message("system", "You answer briefly. " * 20), Message("user", text)]
    return GenerationRequest(model=model, messages=messages, max_tokens=n,
                             sampling=Sampling(temperature=0.0), **kw)  # fmt: skip


async def _run(engine: Engine, req: GenerationRequest):
    """The answer's text (an event may carry several tokens' text), and the result."""
    stream = await engine.start(req)
    text = "".join([e.text async for e in stream if isinstance(e, TokenEvent)])
    assert stream.result is not None
    return text, stream.result


@pytest.fixture(scope="module")
def engine(demo_root: Path, tmp_path_factory):
    loop = asyncio.Runner()
    cache_dir = fresh_cache_dir(demo_root, tmp_path_factory.mktemp("first-token"))
    e = Engine(EngineSettings(cache_dir=cache_dir, ssd_enabled=False,
                              model_specs=[*DEMO_IDS, QWEN36]))  # fmt: skip
    yield loop, e
    loop.run(e.close())
    loop.close()


@pytest.mark.parametrize("model", [*DEMO_IDS, QWEN36])
def test_a_request_takes_one_decode_step_fewer_than_its_tokens_and_answers_as_bypass(engine, model):
    loop, e = engine
    stats = e.scheduler.stats
    question = f"Where do rivers start? ({model})"
    bypass, _ = loop.run(_run(e, _request(model, question, 12, use_cache=False)))
    steps = stats.decode_steps
    cold, result = loop.run(_run(e, _request(model, question, 12)))
    assert stats.decode_steps - steps == result.completion_tokens - 1
    assert cold == bypass
    # The same question again resumes near its end and answers the same.
    again, result = loop.run(_run(e, _request(model, question, 12)))
    assert again == bypass and result.cached_tokens >= result.prompt_tokens - LAST_CHUNK_MAX
    # One token: the prefill alone writes it, and it begins the longer answer.
    steps = stats.decode_steps
    one, result = loop.run(_run(e, _request(model, question, 1)))
    assert stats.decode_steps == steps and result.completion_tokens == 1
    assert bypass.startswith(one)


@pytest.mark.parametrize("model", ["demo-hybrid", QWEN36])
def test_the_next_turn_resumes_where_the_prompt_or_the_answer_ended(engine, model):
    """The prompt's end is saved where the last chunk started: a snapshot model's next
    turn resumes at the end of the answer, or at worst there, never further back."""
    loop, e = engine
    first = _request(model, f"Name a river. ({model})", 8)
    _, r1 = loop.run(_run(e, first))
    later = GenerationRequest(
        model=model,
        messages=[*first.messages, Message("assistant", "The Rhine."),
                  Message("user", "And another?")],
        max_tokens=4,
        sampling=Sampling(temperature=0.0),
    )  # fmt: skip
    out, r2 = loop.run(_run(e, later))
    assert r2.cached_tokens >= r1.prompt_tokens - LAST_CHUNK_MAX
    bypass, _ = loop.run(_run(e, replace(later, use_cache=False)))
    assert out == bypass


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip


@pytest.mark.parametrize("model", ["demo-hybrid", QWEN36])
def test_a_tool_round_saves_no_point_where_its_result_starts_and_an_edit_still_resumes(
    engine, model
):
    """A tool result follows the call that asked for it, whose turn left a save point just
    before (its message start or that turn's prompt end): one at the result's start would
    cost a prefill pass of its own, before the first token, on every tool round."""
    from engine_bridge.prompting.render import render_chat
    from engine_bridge.scheduling.sequence import prefill_plan
    from engine_bridge.types import ToolCall

    loop, e = engine
    call = Message("assistant", "", tool_calls=(ToolCall("get_weather", {"city": "Porto"}),))
    asked = [Message("system", "You answer briefly. " * 20),
             Message("user", f"Weather in Porto? ({model})")]  # fmt: skip
    first = GenerationRequest(model=model, messages=asked, tools=[WEATHER], max_tokens=4,
                              sampling=Sampling(temperature=0.0))  # fmt: skip
    _, r1 = loop.run(_run(e, first))
    round_ = replace(first, messages=[*asked, call, Message("tool", "17C", tool_call_id="a")])
    tokenizer = e.models.table.get(model).runner.loaded.tokenizer
    rendered = render_chat(tokenizer, round_.messages, [WEATHER])
    (tool_start,) = rendered.tool_starts
    assert tool_start in rendered.message_starts and tool_start not in rendered.resume_points
    assert rendered.message_starts[1] in rendered.resume_points  # the call's own start stays
    out, r2 = loop.run(_run(e, round_))
    assert r2.cached_tokens >= r1.prompt_tokens - LAST_CHUNK_MAX
    # From where it resumed, the prefill stops only where the last chunk starts.
    ends, _ = prefill_plan(r2.cached_tokens, r2.prompt_tokens, 512, rendered.resume_points,
                           sample=True)  # fmt: skip
    assert len(ends) <= 2, ends
    assert out == loop.run(_run(e, replace(round_, use_cache=False)))[0]
    # The client edits the result: it resumes no earlier than the call's turn left it.
    edited = replace(round_, messages=[*round_.messages[:-1], Message("tool", "18C",
                                                                      tool_call_id="a")])  # fmt: skip
    out, r3 = loop.run(_run(e, edited))
    assert r3.cached_tokens >= r1.prompt_tokens - LAST_CHUNK_MAX
    assert out == loop.run(_run(e, replace(edited, use_cache=False)))[0]
