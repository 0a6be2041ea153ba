"""A client that drops mid-stream cancels its generation, and the next request is served."""

from __future__ import annotations

import time

import httpx


def test_disconnect_mid_stream_cancels_generation(server):
    body = {
        "model": "demo-llama",
        "messages": [{"role": "user", "content": "Write forever."}],
        "max_tokens": 20000,
        "temperature": 0,
        "stream": True,
    }
    before = httpx.get(server.url + "/v1/cache/stats", timeout=10).json()["requests"]
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines += 1
            if lines >= 3:
                break
    # The stream is closed; the generation must stop long before 20000 tokens.
    deadline = time.monotonic() + 30
    stats = None
    while time.monotonic() < deadline:
        stats = httpx.get(server.url + "/v1/cache/stats", timeout=10).json()["requests"]
        if stats["cancelled"] > before["cancelled"]:
            break
        time.sleep(0.1)
    assert stats["cancelled"] == before["cancelled"] + 1
    assert stats["last_cancelled_completion_tokens"] < 2000
    ok = httpx.post(
        server.url + "/v1/chat/completions",
        json={**body, "stream": False, "max_tokens": 4},
        timeout=60,
    )
    assert ok.status_code == 200
    assert ok.json()["usage"]["completion_tokens"] <= 4
