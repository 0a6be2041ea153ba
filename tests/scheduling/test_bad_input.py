"""Every malformed request gets a 4xx in its dialect's shape naming the problem, never a 500."""

from __future__ import annotations

import httpx
import pytest

OK_CHAT = {"model": "demo-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
OK_MSG = {"model": "demo-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

# (route, raw body or JSON, expected status, words the message must contain)
CASES = [
    ("/v1/chat/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/chat/completions", b"[1, 2]", 400, "JSON object"),
    ("/v1/chat/completions", b"", 400, "empty"),
    ("/v1/chat/completions", b'{"model": "demo-llama", "messages": "\xff\xfe"}', 400, "UTF-8"),
    ("/v1/chat/completions", {"model": "demo-llama"}, 400, "messages"),
    ("/v1/chat/completions", {**OK_CHAT, "messages": []}, 400, "messages"),
    (
        "/v1/chat/completions",
        {**OK_CHAT, "messages": [{"role": "wizard", "content": "x"}]},
        400,
        "role",
    ),
    ("/v1/chat/completions", {**OK_CHAT, "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/chat/completions", {**OK_CHAT, "temperature": -1}, 400, "temperature"),
    ("/v1/chat/completions", {**OK_CHAT, "top_p": "high"}, 400, "top_p"),
    ("/v1/chat/completions", {**OK_CHAT, "stop": 5}, 400, "stop"),
    ("/v1/chat/completions", {**OK_CHAT, "model": "no-such-model"}, 404, "no-such-model"),
    ("/v1/chat/completions", {**OK_CHAT, "model": 7}, 400, "model"),
    ("/v1/chat/completions", {**OK_CHAT, "max_tokens": 10_000_000}, 400, "max_tokens"),
    (
        "/v1/chat/completions",
        {**OK_CHAT, "messages": [{"role": "user", "content": "word " * 40000}]},
        400,
        "context",
    ),
    (
        "/v1/chat/completions",
        {**OK_CHAT, "messages": [{"role": "user", "content": 5}]},
        400,
        "content",
    ),
    ("/v1/completions", {"model": "demo-llama", "prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"model": "demo-llama", "prompt": []}, 400, "prompt: the token array"),
    ("/v1/completions", {"model": "demo-llama", "prompt": [[]]}, 400, "prompt: the token array"),
    ("/v1/completions", {"model": "demo-llama", "prompt": [3, -1]}, 400, "prompt[1]"),
    ("/v1/completions", {"model": "demo-llama", "prompt": [1.5]}, 400, "prompt[0]"),
    ("/v1/completions", {"model": "demo-llama", "prompt": [True]}, 400, "prompt[0]"),
    ("/v1/completions", {"model": "demo-llama", "prompt": ["a", "b"]}, 400, "one prompt"),
    ("/v1/completions", {"model": "demo-llama", "prompt": "x", "user": 5}, 400, "user"),
    ("/v1/chat/completions", {**OK_CHAT, "user": ["u"]}, 400, "user: expected a string"),
    ("/v1/messages", b"{not json", 400, "not valid JSON"),
    (
        "/v1/messages",
        {"model": "demo-llama", "messages": [{"role": "user", "content": "x"}]},
        400,
        "max_tokens",
    ),
    ("/v1/messages", {**OK_MSG, "messages": []}, 400, "messages"),
    ("/v1/messages", {**OK_MSG, "messages": [{"role": "tool", "content": "x"}]}, 400, "role"),
    ("/v1/messages", {**OK_MSG, "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/messages", {**OK_MSG, "temperature": -1}, 400, "temperature"),
    ("/v1/messages", {**OK_MSG, "model": "nope"}, 404, "nope"),
    ("/v1/messages", {**OK_MSG, "max_tokens": 10_000_000}, 400, "max_tokens"),
    ("/v1/messages", {**OK_MSG, "system": 12}, 400, "system"),
    ("/v1/messages", {**OK_MSG, "metadata": "m"}, 400, "metadata"),
    (
        "/v1/messages",
        {**OK_MSG, "metadata": {"user_id": 7}},
        400,
        "metadata.user_id: expected a string",
    ),
    ("/v1/messages/count_tokens", {"model": "demo-llama"}, 400, "messages"),
]


@pytest.mark.parametrize(
    "route,body,status,words", CASES, ids=[f"{c[0]}:{c[3]}:{i}" for i, c in enumerate(CASES)]
)
def test_bad_input_gets_4xx_in_dialect_shape(server, route, body, status, words):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(
        server.url + route, headers={"content-type": "application/json"}, timeout=60, **kwargs
    )
    assert r.status_code == status, r.text
    data = r.json()
    if route.startswith("/v1/messages"):
        assert data["type"] == "error"
        message = data["error"]["message"]
    else:
        message = data["error"]["message"]
        assert "type" in data["error"]
    assert words.lower() in message.lower(), message
    # The server keeps serving after every bad request.
    ok = httpx.post(server.url + "/v1/chat/completions", json=OK_CHAT, timeout=60)
    assert ok.status_code == 200


def test_oversized_body_is_413_and_server_keeps_serving(demo_root, tmp_path):
    from tests.conftest import fresh_cache_dir, start_server

    s = start_server(fresh_cache_dir(demo_root, tmp_path / "c"), "--max-body-bytes", "2048")
    try:
        big = {**OK_CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
        r = httpx.post(s.url + "/v1/chat/completions", json=big, timeout=60)
        assert r.status_code == 413
        assert "2048" in r.json()["error"]["message"]
        r = httpx.post(s.url + "/v1/messages", json=big, timeout=60)
        assert r.status_code == 413 and r.json()["type"] == "error"
        assert (
            httpx.post(s.url + "/v1/chat/completions", json=OK_CHAT, timeout=60).status_code == 200
        )
    finally:
        s.stop()
