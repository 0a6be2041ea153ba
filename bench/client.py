"""A streaming HTTP client that times the first generated token, for both API dialects.

It uses http.client rather than an async library: one request at a time is all a benchmark
needs, and the fewer layers sit between the socket and the clock, the less they add to TTFT.
"""

from __future__ import annotations

import http.client
import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit

Dialect = Literal["openai", "anthropic"]

# Delta keys that carry generated output, in either dialect and in mlx_lm.server's.
_OPENAI_OUTPUT_KEYS = ("content", "reasoning_content", "reasoning", "tool_calls")
_ANTHROPIC_DELTA_TYPES = ("text_delta", "thinking_delta", "input_json_delta")


@dataclass(slots=True)
class Reply:
    """What one streamed request cost and what the server said about its cache."""

    ok: bool
    status: int
    # Seconds from sending the request to the first delta that carries output.
    ttft_s: float | None
    total_s: float
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    cache_source: str | None = None  # x-prompt-cache-source; only our proxy sends it
    text: str = ""
    # True when no delta carried output and ttft_s is the time to the end of the stream.
    ttft_is_end: bool = False
    error: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def hit_ratio(self) -> float | None:
        if not self.prompt_tokens or self.cached_tokens is None:
            return None
        return self.cached_tokens / self.prompt_tokens


def get_json(base_url: str, path: str, timeout: float = 10.0) -> Any:
    conn = _connect(base_url, timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        body = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"GET {base_url}{path} answered {resp.status}: {body[:200]!r}")
        return json.loads(body)
    finally:
        conn.close()


def stream(
    base_url: str,
    dialect: Dialect,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    timeout: float = 900.0,
) -> Reply:
    """POST `body` with stream=True and read the SSE stream to its end."""
    path = "/v1/messages" if dialect == "anthropic" else "/v1/chat/completions"
    payload = json.dumps({**body, "stream": True}).encode()
    send_headers = {"Content-Type": "application/json", **(headers or {})}
    if dialect == "anthropic":
        send_headers.setdefault("anthropic-version", "2023-06-01")
        send_headers.setdefault("x-api-key", "bench")
    conn = _connect(base_url, timeout)
    start = time.perf_counter()
    try:
        conn.request("POST", path, body=payload, headers=send_headers)
        resp = conn.getresponse()
        resp_headers = {k.lower(): v for k, v in resp.getheaders()}
        if resp.status != 200:
            text = resp.read().decode(errors="replace")
            return Reply(
                False,
                resp.status,
                None,
                time.perf_counter() - start,
                error=f"HTTP {resp.status}: {text[:500]}",
                headers=resp_headers,
            )
        reply = Reply(True, 200, None, 0.0, headers=resp_headers)
        reply.cache_source = resp_headers.get("x-prompt-cache-source")
        parse = _openai_event if dialect == "openai" else _anthropic_event
        for data in _sse_data(resp):
            if parse(data, reply) and reply.ttft_s is None:
                reply.ttft_s = time.perf_counter() - start
        reply.total_s = time.perf_counter() - start
        if reply.ttft_s is None:
            reply.ttft_s, reply.ttft_is_end = reply.total_s, True
        return reply
    except (OSError, http.client.HTTPException, ValueError) as e:
        return Reply(False, 0, None, time.perf_counter() - start, error=f"{type(e).__name__}: {e}")
    finally:
        conn.close()


def _connect(base_url: str, timeout: float) -> http.client.HTTPConnection:
    parts = urlsplit(base_url)
    return http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)


def _sse_data(resp: http.client.HTTPResponse):
    """The JSON payload of each `data:` line; [DONE] ends the stream."""
    while True:
        line = resp.readline()
        if not line:
            return
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)


def _openai_event(data: dict[str, Any], reply: Reply) -> bool:
    """Fold one chunk into `reply`; True if it carried generated output."""
    if "error" in data:
        reply.ok, reply.error = False, json.dumps(data["error"])[:500]
    usage = data.get("usage")
    if usage:
        reply.prompt_tokens = usage.get("prompt_tokens")
        reply.completion_tokens = usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details") or {}
        reply.cached_tokens = details.get("cached_tokens", reply.cached_tokens)
    output = False
    for choice in data.get("choices") or []:
        delta = choice.get("delta") or {}
        for key in _OPENAI_OUTPUT_KEYS:
            value = delta.get(key)
            if value:
                output = True
                if isinstance(value, str):
                    reply.text += value
    return output


def _anthropic_event(data: dict[str, Any], reply: Reply) -> bool:
    kind = data.get("type")
    if kind == "error":
        reply.ok, reply.error = False, json.dumps(data.get("error"))[:500]
    elif kind == "message_start":
        _anthropic_usage(data["message"].get("usage") or {}, reply)
    elif kind == "message_delta":
        _anthropic_usage(data.get("usage") or {}, reply)
    elif kind == "content_block_delta":
        delta = data.get("delta") or {}
        if delta.get("type") in _ANTHROPIC_DELTA_TYPES:
            text = delta.get("text") or delta.get("thinking") or delta.get("partial_json") or ""
            reply.text += text
            return bool(text)
    return False


def _anthropic_usage(usage: dict[str, Any], reply: Reply) -> None:
    # Anthropic splits the prompt into uncached, written and read tokens.
    if "input_tokens" in usage:
        read = usage.get("cache_read_input_tokens") or 0
        created = usage.get("cache_creation_input_tokens") or 0
        reply.prompt_tokens = usage["input_tokens"] + read + created
        reply.cached_tokens = read
    if "output_tokens" in usage:
        reply.completion_tokens = usage["output_tokens"]
