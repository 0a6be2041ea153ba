"""The answer of /v1/messages: the message object, its content blocks, usage and stop reason,
and the writer of its event stream.

A stream is message_start and a ping, then each content block's content_block_start, deltas
and content_block_stop as the parts come (a ping each keepalive while none does), then
message_delta with the stop reason and usage, and message_stop.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from ..generation import Generation
from .output import Part
from .sse import SSEWriter


class MessageWriter:
    """Writes one message's event stream to `sse`, opening and closing blocks as parts come."""

    def __init__(self, sse: SSEWriter, gen: Generation, message_id: str, model: str):
        self.sse = sse
        self.gen = gen
        self.id = message_id
        self.model = model
        self.seen: list[Part] = []
        self.index = -1  # of the last block started
        self.open: str | None = None  # the kind of the open text or thinking block

    async def write(self) -> None:
        """The whole stream, from message_start to the end of the body."""
        await self.emit("message_start", message=message_json(self.id, self.model, self.gen))
        await self.ping()
        # A ping each keepalive while no token comes (a long prefill): the SDKs skip it.
        async for p in self.sse.kept_alive(self.gen.parts(), self.ping):
            await self.add(p)
        await self.finish()

    async def add(self, p: Part) -> None:
        self.seen.append(p)
        if p.kind == "tool_call":
            await self.close()
            await self._call(p)
            return
        if not p.text:
            return
        if self.open != p.kind:
            await self.close()
            await self._open(p.kind)
        delta = (
            {"type": "text_delta", "text": p.text}
            if p.kind == "text"
            else {"type": "thinking_delta", "thinking": p.text}
        )
        await self.emit("content_block_delta", index=self.index, delta=delta)

    async def _open(self, kind: str) -> None:
        self.index += 1
        self.open = kind
        block = (
            {"type": "text", "text": ""}
            if kind == "text"
            else {"type": "thinking", "thinking": "", "signature": ""}
        )
        await self.emit("content_block_start", index=self.index, content_block=block)

    async def close(self) -> None:
        """End the open block; a thinking block's (empty) signature comes last."""
        if self.open == "reasoning":
            delta = {"type": "signature_delta", "signature": ""}
            await self.emit("content_block_delta", index=self.index, delta=delta)
        if self.open is not None:
            await self.emit("content_block_stop", index=self.index)
        self.open = None

    async def _call(self, p: Part) -> None:
        """A tool call as a block of its own: its input in one delta (the families' parsers
        read a call whole)."""
        self.index += 1
        block = block_json(p)
        opened = {**block, "input": {}}
        await self.emit("content_block_start", index=self.index, content_block=opened)
        delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        await self.emit("content_block_delta", index=self.index, delta=delta)
        await self.emit("content_block_stop", index=self.index)

    async def finish(self) -> None:
        await self.close()
        reason, seq = stop_reason(self.gen, self.seen)
        await self.emit(
            "message_delta",
            delta={"stop_reason": reason, "stop_sequence": seq},
            usage=usage(self.gen),
        )
        await self.emit("message_stop")
        await self.sse.end()

    async def ping(self) -> None:
        await self.emit("ping")

    async def emit(self, kind: str, **fields: Any) -> None:
        await self.sse.event(kind, {"type": kind, **fields})


def new_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def message_json(
    mid: str, model: str, gen: Generation, parts: list[Part] | None = None
) -> dict[str, Any]:
    """The message object: whole, from all its (merged) `parts`; without them, empty, as
    message_start opens it."""
    reason, seq = stop_reason(gen, parts) if parts is not None else (None, None)
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [block_json(p) for p in parts or () if p.kind == "tool_call" or p.text],
        "stop_reason": reason,
        "stop_sequence": seq,
        "usage": usage(gen) if parts is not None else usage(gen, output_tokens=0),
    }


def usage(gen: Generation, output_tokens: int | None = None) -> dict[str, int]:
    info = gen.info
    # Every prompt token the cache did not supply is written to it (unless bypassed).
    created = info.prompt_tokens - info.cached_tokens if gen.use_cache else 0
    return {
        "input_tokens": info.prompt_tokens - info.cached_tokens - created,
        "output_tokens": output_tokens
        if output_tokens is not None
        else (gen.result.completion_tokens if gen.result else 0),
        "cache_read_input_tokens": info.cached_tokens,
        "cache_creation_input_tokens": created,
    }


def stop_reason(gen: Generation, parts: list[Part]) -> tuple[str, str | None]:
    r = gen.result
    if any(p.kind == "tool_call" for p in parts):
        return "tool_use", None
    if r and r.finish_reason == "length":
        return "max_tokens", None
    if r and r.finish_reason == "stop_string":
        return "stop_sequence", r.stop_string
    return "end_turn", None


def block_json(p: Part) -> dict[str, Any]:
    if p.kind == "text":
        return {"type": "text", "text": p.text}
    if p.kind == "reasoning":
        return {"type": "thinking", "thinking": p.text, "signature": ""}
    assert p.call is not None, f"not a tool call: {p!r}"
    return {
        "type": "tool_use",
        "id": "toolu_" + (p.call.id or "").removeprefix("call_"),
        "name": p.call.name,
        "input": p.call.arguments,
    }
