"""Forget, from the session registry, entries that neither tier holds any more.

A session record names every block and checkpoint its requests stored or used (that is
what lets a delete drop only its own). Once eviction has taken an entry out of RAM and off
the SSD, the name is dead weight: nothing to list, nothing to delete. Left alone, 4,096
records of long agent sessions would keep hundreds of MB of hashes, and the load soak saw
the registry grow for as long as it ran. So the session upkeep looks at a batch of
sessions per tick, round robin, and forgets what both tiers lack.

An entry the RAM tier has just evicted can sit in the SSD writer's queue, in neither tier
for a moment. So an entry is forgotten only when two looks, one upkeep tick apart, both
found it missing, and RAM does not hold it when the record changes (on the MLX thread).
An entry forgotten and then stored again is noted again by the request that stores it.
"""

from __future__ import annotations

import time
from collections import deque

from ..cache.kinds import EntryKind
from ..cache.session_registry import EntryId, SessionKey, SessionRecord
from .catalog import ClientSessions

# Sessions looked at per upkeep tick: with the registry's 4,096 sessions and a tick of 5 s,
# every session is looked at about every 2.5 minutes.
BATCH = 128
# Looks closer together than this are skipped (the upkeep ticks faster under a short
# session_ttl), so the two looks that confirm an entry gone are never a blink apart.
MIN_GAP_S = 5.0


class GoneEntries:
    """The look state of one ClientSessions: the sessions still to look at this round, and
    what the last look found missing."""

    def __init__(
        self, sessions: ClientSessions, batch: int = BATCH, min_gap_s: float = MIN_GAP_S
    ) -> None:
        self.sessions = sessions
        self.batch = batch
        self.min_gap_s = min_gap_s
        self._last = -float("inf")
        self.forgotten = 0
        self._to_look: deque[SessionKey] = deque()
        self._suspects: dict[SessionKey, set[EntryId]] = {}

    def look(self) -> dict[SessionKey, list[EntryId]]:
        """One tick's look (any thread but the MLX one: it reads the SSD index). Returns
        what the last look found missing and this one still does, to `forget` on the MLX
        thread; remembers what this tick's batch is missing for the next look."""
        confirmed: dict[SessionKey, list[EntryId]] = {}
        if time.monotonic() - self._last < self.min_gap_s:
            return confirmed
        self._last = time.monotonic()
        if self._suspects:
            for key, ids in self._missing(list(self._suspects)).items():
                still = [i for i in ids if i in self._suspects[key]]
                if still:
                    confirmed[key] = still
        if not self._to_look:
            self._to_look.extend(self.sessions.registry.keys())
        batch = [self._to_look.popleft() for _ in range(min(self.batch, len(self._to_look)))]
        self._suspects = {k: set(ids) for k, ids in self._missing(batch).items()}
        return confirmed

    def forget(self, confirmed: dict[SessionKey, list[EntryId]]) -> int:
        """Forget the confirmed entries that RAM does not hold now (MLX thread)."""
        ram = self.sessions.tiers.ram
        n = 0
        for key, ids in confirmed.items():
            gone = [(kind, h) for kind, h in ids if ram.entry(kind, h) is None]
            n += self.sessions.registry.forget(key, gone)
        self.forgotten += n
        return n

    def _missing(self, keys: list[SessionKey]) -> dict[SessionKey, list[EntryId]]:
        out = {}
        for rec in self.sessions.registry.copies(keys):
            ids = self._missing_of(rec)
            if ids:
                out[rec.key] = ids
        return out

    def _missing_of(self, rec: SessionRecord) -> list[EntryId]:
        ram = self.sessions.tiers.ram
        blocks = list(rec.blocks)
        on_disk = self.sessions.disk_sizes(rec)
        missing: list[EntryId] = [
            (EntryKind.BLOCK, h)
            for h, in_ram in zip(blocks, ram.has_blocks(blocks), strict=True)
            if not in_ram and (EntryKind.BLOCK, h) not in on_disk
        ]
        missing += (
            (EntryKind.CHECKPOINT, k)
            for k in rec.checkpoints
            if (EntryKind.CHECKPOINT, k) not in on_disk
            and ram.entry(EntryKind.CHECKPOINT, k) is None
        )
        return missing
