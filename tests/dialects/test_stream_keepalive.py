"""Streams that start silent stay alive: while a long prompt's prefill holds back the first
token, each streaming dialect sends its own beat every `[server] stream_keepalive`, in a
form its clients parse and ignore, so their read and idle timeouts never fire.

A real server runs with each request's prefill slowed by a sleep on the MLX thread
(tests/support/slow_prefill/sitecustomize.py, on PYTHONPATH), the keepalive at 0.5 s, and
demo-hybrid's output forced, so the answers are known. Raw HTTP shows each dialect's beat;
the openai and anthropic SDKs, with a read timeout shorter than the slowed prefill, get the
whole answer; and the real Codex CLI, whose idle timer only a dispatched event resets,
finishes its turn through a prefill three times its `stream_idle_timeout_ms`.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from proxy.config.loader import load_config
from proxy.dialects.sse import keepalive
from proxy.wiring import proxy_settings
from tests.conftest import Server, fresh_cache_dir, start_server
from tests.support import clients

MODEL = "demo-hybrid"
SLOW_PREFILL_SITE = Path(__file__).resolve().parents[1] / "support" / "slow_prefill"
# Every wait below is a whole number of beats plus the same room as at a 1 s keepalive.
KEEPALIVE_S = 0.5
# Long enough for two beats at 0.5 s, with 0.5 s of room for the event loop to start the
# stream.
RAW_PREFILL_S = 1.5
# Time enough for one beat, not for the first token: the client has left before its
# prefill ends.
DISCONNECT_PREFILL_S = 1.0
# The SDKs' timeout (each read's, among others: a float sets every phase), a beat and 1 s
# of room, and a prefill twice past it.
SDK_READ_TIMEOUT_S = 1.5
SDK_PREFILL_S = 3.0
# Issue 33 saw Codex's 20 s idle timeout lose to a 60 s cold prefill; the same 1:3, smaller.
CODEX_IDLE_MS = 2000
CODEX_PREFILL_S = 6.0

CODEX = clients.codex()


def prompt(name: str) -> str:
    # A prompt of its own per request: a cached prompt would skip the (slowed) prefill.
    return f"Answer the keepalive check {name}."


def answer(name: str) -> str:
    return f"KEPT-ALIVE-{name.upper()}"


NAMES = ("chat", "legacy", "responses", "messages", "disconnect", "sdk-chat", "sdk-responses",
         "sdk-messages", "codex")  # fmt: skip


@dataclass
class SlowServer:
    server: Server
    delay_file: Path

    def slow_next_prefills(self, seconds: float) -> None:
        self.delay_file.write_text(str(seconds))

    @property
    def url(self) -> str:
        return self.server.url


@pytest.fixture(scope="module")
def slow(demo_root, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keepalive")
    entries = [(prompt(n), clients.forced_turn("Checking.", answer(n))) for n in NAMES]
    forced = clients.write_forced_outputs(tmp / "forced.json", entries)
    delay = tmp / "prefill-delay"
    env = {
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(SLOW_PREFILL_SITE), os.environ.get("PYTHONPATH")])
        ),
        "MPC_SLOW_PREFILL": str(delay),
        clients.FORCE_OUTPUT_ENV: str(forced),
        "MLX_PROMPT_CACHE_SERVER_STREAM_KEEPALIVE": str(KEEPALIVE_S),
    }
    cache_dir = fresh_cache_dir(demo_root, tmp / "cache")
    server = start_server(cache_dir, "--model", MODEL, "--upstream", "http://127.0.0.1:9", env=env)
    try:
        yield SlowServer(server, delay)
    finally:
        server.stop()
    log = server.log()
    # A stream that ended (or a client that left) left no task behind, nor an unread error.
    assert "Task was destroyed" not in log and "never retrieved" not in log, log[-4000:]


# --- raw HTTP: each dialect's beat ---------------------------------------------------------


def stream_lines(url: str, body: dict) -> list[str]:
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return list(r.iter_lines())


def data_of(lines: list[str]) -> list[dict]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def test_chat_completions_sends_comments_while_the_prefill_runs(slow):
    slow.slow_next_prefills(RAW_PREFILL_S)
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt("chat")}],
            "stream": True, "max_tokens": 64}  # fmt: skip
    lines = [x for x in stream_lines(slow.url + "/v1/chat/completions", body) if x]
    # The role chunk goes out at once, then nothing but comments until the first token.
    assert json.loads(lines[0][6:])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    first_token = next(i for i, x in enumerate(lines) if i and x.startswith("data: "))
    assert set(lines[1:first_token]) == {": keepalive"} and first_token - 1 >= 2, lines
    # No chunk without a choice (naive clients read choices[0]); the answer is whole.
    chunks = data_of(lines)
    assert all(len(c["choices"]) == 1 for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == answer("chat") and lines[-1] == "data: [DONE]"


def test_legacy_completions_send_comments_while_the_prefill_runs(slow):
    slow.slow_next_prefills(RAW_PREFILL_S)
    body = {"model": MODEL, "prompt": prompt("legacy"), "stream": True, "max_tokens": 64}
    lines = [x for x in stream_lines(slow.url + "/v1/completions", body) if x]
    first_data = next(i for i, x in enumerate(lines) if x.startswith("data: "))
    assert set(lines[:first_data]) == {": keepalive"} and first_data >= 2, lines
    chunks = data_of(lines)
    assert all(len(c["choices"]) == 1 for c in chunks)
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == clients.forced_turn("Checking.", answer("legacy"))


def test_responses_sends_in_progress_events_numbered_in_line(slow):
    slow.slow_next_prefills(RAW_PREFILL_S)
    body = {"model": MODEL, "input": prompt("responses"), "stream": True, "max_output_tokens": 64}
    lines = stream_lines(slow.url + "/v1/responses", body)
    names = [x[7:] for x in lines if x.startswith("event: ")]
    events = data_of(lines)
    assert names == [e["type"] for e in events]
    first_item = names.index("response.output_item.added")
    # response.created, its response.in_progress, then one per beat.
    assert names[0] == "response.created"
    assert set(names[1:first_item]) == {"response.in_progress"} and first_item - 2 >= 2, names
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    rid = events[0]["response"]["id"]
    beats = [e for e in events if e["type"] == "response.in_progress"]
    assert {(e["response"]["id"], e["response"]["status"]) for e in beats} == {(rid, "in_progress")}
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and final["id"] == rid
    assert final["output"][-1]["content"][0]["text"] == answer("responses")


def test_messages_sends_pings_while_the_prefill_runs(slow):
    slow.slow_next_prefills(RAW_PREFILL_S)
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt("messages")}],
            "stream": True, "max_tokens": 64}  # fmt: skip
    lines = stream_lines(slow.url + "/v1/messages", body)
    names = [x[7:] for x in lines if x.startswith("event: ")]
    first_block = names.index("content_block_start")
    # message_start and its ping, then one ping per beat.
    assert names[0] == "message_start"
    assert set(names[1:first_block]) == {"ping"} and first_block - 2 >= 2, names
    pings = [e for e in data_of(lines) if e["type"] == "ping"]
    assert all(p == {"type": "ping"} for p in pings)
    assert names[-1] == "message_stop"


def test_a_client_gone_during_the_silent_start_cancels_its_generation(slow):
    slow.slow_next_prefills(DISCONNECT_PREFILL_S)
    stats = slow.url + "/v1/cache/stats"
    before = httpx.get(stats, timeout=10).json()["requests"]["cancelled"]
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt("disconnect")}],
            "stream": True, "max_tokens": 64}  # fmt: skip
    with httpx.stream("POST", slow.url + "/v1/chat/completions", json=body, timeout=60) as r:
        next(x for x in r.iter_lines() if x == ": keepalive")
    # Leaving the block closed the connection: aiohttp cancels the handler, the keepalive
    # cancels its wait for the first part, and the engine drops the job before any token.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        requests = httpx.get(stats, timeout=10).json()["requests"]
        if requests["cancelled"] > before:
            break
        time.sleep(0.1)
    assert requests["cancelled"] == before + 1
    assert requests["last_cancelled_completion_tokens"] == 0


# --- the official SDKs: a read timeout shorter than the prefill ----------------------------


def test_openai_sdk_streams_chat_whole_through_a_prefill_past_its_read_timeout(slow):
    slow.slow_next_prefills(SDK_PREFILL_S)
    client = openai.OpenAI(base_url=slow.url + "/v1", api_key="test", max_retries=0,
                           timeout=SDK_READ_TIMEOUT_S)  # fmt: skip
    t0 = time.monotonic()
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt("sdk-chat")}],
        stream=True,
        max_tokens=64,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream)
    assert text == answer("sdk-chat")
    assert time.monotonic() - t0 > SDK_PREFILL_S  # the prefill was indeed slowed


def test_openai_sdk_streams_a_response_whole_through_a_prefill_past_its_read_timeout(slow):
    slow.slow_next_prefills(SDK_PREFILL_S)
    client = openai.OpenAI(base_url=slow.url + "/v1", api_key="test", max_retries=0,
                           timeout=SDK_READ_TIMEOUT_S)  # fmt: skip
    t0 = time.monotonic()
    with client.responses.stream(
        model=MODEL, input=prompt("sdk-responses"), max_output_tokens=64
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds.count("response.in_progress") >= 3  # its own, and the beats, all accepted
    assert final.status == "completed" and final.output_text == answer("sdk-responses")
    assert time.monotonic() - t0 > SDK_PREFILL_S


def test_anthropic_sdk_streams_a_message_whole_through_a_prefill_past_its_read_timeout(slow):
    slow.slow_next_prefills(SDK_PREFILL_S)
    client = anthropic.Anthropic(base_url=slow.url, api_key="test", max_retries=0,
                                 timeout=SDK_READ_TIMEOUT_S)  # fmt: skip
    t0 = time.monotonic()
    with client.messages.stream(
        model=MODEL,
        max_tokens=64,
        messages=[{"role": "user", "content": prompt("sdk-messages")}],
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == answer("sdk-messages")
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.stop_reason == "end_turn"
    assert time.monotonic() - t0 > SDK_PREFILL_S


# --- the real Codex CLI --------------------------------------------------------------------


@pytest.mark.skipif(CODEX.path is None, reason=CODEX.why_missing or "-")
def test_codex_finishes_its_turn_through_a_prefill_three_times_its_idle_timeout(slow, tmp_path):
    """Issue 33: Codex (`stream_idle_timeout_ms` 20 s) gave up on a 60 s cold prefill. Here
    the same ratio, smaller so the suite stays fast: a 2 s idle timeout and a 6 s sleep
    before the prefill of Codex's prompt (its own instructions swapped for one line, which
    leaves its tools: ~7k tokens). Codex resets its idle timer only when an SSE event is
    dispatched (a comment is none), so its beat is `response.in_progress`, which it ignores."""
    slow.slow_next_prefills(CODEX_PREFILL_S)
    instructions = tmp_path / "instructions.md"
    instructions.write_text("You are a coding agent. Answer briefly.\n")
    config = clients.codex_config(
        slow.url, MODEL, idle_timeout_ms=CODEX_IDLE_MS, instructions_file=instructions
    )
    cwd = tmp_path / "project"
    cwd.mkdir()
    run = clients.run_codex(
        CODEX,
        prompt("codex"),
        cwd=cwd,
        home=tmp_path / "home",
        base_url=slow.url,
        model=MODEL,
        timeout=180,
        config=config,
    )
    context = f"{run.describe()}\n--- server log (tail)\n{slow.server.log()[-4000:]}"
    assert run.returncode == 0, context
    errors = [e for e in run.events if e.get("type") in ("error", "turn.failed")]
    assert not errors, context
    messages = [
        e["item"]["text"]
        for e in run.events
        if e.get("type") == "item.completed" and e["item"].get("type") == "agent_message"
    ]
    assert messages == [answer("codex")], context
    assert run.seconds > CODEX_PREFILL_S, context


# --- the wrapper itself, and the setting ---------------------------------------------------


async def test_keepalive_beats_only_while_no_item_comes():
    gate = asyncio.Event()
    beats: list[float] = []

    async def items():
        await gate.wait()
        yield "a"
        yield "b"

    async def beat():
        beats.append(time.monotonic())
        if len(beats) == 3:
            gate.set()

    got = [x async for x in keepalive(items(), 0.02, beat)]
    assert got == ["a", "b"] and len(beats) == 3


async def test_a_consumer_that_stops_cancels_the_pending_wait_and_leaves_no_task():
    started, ended = asyncio.Event(), []
    beats = 0

    async def items():
        try:
            started.set()
            await asyncio.Event().wait()  # a prefill that never ends
            yield "never"
        finally:
            ended.append("closed")

    async def beat():
        nonlocal beats
        beats += 1

    async def consume():
        async for _ in keepalive(items(), 0.01, beat):
            pass

    consumer = asyncio.create_task(consume())
    await started.wait()
    while beats < 2:
        await asyncio.sleep(0.01)
    consumer.cancel()  # the client went away: aiohttp cancels the handler
    with pytest.raises(asyncio.CancelledError):
        await consumer
    assert ended == ["closed"]
    assert asyncio.all_tasks() == {asyncio.current_task()}


async def test_a_beat_that_fails_ends_the_stream_and_releases_the_generation():
    ended = []

    async def items():
        try:
            await asyncio.Event().wait()
            yield "never"
        finally:
            ended.append("closed")

    async def beat():
        raise ConnectionResetError("Cannot write to closing transport")

    with pytest.raises(ConnectionResetError):
        async for _ in keepalive(items(), 0.01, beat):
            pass
    assert ended == ["closed"]
    assert asyncio.all_tasks() == {asyncio.current_task()}


async def test_an_interval_of_zero_passes_items_through_without_a_task():
    async def items():
        assert len(asyncio.all_tasks()) == 1
        yield 1
        yield 2

    async def beat():
        raise AssertionError("no beat when the keepalive is off")

    assert [x async for x in keepalive(items(), 0, beat)] == [1, 2]


@pytest.mark.parametrize(
    "env,seconds", [({}, 10.0), ({"MLX_PROMPT_CACHE_SERVER_STREAM_KEEPALIVE": "1"}, 1.0),
                    ({"MLX_PROMPT_CACHE_SERVER_STREAM_KEEPALIVE": "2m"}, 120.0),
                    ({"MLX_PROMPT_CACHE_SERVER_STREAM_KEEPALIVE": "0"}, 0.0)],
)  # fmt: skip
def test_stream_keepalive_setting_reaches_the_proxy_settings(tmp_path, env, seconds):
    empty = tmp_path / "config.toml"
    empty.write_text("")
    assert proxy_settings(load_config(empty, env, {})).stream_keepalive_s == seconds
