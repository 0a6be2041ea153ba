"""Upstream faults through the real proxy: each names its cause, and nothing is lost.

A real ``mlx_lm.server`` plays LM Studio behind a TCP front that misbehaves on cue (no
real server can be made to hang, babble or drop a stream when a test asks). The front
passes GETs through untouched, so the proxy's model lookup sees the real upstream; only
POSTs get the fault. After each fault the proxy still answers a local model exactly as
before it, and /health is 200.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import anthropic
import httpx
import openai
import pytest

from tests.conftest import Server, fresh_cache_dir, start_server
from tests.upstream.faulty_front import Fault, FaultyFront, data_before_cut, event_end
from tests.upstream.test_upstream_routing import _start_mlx_server

TIMEOUT_S = 2  # [upstream] timeout_s: short so a hang costs the test two seconds


# ---------------------------------------------------------------------------------------
# Fixtures: one real mlx_lm.server, the faulty front before it, one proxy before that


@dataclass
class Rig:
    proxy: Server
    front: FaultyFront
    upstream_model: str  # a model only the upstream has, so requests for it are forwarded
    local_answer: str  # what the proxy's own model answers before any fault


LOCAL = {
    "model": "demo-llama",
    "messages": [{"role": "user", "content": "count to three"}],
    "max_tokens": 6,
    "temperature": 0,
}


def _local_answer(proxy: Server) -> str:
    r = httpx.post(proxy.url + "/v1/chat/completions", json=LOCAL, timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers["x-prompt-cache-source"] in ("none", "ram", "ssd")
    return r.json()["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def rig_once(demo_root, tmp_path_factory) -> Iterator[Rig]:
    home = tmp_path_factory.mktemp("upstream-faults")
    upstream_proc, upstream_url = _start_mlx_server(demo_root / "models" / "demo-llama", home)
    front = FaultyFront(upstream_url)
    threading.Thread(target=front.serve_forever, daemon=True).start()
    proxy = None
    try:
        model = httpx.get(upstream_url + "/v1/models", timeout=30).json()["data"][0]["id"]
        # Load the model in the upstream now, so no test's first byte waits on it.
        warm = {**LOCAL, "model": model, "max_tokens": 2}
        assert httpx.post(upstream_url + "/v1/chat/completions", json=warm, timeout=120).is_success
        proxy = start_server(
            fresh_cache_dir(demo_root, home / "cache"),
            "--model",
            "demo-llama",
            "--upstream",
            front.url,
            env={"MLX_PROMPT_CACHE_UPSTREAM_TIMEOUT_S": str(TIMEOUT_S)},
        )
        yield Rig(proxy, front, model, _local_answer(proxy))
    finally:
        if proxy is not None:
            proxy.stop()
        front.reset()
        front.shutdown()
        front.server_close()
        upstream_proc.terminate()
        upstream_proc.wait(10)


@pytest.fixture
def rig(rig_once: Rig) -> Iterator[Rig]:
    rig_once.front.reset()
    yield rig_once
    rig_once.front.reset()


def nothing_lost(rig: Rig) -> None:
    """The proxy is healthy, its own model answers as it did before the fault, and once the
    upstream behaves again, requests reach it as before (no poisoned pooled connection)."""
    health = httpx.get(rig.proxy.url + "/health", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert _local_answer(rig.proxy) == rig.local_answer
    rig.front.reset()
    r = httpx.post(rig.proxy.url + "/v1/chat/completions", json=chat(rig), timeout=60)
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"
    assert "x-prompt-cache-source" not in r.headers  # the upstream answered, not us


def warnings_after(rig: Rig, mark: int) -> list[str]:
    return [line for line in rig.proxy.log()[mark:].splitlines() if " WARNING " in line]


def where(rig: Rig) -> str:
    return f"upstream LM Studio at {rig.front.url}"


def chat(rig: Rig, **extra) -> dict:
    return {**LOCAL, "model": rig.upstream_model, "max_tokens": 12, **extra}


# ---------------------------------------------------------------------------------------
# No usable response: 504 for a hang, 502 for garbage or a hang-up


def test_hung_upstream_is_504_naming_the_wait_and_the_setting_openai_shape(rig):
    rig.front.fault = Fault("hang")
    mark = len(rig.proxy.log())
    sdk = openai.OpenAI(base_url=rig.proxy.url + "/v1", api_key="x", max_retries=0, timeout=30)
    with pytest.raises(openai.InternalServerError) as err:
        sdk.chat.completions.create(**chat(rig))
    message = (
        f"{where(rig)} sent no response within {TIMEOUT_S} s; raise [upstream] timeout_s "
        "if it is only slow (a long prompt, a model still loading)"
    )
    assert err.value.status_code == 504
    assert err.value.body == {
        "message": message,
        "type": "upstream_timeout",
        "param": None,
        "code": "upstream_timeout",
    }
    (warning,) = warnings_after(rig, mark)
    assert warning.endswith(f"POST /v1/chat/completions: {message} (SocketTimeoutError)")
    nothing_lost(rig)


def test_hung_upstream_is_504_in_anthropic_shape_on_messages(rig):
    rig.front.fault = Fault("hang")
    sdk = anthropic.Anthropic(base_url=rig.proxy.url, api_key="x", max_retries=0, timeout=30)
    with pytest.raises(anthropic.APIStatusError) as err:
        sdk.messages.create(
            model=rig.upstream_model,
            max_tokens=8,
            messages=[{"role": "user", "content": "hi"}],
        )
    assert err.value.status_code == 504
    assert err.value.body == {
        "type": "error",
        "error": {
            "type": "timeout_error",
            "message": f"{where(rig)} sent no response within {TIMEOUT_S} s; raise [upstream] "
            "timeout_s if it is only slow (a long prompt, a model still loading)",
        },
    }
    nothing_lost(rig)


@pytest.mark.parametrize(
    "garbage, shown",
    [
        (b"hello\r\n\r\n", "b'hello'"),
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", "b'\\x16\\x03"),  # a TLS hello
    ],
)
def test_garbage_from_upstream_is_502_saying_it_was_not_http(rig, garbage, shown):
    rig.front.fault = Fault("reply", reply=garbage)
    mark = len(rig.proxy.log())
    r = httpx.post(rig.proxy.url + "/v1/embeddings", json={"model": "e", "input": "x"}, timeout=30)
    assert r.status_code == 502
    error = r.json()["error"]
    assert (error["type"], error["code"]) == ("upstream_error", "upstream_invalid_response")
    prefix = f"{where(rig)} sent an invalid HTTP response: Bad status line: "
    assert error["message"].startswith(prefix)
    assert shown in error["message"] and "\n" not in error["message"]
    (warning,) = warnings_after(rig, mark)
    assert prefix in warning
    nothing_lost(rig)


def test_upstream_hanging_up_without_answering_is_502(rig):
    rig.front.fault = Fault("reply", reply=b"")
    mark = len(rig.proxy.log())
    r = httpx.post(rig.proxy.url + "/v1/embeddings", json={"model": "e", "input": "x"}, timeout=30)
    assert r.status_code == 502
    assert r.json()["error"] == {
        "message": f"{where(rig)} closed the connection without answering",
        "type": "upstream_error",
        "param": None,
        "code": "upstream_closed",
    }
    (warning,) = warnings_after(rig, mark)
    assert f"{where(rig)} closed the connection without answering" in warning
    nothing_lost(rig)


# ---------------------------------------------------------------------------------------
# A stream that breaks off half way ends with the dialect's error event


def test_stream_cut_mid_event_ends_with_openai_error_chunk_and_done(rig):
    rig.front.fault = Fault("cut", events=3, extra=17)  # 17 bytes into the fourth event
    mark = len(rig.proxy.log())
    with httpx.stream(
        "POST", rig.proxy.url + "/v1/chat/completions", json=chat(rig, stream=True), timeout=30
    ) as r:
        assert r.status_code == 200
        body = r.read()  # a clean end: no truncated-body error
    whole_events = rig.front.full_body[: event_end(rig.front.full_body, 3)]
    assert len(rig.front.forwarded) == len(whole_events) + 17
    # The whole events arrive untouched, the unfinished fourth is held back (its cut-off
    # JSON would fail the client's parser), then the error chunk and [DONE].
    assert body.startswith(whole_events)
    error_line, done, end = body[len(whole_events) :].split(b"\n\n")
    assert (done, end) == (b"data: [DONE]", b"")
    message = (
        f"{where(rig)} dropped the stream after {len(rig.front.forwarded)} bytes: "
        "the connection closed before the stream's final event"
    )
    assert json.loads(error_line.removeprefix(b"data: ")) == {
        "error": {
            "message": message,
            "type": "upstream_error",
            "param": None,
            "code": "upstream_stream_dropped",
        }
    }
    (warning,) = warnings_after(rig, mark)
    assert warning.endswith(f"POST /v1/chat/completions: {message}")
    nothing_lost(rig)


def test_openai_sdk_raises_the_cause_when_the_stream_is_cut(rig):
    rig.front.fault = Fault("cut", events=4, extra=5)
    sdk = openai.OpenAI(base_url=rig.proxy.url + "/v1", api_key="x", max_retries=0, timeout=30)
    chunks = []
    with pytest.raises(openai.APIError) as err:
        for chunk in sdk.chat.completions.create(**chat(rig), stream=True):
            chunks.append(chunk)
    # Every whole event before the cut reached the client as it was.
    sent = data_before_cut(rig.front)
    assert len(chunks) == len(sent) >= 1
    assert [c.choices[0].delta.content for c in chunks] == [
        e["choices"][0]["delta"]["content"] for e in sent
    ]
    assert err.value.message == (
        f"{where(rig)} dropped the stream after {len(rig.front.forwarded)} bytes: "
        "the connection closed before the stream's final event"
    )
    assert err.value.code == "upstream_stream_dropped"
    nothing_lost(rig)


def test_stream_gone_silent_ends_after_timeout_with_the_setting_named(rig):
    rig.front.fault = Fault("stall", events=4, extra=9)
    sdk = openai.OpenAI(base_url=rig.proxy.url + "/v1", api_key="x", max_retries=0, timeout=30)
    texts = []
    with pytest.raises(openai.APIError) as err:
        stream = sdk.completions.create(
            model=rig.upstream_model, prompt="once upon", max_tokens=12, stream=True
        )
        for chunk in stream:
            texts.append(chunk.choices[0].text)
    assert texts == [e["choices"][0]["text"] for e in data_before_cut(rig.front)]
    assert texts
    assert err.value.message == (
        f"{where(rig)} dropped the stream after {len(rig.front.forwarded)} bytes: "
        f"no data for {TIMEOUT_S} s (raise [upstream] timeout_s if it is only slow)"
    )
    nothing_lost(rig)


def _anthropic_events_cut_short() -> bytes:
    """Two whole Anthropic events and half a third."""
    start = {
        "type": "message_start",
        "message": {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": "lmstudio-model",
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 3, "output_tokens": 0},
        },
    }
    block = {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    body = b"".join(
        f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in (start, block)
    )
    return body + b'event: content_block_delta\ndata: {"type": "content_block_delta", "ind'


def _chunked_without_its_last_chunk(body: bytes) -> bytes:
    """LM Studio's framing (chunked), from an upstream that dies before the final chunk."""
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    return head + f"{len(body):x}\r\n".encode() + body + b"\r\n"


