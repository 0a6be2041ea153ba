"""What rendering a conversation's message prefixes gave, remembered across requests.

Finding where message i starts means rendering messages[:i] (prompt.prefix_lengths). Turn N
of a conversation repeats the messages of turn N-1, so all but its newest prefixes were
rendered before. Each prefix is remembered by a hash chain over the template's context
(tools, template arguments) and the messages it holds, with its length and the digest of its
text; a later request checks that digest against its own prompt instead of rendering. That
is exact for any template, history-rewriting ones included, and makes a turn cost only its
new prefixes.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

# A prefix the template refused to render: remembered too, so it is not tried again.
RAISED = (-1, b"")


def _canonical(value: Any) -> bytes:
    return json.dumps(
        value, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=repr
    ).encode()


def prefix_keys(
    chat: Sequence[dict[str, Any]], tools: Any, template_kwargs: dict[str, Any]
) -> list[bytes]:
    """keys[i] names messages[:i] rendered with these tools and template arguments."""
    key = hashlib.sha256(_canonical([tools, template_kwargs])).digest()
    keys = [key]
    for message in chat:
        key = hashlib.sha256(key + _canonical(message)).digest()
        keys.append(key)
    return keys


def text_digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


class PrefixDigests:
    """Digests of a prompt's leading `length` characters, in one pass for rising lengths."""

    def __init__(self, text: str) -> None:
        self.text = text
        self._hash = hashlib.sha256()
        self._at = 0

    def of(self, length: int) -> bytes:
        if length < self._at:  # asked out of order: start over for this one
            return text_digest(self.text[:length])
        self._hash.update(self.text[self._at : length].encode())
        self._at = length
        return self._hash.copy().digest()


class PrefixMemo:
    """A bounded LRU of prefix key -> (length, digest) or RAISED; safe across threads."""

    def __init__(self, max_entries: int = 1 << 16) -> None:
        assert max_entries > 0, f"max_entries {max_entries}"
        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, tuple[int, bytes]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._entries

    def get(self, key: bytes) -> tuple[int, bytes] | None:
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
            return found

    def put(self, key: bytes, value: tuple[int, bytes]) -> None:
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
