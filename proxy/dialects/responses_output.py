"""The output items of a response, and the stream events that build them part by part.

Reasoning is written as a summary (`summary_text`), not as `reasoning_text` content: Codex
re-sends a reasoning item's summary on the next turn but drops its reasoning_text, and the
re-sent reasoning is what keeps the next prompt equal to the cached generation.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from ..generation import Generation
from .output import Part
from .responses_items import ToolSet

Emit = Callable[..., Awaitable[None]]


async def _no_events(kind: str, **fields: Any) -> None:
    return None


class Output:
    """Turns parts into output items, emitting each item's stream events as it goes."""

    def __init__(self, tools: ToolSet, emit: Emit = _no_events):
        self.tools = tools
        self.emit = emit
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.text = ""  # of the open item

    async def add(self, p: Part) -> None:
        if p.kind == "tool_call":
            await self.close()
            await self._call(p)
            return
        if not p.text:
            return
        kind = "message" if p.kind == "text" else "reasoning"
        if self.open is None or self.open["type"] != kind:
            await self.close()
            await self._open(kind)
        assert self.open is not None
        self.text += p.text
        at = {"item_id": self.open["id"], "output_index": len(self.items) - 1}
        if kind == "message":
            await self.emit(
                "response.output_text.delta", **at, content_index=0, delta=p.text, logprobs=[]
            )
        else:
            await self.emit(
                "response.reasoning_summary_text.delta", **at, summary_index=0, delta=p.text
            )

    async def _open(self, kind: str) -> None:
        if kind == "message":
            item = {
                "id": new_id("msg"),
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            }
        else:
            item = {"id": new_id("rs"), "type": "reasoning", "summary": []}
        self.items.append(item)
        self.open, self.text = item, ""
        at = {"item_id": item["id"], "output_index": len(self.items) - 1}
        await self.emit(
            "response.output_item.added", output_index=at["output_index"], item=dict(item)
        )
        if kind == "message":
            await self.emit(
                "response.content_part.added", **at, content_index=0, part=_text_part("")
            )
        else:
            await self.emit(
                "response.reasoning_summary_part.added", **at, summary_index=0, part=_summary("")
            )

    async def close(self, status: str = "completed") -> None:
        """End the open item; `incomplete` when max_output_tokens cut it off."""
        item, text = self.open, self.text
        if item is None:
            return
        self.open = None
        at = {"item_id": item["id"], "output_index": len(self.items) - 1}
        if item["type"] == "message":
            part = _text_part(text)
            await self.emit(
                "response.output_text.done", **at, content_index=0, text=text, logprobs=[]
            )
            await self.emit("response.content_part.done", **at, content_index=0, part=part)
            item.update(status=status, content=[part])
        else:
            part = _summary(text)
            await self.emit(
                "response.reasoning_summary_text.done", **at, summary_index=0, text=text
            )
            await self.emit(
                "response.reasoning_summary_part.done", **at, summary_index=0, part=part
            )
            item["summary"] = [part]
        await self.emit("response.output_item.done", output_index=at["output_index"], item=item)

    async def _call(self, p: Part) -> None:
        assert p.call is not None, f"not a tool call: {p!r}"
        namespace, name = self.tools.origin.get(p.call.name, (None, p.call.name))
        item: dict[str, Any] = {
            "id": new_id("fc"),
            "type": "function_call",
            "status": "in_progress",
            "call_id": p.call.id or new_id("call"),
            "name": name,
            "arguments": "",
        }
        if namespace is not None:
            item["namespace"] = namespace
        self.items.append(item)
        at = {"item_id": item["id"], "output_index": len(self.items) - 1}
        arguments = json.dumps(p.call.arguments)  # as /v1/chat/completions writes them
        await self.emit(
            "response.output_item.added", output_index=at["output_index"], item=dict(item)
        )
        await self.emit("response.function_call_arguments.delta", **at, delta=arguments)
        await self.emit(
            "response.function_call_arguments.done", **at, name=name, arguments=arguments
        )
        item.update(status="completed", arguments=arguments)
        await self.emit("response.output_item.done", output_index=at["output_index"], item=item)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _summary(text: str) -> dict[str, Any]:
    return {"type": "summary_text", "text": text}


def usage(gen: Generation) -> dict[str, Any]:
    r = gen.result
    prompt = r.prompt_tokens if r else gen.info.prompt_tokens
    output = r.completion_tokens if r else 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": gen.info.cached_tokens},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": gen.reasoning_tokens},
        "total_tokens": prompt + output,
    }