def test_anthropic_stream_dropped_ends_with_error_event_the_sdk_raises(rig):
    sent = _anthropic_events_cut_short()
    rig.front.fault = Fault("reply", reply=_chunked_without_its_last_chunk(sent))
    mark = len(rig.proxy.log())
    sdk = anthropic.Anthropic(base_url=rig.proxy.url, api_key="x", max_retries=0, timeout=30)
    seen = []
    with pytest.raises(anthropic.APIStatusError) as err:
        stream = sdk.messages.create(
            model=rig.upstream_model,
            max_tokens=8,
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
        )
        for event in stream:
            seen.append(event.type)
    assert seen == ["message_start", "content_block_start"]
    error = err.value.body["error"]
    assert error["type"] == "api_error"
    prefix = (
        f"{where(rig)} dropped the stream after {len(sent)} bytes: "
        "the connection closed before the body was complete ("
    )
    assert error["message"].startswith(prefix)
    (warning,) = warnings_after(rig, mark)
    assert prefix in warning
    nothing_lost(rig)


def _responses_events(final: bool) -> bytes:
    """A Responses stream as LM Studio writes one: created, in progress, a message item,
    then response.completed when `final`, else half of a text delta."""
    response = {"id": "resp_upstream1", "object": "response", "status": "in_progress"}
    item = {"id": "msg_1", "type": "message", "role": "assistant", "content": []}
    events = [
        {"type": "response.created", "response": response},
        {"type": "response.in_progress", "response": response},
        {"type": "response.output_item.added", "output_index": 0, "item": item},
    ]
    if final:
        events.append(
            {"type": "response.completed", "response": {**response, "status": "completed"}}
        )
    body = b"".join(
        f"event: {e['type']}\ndata: {json.dumps({**e, 'sequence_number': i})}\n\n".encode()
        for i, e in enumerate(events)
    )
    return body if final else body + b'event: response.output_text.delta\ndata: {"type": "re'


