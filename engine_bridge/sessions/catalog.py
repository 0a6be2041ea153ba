"""Client sessions over the cache tiers: list them, delete one, pin one, expire idle ones.

The registry (cache/sessions.py) says which entries each session stored or used; this
module acts on the tiers with it. Deleting a session drops from RAM and SSD only what no
other session references, so a shared system prompt stays. Pinning holds a session's RAM
entries against eviction (up to `pin_max_bytes` over every pinned session), including what
it stores later. RAM is changed on the MLX thread only (the engine calls `drop_ram`,
`pin`, `unpin` and `note` there), as eviction does: a spill turns arrays into bytes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..cache.hashing import BlockHash
from ..cache.kinds import EntryKind
from ..cache.ram.manager import Entry
from ..cache.session_registry import EntryId, SessionKey, SessionRecord, SessionRegistry
from ..cache.session_store import SessionStore
from ..cache.ssd.index import EntryRow, Index, Scope
from ..cache.tiers import TieredCache
from ..types import EngineError

log = logging.getLogger("engine_bridge.sessions.catalog")

# How long a delete or clear waits for queued SSD writes before deleting what is on disk
# (a write still queued after that lands afterwards and is evicted by LRU in time).
SSD_FLUSH_S = 5.0


@dataclass(frozen=True, slots=True)
class SessionView:
    """One row of GET /v1/cache/sessions."""

    id: str
    tenant: str
    model: str
    last_used: float
    tokens: int  # leading tokens of its deepest chain still cached (RAM or SSD)
    ram_bytes: int  # RAM held by entries no other session references
    ssd_bytes: int  # the same on SSD
    shared_bytes: int  # RAM + SSD bytes of entries other sessions reference too
    pinned: bool


@dataclass(slots=True)
class Freed:
    entries: int = 0
    bytes: int = 0

    def add(self, entries: int, nbytes: int) -> None:
        self.entries += entries
        self.bytes += nbytes


@dataclass(slots=True)
class SSDDeletePlan:
    """What a delete removes from disk once queued writes are flushed: keys by scope."""

    keys: dict[tuple[Scope, EntryKind], list[BlockHash]] = field(default_factory=dict)
    # For a clear: every entry of the scopes that match (model fingerprint, tenant folder).
    model: str | None = None
    tenant: str | None = None
    everything: bool = False


class ClientSessions:
    """Sessions of every model and tenant over the process-wide tiers."""

    def __init__(
        self,
        tiers: TieredCache,
        *,
        pin_max_bytes: int,
        ttl_s: float | None = None,
        store_dir: Path | None = None,
    ):
        self.tiers = tiers
        self.pin_max_bytes = pin_max_bytes
        self.ttl_s = ttl_s
        self.registry = SessionRegistry()
        # RAM entries each pinned session holds, by entry id.
        self._held: dict[SessionKey, dict[EntryId, Entry]] = {}
        self._over_cap_logged: set[SessionKey] = set()
        self.store = SessionStore(store_dir) if store_dir is not None else None
        if self.store is not None:
            n = self.store.load(self.registry)
            if n:
                log.info("session registry: %d sessions from %s", n, self.store.path)

    def save(self) -> int:
        """Persist what changed (any thread but the MLX one: it is SQLite I/O)."""
        return self.store.save(self.registry) if self.store is not None else 0

    def close(self) -> None:
        if self.store is not None:
            self.save()
            self.store.close()

    # ---- the MLX thread: what requests stored and used ----------------------------------

    def note(
        self,
        key: SessionKey,
        scope: Scope,
        block_size: int,
        hashes: list[BlockHash],
        checkpoint: tuple[BlockHash, int] | None = None,
    ) -> None:
        rec, _ = self.registry.record(key, scope, block_size, hashes, checkpoint)
        if rec.pinned:
            # Everything it used, not only what is new to it: entries promoted back from
            # SSD (after an eviction before the pin, or a restart) are held again too.
            held = self._held.get(key, {})
            ids = [(EntryKind.BLOCK, h) for h in hashes if (EntryKind.BLOCK, h) not in held]
            if checkpoint is not None and (EntryKind.CHECKPOINT, checkpoint[0]) not in held:
                ids.append((EntryKind.CHECKPOINT, checkpoint[0]))
            if ids:
                self._hold(rec, ids, strict=False)

    # ---- views --------------------------------------------------------------------------

    def views(self, tenant: str | None = None) -> list[SessionView]:
        """Every session (of one tenant), most recently used first (any thread: it reads
        copies of the records, RAM under its lock and the SSD index)."""
        refs = self.registry.references()
        out = []
        for rec in self.registry.snapshot():
            if tenant is None or rec.key.tenant == tenant:
                out.append(self._view(rec, refs))
        out.sort(key=lambda v: v.last_used, reverse=True)
        return out

    def _view(self, rec: SessionRecord, refs) -> SessionView:
        ram_unique = ssd_unique = shared = 0
        on_disk = self.disk_sizes(rec)
        for eid in rec.entry_ids():
            kind, key = eid
            entry = self.tiers.ram.entry(kind, key)
            ram = entry.nbytes if entry is not None else 0
            disk = on_disk.get(eid, 0)
            if refs[eid] > 1:
                shared += ram + disk
            else:
                ram_unique += ram
                ssd_unique += disk
        return SessionView(
            rec.key.session,
            rec.key.tenant,
            rec.key.model,
            rec.last_used,
            self._depth(rec, on_disk),
            ram_unique,
            ssd_unique,
            shared,
            rec.pinned,
        )

    def disk_sizes(self, rec: SessionRecord) -> dict[EntryId, int]:
        ssd = self.tiers.ssd
        if ssd is None:
            return {}
        sizes = {}
        for kind, keys in ((EntryKind.BLOCK, rec.blocks), (EntryKind.CHECKPOINT, rec.checkpoints)):
            for row in ssd.rows(rec.scope, kind, list(keys)):
                sizes[(kind, row.key)] = row.size
        return sizes

    def _depth(self, rec: SessionRecord, on_disk: dict[EntryId, int]) -> int:
        """Tokens of the deepest chain whose leading blocks RAM or SSD still hold."""
        best = 0
        for chain in rec.chains:
            in_ram = self.tiers.ram.has_blocks(chain)
            n = 0
            for h, ram in zip(chain, in_ram, strict=True):
                if not (ram or (EntryKind.BLOCK, h) in on_disk):
                    break
                n += 1
            best = max(best, n * rec.block_size)
        return best

    # ---- pinning (MLX thread) -----------------------------------------------------------

    def pin(self, keys: list[SessionKey]) -> None:
        """Hold the sessions' RAM entries; EngineError 409 if that passes the cap."""
        recs = [r for r in map(self.registry.get, keys) if r is not None]
        for rec in recs:
            if rec.pinned:
                continue
            self._hold(rec, rec.entry_ids(), strict=True)
            self.registry.set_pinned(rec.key, True)

    def unpin(self, keys: list[SessionKey]) -> None:
        for key in keys:
            self.registry.set_pinned(key, False)
            self._release(key)

    def pinned_bytes(self) -> int:
        seen = {id(e): e.nbytes for held in self._held.values() for e in held.values()}
        return sum(seen.values())

    def _hold(self, rec: SessionRecord, ids: list[EntryId], *, strict: bool) -> None:
        already = {id(e) for held in self._held.values() for e in held.values()}
        adding = 0
        for kind, key in ids:
            entry = self.tiers.ram.entry(kind, key)
            if entry is not None and id(entry) not in already:
                adding += entry.nbytes
        pinned = self.pinned_bytes()
        if pinned + adding > self.pin_max_bytes:
            if strict:
                raise EngineError(
                    f"pinning session {rec.key.session!r} would hold {adding} more bytes of RAM "
                    f"({pinned} are pinned already), over the cap of {self.pin_max_bytes} bytes "
                    "set by [cache] pin_max; unpin another session or raise pin_max",
                    field="pin_max",
                    status=409,
                )
            if rec.key not in self._over_cap_logged:
                self._over_cap_logged.add(rec.key)
                log.warning(
                    "pinned session %r grew past [cache] pin_max (%d bytes): its newer entries "
                    "are cached but not pinned",
                    rec.key.session,
                    self.pin_max_bytes,
                )
            return
        mine = self._held.setdefault(rec.key, {})
        for entry in self.tiers.ram.hold([i for i in ids if i not in mine]):
            mine[(entry.kind, entry.key)] = entry

    def _release(self, key: SessionKey) -> None:
        held = self._held.pop(key, {})
        self._over_cap_logged.discard(key)
        if held:
            self.tiers.ram.unhold(list(held.values()))

    # ---- deleting -----------------------------------------------------------------------

    def drop_ram(self, keys: list[SessionKey]) -> tuple[Freed, SSDDeletePlan]:
        """Forget the sessions and drop from RAM what only they referenced (MLX thread);
        returns what was freed and what to delete from disk next (`drop_ssd`)."""
        recs = [r for r in map(self.registry.get, keys) if r is not None]
        refs = self.registry.references(exclude=keys)
        own: dict[tuple[Scope, EntryKind], list[BlockHash]] = {}
        for rec in recs:
            self._release(rec.key)
            for kind, key in rec.entry_ids():
                if refs[(kind, key)] == 0:
                    own.setdefault((rec.scope, kind), []).append(key)
        self.registry.remove(keys)
        freed = Freed()
        for (_, kind), hashes in own.items():
            freed.add(*self.tiers.ram.discard([(kind, h) for h in hashes]))
        return freed, SSDDeletePlan(keys=own)

    def clear_ram(
        self, model_id: str | None, fingerprint: str | None, tenant: str | None
    ) -> tuple[Freed, SSDDeletePlan]:
        """Drop every session and unreferenced RAM entry of a model and/or tenant."""
        keys = [
            r.key
            for r in self.registry.records()
            if (model_id is None or r.key.model == model_id)
            and (tenant is None or r.key.tenant == tenant)
        ]
        for key in keys:
            self._release(key)
        self.registry.remove(keys)
        folder = None if tenant is None else Scope.of("m", tenant).tenant
        victims = [
            (e.kind, e.key)
            for e in self.tiers.ram.entries()
            if (fingerprint is None or e.payload.scope.model == fingerprint)
            and (folder is None or e.payload.scope.tenant == folder)
        ]
        freed = Freed()
        freed.add(*self.tiers.ram.discard(victims))
        everything = model_id is None and tenant is None
        return freed, SSDDeletePlan(model=fingerprint, tenant=folder, everything=everything)

    def drop_ssd(self, plan: SSDDeletePlan, freed: Freed) -> Freed:
        """Delete a plan's entries from disk (any thread; waits for queued writes first)."""
        ssd = self.tiers.ssd
        if ssd is None:
            return freed
        ssd.flush(SSD_FLUSH_S)
        for (scope, kind), hashes in plan.keys.items():
            freed.add(*ssd.delete(lambda index, s=scope, k=kind, h=hashes: index.select(s, k, h)))
        if plan.everything or plan.model is not None or plan.tenant is not None:
            freed.add(*ssd.delete(lambda index: _rows_of(index, plan.model, plan.tenant)))
        return freed

    # ---- idle expiry --------------------------------------------------------------------

    def drop_idle(self, busy: set[SessionKey]) -> tuple[list[SessionKey], Freed, SSDDeletePlan]:
        """`drop_ram` the idle sessions but those in `busy` (MLX thread)."""
        keys = [k for k in self.idle() if k not in busy]
        freed, plan = self.drop_ram(keys) if keys else (Freed(), SSDDeletePlan())
        for hashes in plan.keys.values():
            self.tiers.note_expired(hashes)
        return keys, freed, plan

    def idle(self, now: float | None = None) -> list[SessionKey]:
        """Sessions unused for `ttl_s` that are not pinned."""
        if self.ttl_s is None:
            return []
        cutoff = (time.time() if now is None else now) - self.ttl_s
        return [r.key for r in self.registry.records() if r.last_used < cutoff and not r.pinned]


def _rows_of(index: Index, model: str | None, tenant: str | None) -> list[EntryRow]:
    return [r for r in index.rows(model) if tenant is None or r.scope.tenant == tenant]


def keys_of(records: Iterable[SessionRecord]) -> list[SessionKey]:
    return [r.key for r in records]
