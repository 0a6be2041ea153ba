"""Where recent requests' prefills resumed, by their chain: the periodic write rule counts
a prefill's crash loss from there (tier_writes.py, `_periodic_due`).

An entry is the chain's id, a weak reference and a position: the reference tells that
chain from a later one at the same id without keeping it alive (a chain holds every token
and block hash of its prompt), so an entry costs the same for any prompt length.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine_bridge.cache.hashing import Chain


@dataclass(slots=True, frozen=True)
class ResumePointStats:
    """What /v1/cache/stats shows under "writes": resume points remembered, and the bound."""

    entries: int = 0
    max_entries: int = 0


class ResumePoints:
    """The last `limit` resume points; entries whose chain is gone leave first. The MLX
    thread notes and reads them (stats only count)."""

    def __init__(self, limit: int) -> None:
        assert limit > 0, f"resume points limit {limit}"
        self.limit = limit
        self._at: OrderedDict[int, tuple[weakref.ref[Chain], int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._at)

    def note(self, chain: Chain, position: int) -> None:
        at = self._at
        at[id(chain)] = (weakref.ref(chain), position)
        at.move_to_end(id(chain))
        # Oldest first: a request long done has let go of its chain; past the bound, drop.
        while at and (len(at) > self.limit or next(iter(at.values()))[0]() is None):
            at.popitem(last=False)

    def get(self, chain: Chain) -> int | None:
        """Where the prefill of this very chain resumed, if it is remembered."""
        found = self._at.get(id(chain))
        return found[1] if found is not None and found[0]() is chain else None

    def stats(self) -> ResumePointStats:
        return ResumePointStats(len(self._at), self.limit)