def _responses_stream(rig: Rig) -> tuple[list, Exception | None]:
    """The events the openai SDK reads from the proxy, and what it raised, if anything."""
    sdk = openai.OpenAI(base_url=rig.proxy.url + "/v1", api_key="x", max_retries=0, timeout=30)
    seen = []
    try:
        for event in sdk.responses.create(model=rig.upstream_model, input="hi", stream=True):
            seen.append(event)
    except openai.APIError as e:
        return seen, e
    return seen, None


CLOSE_DELIMITED = b"HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"


@pytest.mark.parametrize("framing", ["chunked", "close-delimited"])
def test_responses_stream_dropped_ends_with_response_failed_naming_the_cause(rig, framing):
    sent = _responses_events(final=False)
    # LM Studio's chunked body raises in aiohttp when cut; an HTTP/1.0 body that ends early
    # looks whole, and only the missing response.completed tells them apart.
    cut = {
        "chunked": (_chunked_without_its_last_chunk(sent), "the connection closed before the body"),
        "close-delimited": (CLOSE_DELIMITED + sent, "the connection closed before the stream's"),
    }
    reply, cause = cut[framing]
    rig.front.fault = Fault("reply", reply=reply)
    mark = len(rig.proxy.log())
    seen, raised = _responses_stream(rig)
    assert raised is None
    assert [e.type for e in seen] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.failed",
    ]
    failed = seen[-1]
    assert failed.sequence_number == 3 and failed.response.id == "resp_upstream1"
    assert failed.response.status == "failed"
    assert failed.response.error.code == "upstream_stream_dropped"
    message = failed.response.error.message
    assert message.startswith(f"{where(rig)} dropped the stream after {len(sent)} bytes: {cause}")
    (warning,) = warnings_after(rig, mark)
    assert message in warning
    nothing_lost(rig)


def test_a_whole_close_delimited_responses_stream_passes_untouched(rig):
    rig.front.fault = Fault("reply", reply=CLOSE_DELIMITED + _responses_events(final=True))
    mark = len(rig.proxy.log())
    seen, raised = _responses_stream(rig)
    assert raised is None and seen[-1].type == "response.completed", seen
    assert [e.sequence_number for e in seen] == [0, 1, 2, 3]
    assert warnings_after(rig, mark) == []
    nothing_lost(rig)


def test_plain_body_cut_short_truncates_the_client_response(rig):
    # A JSON body has no in-band error: only a cut connection keeps it from looking whole.
    rig.front.fault = Fault("cut", events=0, extra=40)
    mark = len(rig.proxy.log())
    with pytest.raises(httpx.RemoteProtocolError):
        httpx.post(rig.proxy.url + "/v1/chat/completions", json=chat(rig), timeout=30)
    (warning,) = warnings_after(rig, mark)
    assert f"{where(rig)} failed after 40 bytes of the body: " in warning
    assert "cutting the client's connection" in warning
    nothing_lost(rig)
