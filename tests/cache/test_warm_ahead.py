"""Warming ahead: while the machine is idle after an answer, the prefix the next question
will have is prefilled, for templates that drop earlier reasoning once a question comes.

demo-hybrid's template (Qwen3.5's convention: reasoning kept only after the last user
message) rewrites the task's turns at every new question, and its Gated DeltaNet layers
resume only at checkpoints: the case where a lost prefix costs the most. The answers with
the cache must equal those without it; a request that comes while a warm-up runs must
stop it at the next step and lose nothing.
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.conftest import WARM_AHEAD_ON, fresh_cache_dir, start_server
from tests.support.prose import prose

MODEL = "demo-hybrid"
TOOL = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
    },
}
CALL = {"id": "call_1", "type": "function"}
CALL["function"] = {"name": "read_file", "arguments": '{"path": "notes.txt"}'}
# [cache.warm_ahead] after_idle: a warm-up starts after 0.2 s with no request, not the
# default second a person reads for; the tests wait for it either way.
WARM_AFTER_IDLE = {"MLX_PROMPT_CACHE_CACHE_WARM_AHEAD_AFTER_IDLE": "0.2"}


@pytest.fixture(scope="module")
def warm_server(demo_root, tmp_path_factory):
    cache_dir = fresh_cache_dir(demo_root, tmp_path_factory.mktemp("warm-ahead"))
    server = start_server(
        cache_dir,
        "--model",
        MODEL,
        "--upstream",
        "http://127.0.0.1:9",
        env={**WARM_AHEAD_ON, **WARM_AFTER_IDLE},
    )
    yield server
    server.stop()


def _client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)


def _warm_stats(server) -> dict:
    return httpx.get(server.url + "/v1/cache/stats", timeout=30).json()["warm_ahead"]


def _settled(server, warmed: int, deadline_s: float = 120.0) -> dict:
    """The warm-ahead stats once `warmed` warm-ups are done and nothing waits."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        stats = _warm_stats(server)
        if stats["warmed"] >= warmed and stats["pending"] == 0:
            return stats
        time.sleep(0.1)
    raise AssertionError(f"warming ahead did not settle: {_warm_stats(server)}")


def _ask(client, messages, session, *, bypass=False, max_tokens=8):
    headers = {"x-session-id": session}
    if bypass:
        headers["x-prompt-cache"] = "bypass"
    r = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[TOOL],
        max_tokens=max_tokens,
        temperature=0.0,
        extra_headers=headers,
    )
    m = r.choices[0].message
    back = {"role": "assistant", "content": m.content or ""}
    if getattr(m, "reasoning_content", None):
        back["reasoning_content"] = m.reasoning_content
    return back, r.usage


def _task(system_sentences: int, question: str, result_sentences: int) -> list[dict]:
    """A question answered with one call: the turn the next question's render rewrites."""
    return [
        {"role": "system", "content": prose(system_sentences)},
        {"role": "user", "content": question},
        {"role": "assistant", "content": "", "reasoning_content": "Read.", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": prose(result_sentences)},
    ]


def test_the_next_question_hits_its_warmed_prefix_and_answers_as_without_the_cache(
    warm_server,
):
    client = _client(warm_server)
    before = _warm_stats(warm_server)
    task = _task(40, "Which service writes the ledger?", 30)
    answer, _ = _ask(client, task, "s-hit")
    _settled(warm_server, before["warmed"] + 1)
    follow = [*task, answer, {"role": "user", "content": "And who reads it?"}]
    cached, usage = _ask(client, follow, "s-hit", max_tokens=16)
    plain, _ = _ask(client, follow, "s-hit-bypass", bypass=True, max_tokens=16)
    assert cached == plain
    hit = usage.prompt_tokens_details.cached_tokens
    # Everything but the question's own text and the generation prompt.
    assert usage.prompt_tokens - hit <= 20, (usage.prompt_tokens, hit)
    after = _warm_stats(warm_server)
    assert after["tokens"] > before["tokens"]
    assert after["failed"] == before["failed"] == 0


def test_a_request_preempts_a_warm_up_and_the_warm_up_finishes_later(warm_server):
    client = _client(warm_server)
    before = _warm_stats(warm_server)
    # The long tool result is prefilled again by the warm-up (the call's turn loses its
    # reasoning at the next question): several scheduler steps.
    task = _task(10, "Summarize the notes.", 250)
    answer, _ = _ask(client, task, "s-preempt")
    end = time.monotonic() + 60
    while not _warm_stats(warm_server)["running"]:
        assert time.monotonic() < end, _warm_stats(warm_server)
        time.sleep(0.005)
    other = [{"role": "user", "content": "Something else entirely."}]
    during, _ = _ask(client, other, "s-other")
    stats = _settled(warm_server, before["warmed"] + 1)
    assert stats["preempted"] >= before["preempted"] + 1
    plain, _ = _ask(client, other, "s-other-bypass", bypass=True)
    assert during == plain
    # The resumed warm-up reached the end: the next question hits all of it.
    follow = [*task, answer, {"role": "user", "content": "Shorter, please."}]
    _, usage = _ask(client, follow, "s-preempt")
    assert usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens <= 20


def test_warming_ahead_is_off_with_its_switch(server):
    """The suite's shared server runs with [cache.warm_ahead] enabled = false."""
    stats = httpx.get(server.url + "/v1/cache/stats", timeout=30).json()["warm_ahead"]
    assert stats["enabled"] is False and stats["offered"] == 0


def test_dropped_reasoning_is_put_back_for_cached_and_bypassed_requests_alike(warm_server):
    """A client that drops `reasoning_content` gets its turn rendered as the model wrote it,
    and `x-prompt-cache: bypass` sees that same prompt: the answers stay comparable."""
    client = _client(warm_server)

    def restored() -> int:
        stats = httpx.get(warm_server.url + "/v1/cache/stats", timeout=30).json()
        return stats["reasoning_memo"]["restored"]

    before = restored()
    task = [
        {"role": "system", "content": prose(12)},
        {"role": "user", "content": "Which queue waits?"},
    ]
    first = client.chat.completions.create(
        model=MODEL, messages=task, max_tokens=12, temperature=0.0,
        extra_headers={"x-session-id": "s-dropped"},
    )  # fmt: skip
    m = first.choices[0].message
    assert getattr(m, "reasoning_content", None), "demo-hybrid opens <think>: it reasons"
    follow = [*task, {"role": "assistant", "content": m.content or ""}]
    follow.append({"role": "user", "content": "Say more."})
    answers = []
    for bypass in (False, True):
        headers = {"x-session-id": "s-dropped"} | ({"x-prompt-cache": "bypass"} if bypass else {})
        r = client.chat.completions.create(
            model=MODEL, messages=follow, max_tokens=12, temperature=0.0, extra_headers=headers
        )
        answers.append((r.choices[0].message.content, r.usage.prompt_tokens))
    assert answers[0] == answers[1]
    assert restored() == before + 2
