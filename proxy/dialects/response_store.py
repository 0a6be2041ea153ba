"""The Responses API's stored responses, for `previous_response_id`: bounded by bytes.

An entry is the items its conversation ended with: the previous entry's items plus the new
input and output, a tuple of references to the same dicts, so a chain of turns holds each
item once. The bound counts each item once too (reference-counted by identity), as the
JSON bytes it was sent or written as: base64 images are most of them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import orjson

Items = tuple[Any, ...]

# No [responses] config section: a module constant, like the store's old count (256).
STORE_MAX_BYTES = 64 << 20
# Ids evicted lately, so a client naming one hears that it was evicted, not that it never
# existed. Ids are ours ("resp_" and 32 hex digits): this many cost about 100 KB.
EVICTED_IDS = 1024


@dataclass(frozen=True, slots=True)
class StoreStats:
    """What /v1/cache/stats shows of the store, under proxy.responses."""

    entries: int
    bytes: int
    max_bytes: int
    evicted: int  # entries evicted since the process started


@dataclass(slots=True)
class _Held:
    item: Any  # held here too, so its id() is not reused while counted
    refs: int
    nbytes: int


class ResponseStore:
    """The most recently used stored responses that fit in `max_bytes`, oldest out first."""

    def __init__(self, max_bytes: int = STORE_MAX_BYTES):
        self.max_bytes = max_bytes
        self.bytes = 0
        self.evicted = 0
        self._entries: OrderedDict[str, tuple[str, Items]] = OrderedDict()
        self._items: dict[int, _Held] = {}
        self._gone: OrderedDict[str, str] = OrderedDict()  # id -> tenant

    def get(self, rid: str, tenant: str) -> Items | None:
        entry = self._entries.get(rid)
        if entry is None or entry[0] != tenant:  # another tenant's id is not there for you
            return None
        self._entries.move_to_end(rid)
        return entry[1]

    def was_evicted(self, rid: str, tenant: str) -> bool:
        """Whether `rid` was stored and then evicted for room (lately: EVICTED_IDS)."""
        return self._gone.get(rid) == tenant

    def put(self, rid: str, tenant: str, items: Items) -> None:
        """Store `items` under `rid`, then evict the oldest entries until the store fits; an
        entry larger than the whole bound is evicted at once."""
        if rid in self._entries:
            self._drop(rid)
        for item in items:
            held = self._items.get(id(item))
            if held is None:
                held = self._items[id(item)] = _Held(item, 0, len(orjson.dumps(item)))
                self.bytes += held.nbytes
            held.refs += 1
        self._entries[rid] = (tenant, items)
        while self.bytes > self.max_bytes and self._entries:
            self._evict(next(iter(self._entries)))

    def stats(self) -> StoreStats:
        return StoreStats(len(self._entries), self.bytes, self.max_bytes, self.evicted)

    def __len__(self) -> int:
        return len(self._entries)

    def _evict(self, rid: str) -> None:
        self._gone[rid] = self._drop(rid)
        self.evicted += 1
        if len(self._gone) > EVICTED_IDS:
            self._gone.popitem(last=False)

    def _drop(self, rid: str) -> str:
        """Forget entry `rid` and what only it held; returns its tenant."""
        tenant, items = self._entries.pop(rid)
        for item in items:
            held = self._items[id(item)]
            held.refs -= 1
            if held.refs == 0:
                del self._items[id(item)]
                self.bytes -= held.nbytes
        assert self.bytes >= 0, (rid, self.bytes)
        return tenant
