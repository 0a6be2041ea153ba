"""Which cache entries each client session stored or used: the registry behind
/v1/cache/sessions (listing, delete, pin, idle expiry).

A session is one (tenant, model, client session id). Its conversation is a growing path,
so it keeps the latest chain of each branch it took (the deepest wins) plus the set of
every block and checkpoint its requests went through. An entry referenced by one session
only is that session's own; one referenced by several is shared, and deleting a session
drops only what is its own, so the system prompt two sessions share stays cached.

Plain data under one lock: no tiers, no threads of its own (engine_bridge/sessions/catalog.py
acts on the tiers). Hashes are already scoped: a block hash covers the model fingerprint
and tenant through its chain root, so entries of different scopes never collide.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from engine_bridge.cache.hashing import BlockHash
from engine_bridge.cache.kinds import EntryKind
from engine_bridge.cache.ssd.index import Scope

# Branches kept per session: a conversation that was edited or retried goes down a new
# path; older paths stay owned (their entries still count as the session's) but only this
# many chains are remembered for the "tokens deep" figure.
MAX_CHAINS = 8
EntryId = tuple[EntryKind, BlockHash]


@dataclass(frozen=True, slots=True)
class SessionKey:
    tenant: str
    model: str
    session: str


@dataclass(slots=True, eq=False)
class SessionRecord:
    key: SessionKey
    scope: Scope
    block_size: int
    last_used: float = field(default_factory=time.time)
    pinned: bool = False
    # The latest chain of each branch, as full-block hashes, most recent last.
    chains: list[list[BlockHash]] = field(default_factory=list)
    # Every entry its requests stored or restored (insertion-ordered sets).
    blocks: dict[BlockHash, None] = field(default_factory=dict)
    checkpoints: dict[BlockHash, None] = field(default_factory=dict)
    # Checkpoint positions by key, for the "tokens deep" of snapshot models.
    positions: dict[BlockHash, int] = field(default_factory=dict)

    def copy(self) -> SessionRecord:
        return SessionRecord(
            self.key, self.scope, self.block_size, self.last_used, self.pinned,
            [list(c) for c in self.chains], dict(self.blocks), dict(self.checkpoints),
            dict(self.positions),
        )  # fmt: skip

    def entry_ids(self) -> list[EntryId]:
        return [(EntryKind.BLOCK, h) for h in self.blocks] + [
            (EntryKind.CHECKPOINT, k) for k in self.checkpoints
        ]

    def note_chain(self, hashes: Sequence[BlockHash]) -> None:
        """Remember `hashes` as a branch: it replaces a chain it extends or is a prefix of."""
        if not hashes:
            return
        for i, chain in enumerate(self.chains):
            n = min(len(chain), len(hashes))
            # Chained hashes: equal at index n-1 means equal all the way up to it.
            if chain[n - 1] == hashes[n - 1]:
                longer = list(hashes) if len(hashes) >= len(chain) else chain
                del self.chains[i]
                self.chains.append(longer)
                return
        self.chains.append(list(hashes))
        del self.chains[:-MAX_CHAINS]


class SessionRegistry:
    """Session records by key; thread-safe (the MLX thread writes, the event loop reads)."""

    def __init__(self, max_sessions: int = 4096) -> None:
        self.max_sessions = max_sessions
        self._lock = threading.Lock()
        self._records: dict[SessionKey, SessionRecord] = {}
        self.dirty: set[SessionKey] = set()  # changed since the last `take_dirty`
        self.removed: set[SessionKey] = set()

    def __len__(self) -> int:
        return len(self._records)

    def record(
        self,
        key: SessionKey,
        scope: Scope,
        block_size: int,
        hashes: Sequence[BlockHash],
        checkpoint: tuple[BlockHash, int] | None = None,
    ) -> tuple[SessionRecord, list[EntryId]]:
        """Note that the session stored or used `hashes` (a chain's leading full blocks)
        and `checkpoint` (key, position); returns the record and the entries new to it."""
        with self._lock:
            rec = self._records.get(key)
            if rec is None:
                rec = self._records[key] = SessionRecord(key, scope, block_size)
                self._bound()
            else:
                # Most recently used last, so `_bound` drops the stalest first.
                self._records[key] = self._records.pop(key)
            rec.last_used = time.time()
            rec.note_chain(hashes)
            new: list[EntryId] = []
            for h in hashes:
                if h not in rec.blocks:
                    rec.blocks[h] = None
                    new.append((EntryKind.BLOCK, h))
            if checkpoint is not None and checkpoint[0] not in rec.checkpoints:
                rec.checkpoints[checkpoint[0]] = None
                rec.positions[checkpoint[0]] = checkpoint[1]
                new.append((EntryKind.CHECKPOINT, checkpoint[0]))
            self.dirty.add(key)
            self.removed.discard(key)
            return rec, new

    def _bound(self) -> None:
        while len(self._records) > self.max_sessions:
            # The least recently used session that is not pinned stops being tracked; its
            # entries stay cached, shared by nobody, until eviction or a clear.
            for key, rec in self._records.items():
                if not rec.pinned:
                    del self._records[key]
                    self.removed.add(key)
                    break
            else:
                return

    def add(self, rec: SessionRecord) -> None:
        """Put back a record loaded from disk (no newer one is replaced)."""
        with self._lock:
            self._records.setdefault(rec.key, rec)

    def get(self, key: SessionKey) -> SessionRecord | None:
        with self._lock:
            return self._records.get(key)

    def records(self) -> list[SessionRecord]:
        """The live records: read their sets only on the MLX thread, which writes them."""
        with self._lock:
            return list(self._records.values())

    def snapshot(self) -> list[SessionRecord]:
        """Copies of every record, for readers on other threads."""
        with self._lock:
            return [r.copy() for r in self._records.values()]

    def find(self, session: str, tenant: str | None = None) -> list[SessionRecord]:
        """Every model's record of a client session id, of one tenant or of all."""
        with self._lock:
            return [
                r
                for k, r in self._records.items()
                if k.session == session and (tenant is None or k.tenant == tenant)
            ]

    def remove(self, keys: Iterable[SessionKey]) -> None:
        with self._lock:
            for key in keys:
                if self._records.pop(key, None) is not None:
                    self.removed.add(key)
                    self.dirty.discard(key)

    def keys(self) -> list[SessionKey]:
        with self._lock:
            return list(self._records)

    def copies(self, keys: Iterable[SessionKey]) -> list[SessionRecord]:
        """Copies of the records of `keys` that exist, for readers on other threads."""
        with self._lock:
            return [r.copy() for r in map(self._records.get, keys) if r is not None]

    def forget(self, key: SessionKey, ids: Iterable[EntryId]) -> int:
        """Drop entries that no tier holds any more from a session's record (MLX thread):
        they are nobody's to list or delete, and a registry that runs for weeks would
        otherwise keep a hash of every block each session ever touched. Its chains end
        before their first dropped block; the depth they give stops there anyway. Returns
        how many entries were dropped."""
        with self._lock:
            rec = self._records.get(key)
            if rec is None:
                return 0
            dropped: set[BlockHash] = set()
            n = 0
            for kind, h in ids:
                held = rec.blocks if kind is EntryKind.BLOCK else rec.checkpoints
                if h not in held:
                    continue
                del held[h]
                n += 1
                if kind is EntryKind.BLOCK:
                    dropped.add(h)
                else:
                    rec.positions.pop(h, None)
            if dropped:
                cut = (
                    chain[: next((i for i, h in enumerate(chain) if h in dropped), len(chain))]
                    for chain in rec.chains
                )
                rec.chains = [chain for chain in cut if chain]
            if n:
                self.dirty.add(key)
            return n

    def set_pinned(self, key: SessionKey, pinned: bool) -> None:
        with self._lock:
            rec = self._records.get(key)
            if rec is not None:
                rec.pinned = pinned
                self.dirty.add(key)

    def references(self, exclude: Iterable[SessionKey] = ()) -> Counter[EntryId]:
        """How many sessions reference each entry, leaving out `exclude`."""
        skip = set(exclude)
        counts: Counter[EntryId] = Counter()
        with self._lock:
            for key, rec in self._records.items():
                if key in skip:
                    continue
                counts.update((EntryKind.BLOCK, h) for h in rec.blocks)
                counts.update((EntryKind.CHECKPOINT, k) for k in rec.checkpoints)
        return counts

    def take_dirty(self) -> tuple[list[SessionRecord], set[SessionKey]]:
        """Records changed and keys removed since the last call (for persisting them)."""
        with self._lock:
            changed = [self._records[k].copy() for k in self.dirty if k in self._records]
            removed, self.removed = self.removed, set()
            self.dirty = set()
            return changed, removed
