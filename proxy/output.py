"""Split a model's streamed text into reasoning, answer text and tool calls.

Models in the Qwen/Hermes family write `<think>…</think>` for reasoning and
`<tool_call>{"name": …, "arguments": {…}}</tool_call>` for calls; both dialects render the
same three kinds of part, so the parsing lives here once.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Literal

from engine_bridge.types import ToolCall

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(slots=True)
class Part:
    kind: Literal["text", "reasoning", "tool_call"]
    text: str = ""
    call: ToolCall | None = None  # set for kind "tool_call"


def new_call_id(prefix: str = "call_") -> str:
    return prefix + uuid.uuid4().hex[:24]


class OutputParser:
    """Incremental: feed text chunks, get parts; holds back text that may open a tag."""

    def __init__(self, in_reasoning: bool = False, parse_tools: bool = True, raw: bool = False):
        self._state = "reasoning" if in_reasoning else "text"
        self._buf = ""
        self._parse_tools = parse_tools
        self._raw = raw  # plain completions: the text exactly as generated
        # Newlines right after </think> or </tool_call> are layout, not answer text; they
        # may arrive in a later chunk than the tag.
        self._strip_newlines = False

    def feed(self, chunk: str) -> list[Part]:
        if self._raw:
            return [Part("text", chunk)] if chunk else []
        self._buf += chunk
        return self._drain(final=False)

    def finish(self) -> list[Part]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[Part]:
        parts: list[Part] = []
        while True:
            if self._state == "call":
                end = self._buf.find(CALL_CLOSE)
                if end == -1:
                    if final:  # an unterminated call is shown as text, not dropped
                        parts.append(Part("text", CALL_OPEN + self._buf))
                        self._buf = ""
                    return parts
                parts.append(self._call_part(self._buf[:end]))
                self._buf = self._buf[end + len(CALL_CLOSE) :]
                self._state = "text"
                self._strip_newlines = True
                continue
            if self._strip_newlines:
                self._buf = self._buf.lstrip("\n")
                if not self._buf:
                    return parts
                self._strip_newlines = False
            kind = "reasoning" if self._state == "reasoning" else "text"
            tags = [THINK_CLOSE] if kind == "reasoning" else [THINK_OPEN]
            if kind == "text" and self._parse_tools:
                tags.append(CALL_OPEN)
            hit = min(((i, t) for t in tags if (i := self._buf.find(t)) != -1), default=None)
            if hit is None:
                keep = 0 if final else _partial_tag_len(self._buf, tags)
                emit = self._buf[: len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep :]
                if emit:
                    parts.append(Part(kind, emit))
                return parts
            i, tag = hit
            if i:
                parts.append(Part(kind, self._buf[:i]))
            self._buf = self._buf[i + len(tag) :]
            if tag == THINK_OPEN:
                self._state = "reasoning"
            elif tag == THINK_CLOSE:
                self._state = "text"
                self._strip_newlines = True
            else:
                self._state = "call"

    def _call_part(self, body: str) -> Part:
        try:
            data = json.loads(body.strip())
            name = data["name"]
            args = data.get("arguments", data.get("parameters", {}))
            if isinstance(args, str):
                args = json.loads(args)
            if not isinstance(name, str) or not isinstance(args, dict):
                raise ValueError("bad shape")
        except (ValueError, KeyError, TypeError):
            return Part("text", CALL_OPEN + body + CALL_CLOSE)
        return Part("tool_call", call=ToolCall(name, args, new_call_id()))


def _partial_tag_len(buf: str, tags: list[str]) -> int:
    """Length of the longest suffix of buf that is a proper prefix of some tag."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(buf)), 0, -1):
            if buf.endswith(tag[:k]):
                best = max(best, k)
                break
    return best


def merge(parts: list[Part]) -> list[Part]:
    """Coalesce adjacent parts of the same kind (for non-streaming responses)."""
    out: list[Part] = []
    for p in parts:
        if out and p.kind != "tool_call" and out[-1].kind == p.kind:
            out[-1].text += p.text
        else:
            out.append(Part(p.kind, p.text, p.call))
    return out
