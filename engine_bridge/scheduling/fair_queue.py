"""A wait queue that takes tenants in turn, and each tenant's sessions in turn.

One client's flood (many requests, or many sessions of one tenant) waits behind everyone
else's next request instead of in front of it. Within a session, requests keep their order.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class FairQueue(Generic[T]):
    def __init__(self) -> None:
        self._lanes: OrderedDict[str, OrderedDict[str, deque[T]]] = OrderedDict()
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[T]:
        for sessions in self._lanes.values():
            for queue in sessions.values():
                yield from queue

    def push(self, tenant: str, session: str, item: T) -> None:
        self._lanes.setdefault(tenant, OrderedDict()).setdefault(session, deque()).append(item)
        self._n += 1

    def push_front(self, tenant: str, session: str, item: T) -> None:
        """Undo a `pop`: the item goes back first in line, its session and tenant too."""
        sessions = self._lanes.setdefault(tenant, OrderedDict())
        sessions.setdefault(session, deque()).appendleft(item)
        sessions.move_to_end(session, last=False)
        self._lanes.move_to_end(tenant, last=False)
        self._n += 1

    def peek(self) -> T:
        """The item `pop` would return."""
        sessions = next(iter(self._lanes.values()))
        return next(iter(sessions.values()))[0]

    def pop(self) -> T:
        """The next item; its session and its tenant go to the back of their lines."""
        item = self.pop_first(lambda _: True)
        if item is None:
            raise IndexError("pop from an empty FairQueue")
        return item

    def pop_first(self, ok: Callable[[T], bool]) -> T | None:
        """Like `pop`, but passing over sessions whose next item is not `ok` yet; those keep
        their place in line. None when no session's next item is."""
        for tenant, sessions in self._lanes.items():
            for session, queue in sessions.items():
                if ok(queue[0]):
                    item = queue.popleft()
                    self._n -= 1
                    del sessions[session]
                    if queue:
                        sessions[session] = queue
                    del self._lanes[tenant]
                    if sessions:
                        self._lanes[tenant] = sessions
                    return item
        return None

    def remove_if(self, pred: Callable[[T], bool]) -> list[T]:
        """Take out (and return) every item for which `pred` holds; the order stays."""
        removed: list[T] = []
        for tenant in list(self._lanes):
            sessions = self._lanes[tenant]
            for session in list(sessions):
                queue = sessions[session]
                gone = [x for x in queue if pred(x)]
                if not gone:
                    continue
                removed += gone
                sessions[session] = deque(x for x in queue if not pred(x))
                if not sessions[session]:
                    del sessions[session]
            if not sessions:
                del self._lanes[tenant]
        self._n -= len(removed)
        return removed
