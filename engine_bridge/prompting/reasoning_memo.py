"""The reasoning this server generated for each assistant turn, put back where a client
dropped it.

Many OpenAI clients send an assistant turn back without its `reasoning_content`. The
template then renders that turn with an empty reasoning block (or none), so the prompt
leaves the cached sequence, which holds what the model wrote, right at that turn. Keyed
by the turn's answer text and calls, per tenant, model and client session, the memo gives
the reasoning back and the prompt is the previous one plus what was generated.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..types import Message, ToolCall

# One scope's key: (tenant, model, session); a client without a session id shares its
# tenant's scope, where the answer text and calls still tell its turns apart.
Scope = tuple[str, str, str]

# Per entry beyond its text: the key, the digest and the dict's own slot.
_ENTRY_OVERHEAD = 160


def turn_digest(content: str, calls: Sequence[ToolCall] | None) -> bytes:
    """A turn as clients send it back: the answer text less surrounding blanks, and each
    call's name and arguments in canonical JSON (clients re-serialize them)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(content.strip().encode("utf-8", "surrogatepass"))
    for call in calls or ():
        h.update(b"\x00" + call.name.encode("utf-8", "surrogatepass") + b"\x00")
        h.update(_canonical(call.arguments).encode("utf-8", "surrogatepass"))
    return h.digest()


def _canonical(arguments: Any) -> str:
    if isinstance(arguments, str):
        return arguments
    try:
        return json.dumps(arguments, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError):
        return repr(arguments)


@dataclass(slots=True)
class ReasoningMemoStats:
    entries: int = 0
    bytes: int = 0
    max_bytes: int = 0
    remembered: int = 0  # turns whose reasoning was kept
    restored: int = 0  # assistant turns a client sent without reasoning, given it back
    evicted: int = 0  # entries dropped for the byte bound


class ReasoningMemo:
    """LRU by bytes; thread-safe (results arrive on the MLX thread, renders on another)."""

    def __init__(self, max_bytes: int = 16 * 1024 * 1024):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[Scope, bytes], str] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._stats = ReasoningMemoStats(max_bytes=max_bytes)

    def remember(
        self, scope: Scope, content: str, calls: Sequence[ToolCall] | None, reasoning: str
    ) -> None:
        if not reasoning.strip() or self.max_bytes <= 0:
            return
        key = (scope, turn_digest(content, calls))
        size = _size(reasoning)
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= _size(old)
            self._entries[key] = reasoning
            self._bytes += size
            self._stats.remembered += 1
            while self._bytes > self.max_bytes:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= _size(dropped)
                self._stats.evicted += 1

    def restore(self, scope: Scope, messages: Sequence[Message]) -> list[Message]:
        """`messages` with the remembered reasoning of each assistant turn sent without any;
        a turn whose reasoning the client kept is left exactly as sent."""
        out = list(messages)
        if not self._entries:
            return out
        for i, m in enumerate(out):
            if m.role != "assistant" or (m.reasoning is not None and m.reasoning.strip()):
                continue
            key = (scope, turn_digest(m.content, m.tool_calls))
            with self._lock:
                reasoning = self._entries.get(key)
                if reasoning is None:
                    continue
                self._entries.move_to_end(key)
                self._stats.restored += 1
            out[i] = replace(m, reasoning=reasoning)
        return out

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def stats(self) -> ReasoningMemoStats:
        with self._lock:
            return replace(self._stats, entries=len(self._entries), bytes=self._bytes)


def _size(reasoning: str) -> int:
    return len(reasoning.encode("utf-8", "surrogatepass")) + _ENTRY_OVERHEAD
