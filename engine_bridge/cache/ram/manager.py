"""The RAM tier: find where a request can resume, pin what it restores, store what it computed.

Eviction is LRU by bytes over one queue holding unreferenced blocks and checkpoints. A
request's entries are released deepest first and blocks are inserted deepest first, so
within a conversation the leaves are evicted before the prefix they hang from; an evicted
block only cuts RAM lookups short at the hole (the SSD tier, fed by `on_evict`, can fill it).

`protect_frequent` (0 by default: plain LRU) lets entries read twice or more pass the head
of the queue instead of going: up to that share of the budget per eviction, each pass
halving the entry's reads, so a system prompt every request reads outlives a burst of
one-off prompts, and an entry no longer read goes in time. The autotuner sets it from
the ghost lists (ghosts.py), which also say what a larger budget would have kept.
"""

from __future__ import annotations

import logging
import operator
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from engine_bridge.cache.evictions import EvictionRecord
from engine_bridge.cache.hashing import BLOCK_SIZE, BlockHash, Chain
from engine_bridge.cache.kinds import CheckpointReason, EntryKind
from engine_bridge.cache.ram.checkpoints import Checkpoint, CheckpointStore
from engine_bridge.cache.ram.ghosts import GhostHits, Ghosts
from engine_bridge.cache.ram.matching import Match, find_match, find_matches
from engine_bridge.cache.ram.pool import Block, BlockPool, FreeQueue
from engine_bridge.cache.ram.supersede import mark_superseded

log = logging.getLogger(__name__)

# An entry back from its ghost has been seen twice (ghosts.py): it counts as read twice.
SEEN_AGAIN = 2

Entry = Block | Checkpoint
# Called with each evicted entry after the cache's lock is released (the SSD tier spills it).
OnEvict = Callable[[Entry], None]
# Asked to hand back up to N charged bytes (by `credit`) when a smaller budget leaves the
# tier over it after every unpinned entry went; returns the bytes it let go.
Reclaim = Callable[[int], int]


@dataclass(slots=True, frozen=True)
class InsertResult:
    inserted: int
    deduped: int
    thinned: int = 0
    evicted: int = 0


@dataclass(slots=True, frozen=True)
class CacheStats:
    """A snapshot of the RAM tier."""

    blocks: int
    checkpoints: int
    bytes: int
    block_bytes: int
    checkpoint_bytes: int
    pinned_bytes: int
    reserved_bytes: int
    budget_bytes: int
    evicted_blocks: int
    evicted_checkpoints: int
    evicted_bytes: int
    dedupe_hits: int
    thinned_checkpoints: int
    reserve_failures: int
    spill_errors: int
    superseded_checkpoints: int = 0  # moved to the head of the LRU queue (supersede.py)
    charged_bytes: int = 0  # held outside the tier against its budget (vision features)


def _payload_nbytes(payload: object) -> int:
    nbytes = operator.index(payload.nbytes)  # type: ignore[attr-defined]
    assert nbytes >= 0, f"payload {type(payload).__name__} has nbytes {nbytes}"
    return nbytes


class CacheManager:
    """The RAM tier of one model's prompt cache, bounded by `budget_bytes`."""

    def __init__(
        self,
        budget_bytes: int,
        *,
        block_size: int = BLOCK_SIZE,
        on_evict: OnEvict | None = None,
        thin_periodic: bool = True,
        keep_newest_periodic: bool = False,
        protect_frequent: float = 0.0,
    ) -> None:
        assert budget_bytes >= 0 and block_size > 0, f"budget {budget_bytes}, block {block_size}"
        self.budget_bytes = budget_bytes
        self.block_size = block_size
        self.on_evict = on_evict
        self.thin_periodic = thin_periodic
        # Only a newer periodic checkpoint thins the older ones ([cache.ram] keep_periodic).
        self.keep_newest_periodic = keep_newest_periodic
        # The runner's worker thread mutates; the event loop thread reads stats.
        self._lock = threading.Lock()
        self._lru = FreeQueue()
        self._pool = BlockPool(self._lru)
        self._checkpoints = CheckpointStore(self._lru)
        self._reserved = 0
        self._charged = 0
        self._reclaimers: list[Reclaim] = []
        self._evicted_blocks = 0
        self._evicted_checkpoints = 0
        self._evicted_bytes = 0
        self._dedupe_hits = 0
        self._thinned = 0
        self._reserve_failures = 0
        self._spill_errors = 0
        self._superseded = 0
        # What eviction dropped lately, so a later miss can say it was evicted.
        self.evicted = EvictionRecord()
        # The share of the budget entries read twice or more may keep past the queue's
        # head, per eviction (module doc); and what came back soon after it went.
        self.protect_frequent = protect_frequent
        self._ghosts = Ghosts()

    # ---- lookup -------------------------------------------------------------------------

    def match(self, chain: Chain, *, needs_checkpoint: bool, pin: bool = False) -> Match:
        """The deepest restorable position P < len(chain), so at least one token is prefilled.

        With `needs_checkpoint` (snapshot layers), P must be a checkpoint's exact position.
        With `pin`, the match is also acquired (see `acquire`) under the same lock, so no
        eviction can come between the two.
        """
        with self._lock:
            match = find_match(self._pool, self._checkpoints, chain, needs_checkpoint)
            if pin and match.length:
                self._pin(match)
            return match

    def matches(self, chain: Chain, *, needs_checkpoint: bool) -> tuple[Match, Match]:
        """`match`, and the paged longest common prefix with what RAM holds (the same
        Match for a paged model), from one walk: a lookup's, nothing pinned."""
        with self._lock:
            return find_matches(self._pool, self._checkpoints, chain, needs_checkpoint)

    def has_block(self, block_hash: BlockHash) -> bool:
        with self._lock:
            return block_hash in self._pool

    def has_blocks(self, hashes: Sequence[BlockHash]) -> list[bool]:
        with self._lock:
            return [h in self._pool for h in hashes]

    def entry(self, kind: EntryKind, key: BlockHash) -> Entry | None:
        with self._lock:
            return (self._pool if kind is EntryKind.BLOCK else self._checkpoints).get(key)

    def blocks(self, hashes: Sequence[BlockHash]) -> list[Block | None]:
        """The blocks of `hashes` RAM holds now, None where it holds none."""
        with self._lock:
            return [self._pool.get(h) for h in hashes]

    def path_to(self, anchor: BlockHash) -> list[Block]:
        """The blocks RAM holds on the path that ends with block `anchor`, walking parents
        back until one is missing; shallowest first."""
        path = []
        with self._lock:
            block = self._pool.get(anchor)
            while block is not None:
                path.append(block)
                block = self._pool.get(block.parent)
        return path[::-1]

    def checkpoints_on(self, chain: Chain, lo: int, hi: int) -> list[Checkpoint]:
        """The checkpoints RAM holds on `chain` at positions in (lo, hi], shallowest first."""
        with self._lock:
            return self._checkpoints.on_path(chain, lo, hi)

    def entries(self) -> list[Entry]:
        """Every block and checkpoint held now, blocks first (a snapshot)."""
        with self._lock:
            return [*self._pool.entries(), *self._checkpoints.entries()]

    # ---- pinning ------------------------------------------------------------------------

    def acquire(self, match: Match) -> bool:
        """Pin a match's entries against eviction; False if one was evicted since the match."""
        assert not match.pinned, f"match of {match.length} tokens is already pinned"
        with self._lock:
            if any(self._pool.get(b.hash) is not b for b in match.blocks):
                return False
            ckpt = match.checkpoint
            if ckpt is not None and self._checkpoints.get(ckpt.key) is not ckpt:
                return False
            self._pin(match)
            return True

    def _pin(self, match: Match) -> None:
        for block in match.blocks:
            self._pool.acquire(block)
            block.reads += 1
        if match.checkpoint is not None:
            self._checkpoints.acquire(match.checkpoint)
            match.checkpoint.reads += 1
            match.checkpoint.superseded = False  # reused: live again
        match.pinned = True

    def release(self, match: Match) -> None:
        """Unpin a match's entries, deepest first so its leaves are evicted first."""
        assert match.pinned, f"match of {match.length} tokens is not pinned"
        with self._lock:
            if match.checkpoint is not None:
                self._checkpoints.release(match.checkpoint)
            for block in reversed(match.blocks):
                self._pool.release(block)
            match.pinned = False
            evicted = self._evict_to_budget()
        self._spill(evicted)

    # ---- storing ------------------------------------------------------------------------

    def insert_blocks(self, chain: Chain, payloads: Mapping[int, object]) -> InsertResult:
        """Store full blocks of `chain` by index; a block already cached keeps its payload."""
        bs = chain.block_size
        assert bs == self.block_size, f"chain of {bs}-token blocks, cache of {self.block_size}"
        inserted = deduped = 0
        with self._lock:
            # Deepest first, so the shallow blocks other requests share end up most recent.
            for i in sorted(payloads, reverse=True):
                assert 0 <= i < len(chain.hashes), f"block {i} of a {len(chain)}-token chain"
                payload = payloads[i]
                block, created = self._pool.insert(
                    chain.hashes[i],
                    chain.anchor(i),
                    chain.tokens[i * bs : (i + 1) * bs],
                    payload,
                    _payload_nbytes(payload),
                )
                if created:
                    inserted += 1
                    if self._ghosts.came_back(block.hash):
                        block.reads = SEEN_AGAIN
                else:
                    deduped += 1
                    self._pool.refresh(block)
            self._dedupe_hits += deduped
            evicted = self._evict_to_budget()
        self._spill(evicted)
        return InsertResult(inserted, deduped, evicted=len(evicted))

    def insert_checkpoint(
        self,
        chain: Chain,
        position: int,
        payload: object,
        reason: CheckpointReason,
        supersedes: bool = True,
    ) -> InsertResult:
        """Store the state after `position` tokens of `chain`, then thin periodic checkpoints
        on its path. `supersedes` False: a warm-up's guess, past the model's own output,
        makes no older checkpoint redundant (supersede.py), as a generation end makes none."""
        assert isinstance(reason, CheckpointReason), (
            f"checkpoint reason {reason!r} is not a CheckpointReason"
        )
        assert 0 < position <= len(chain), f"checkpoint at {position} of {len(chain)} tokens"
        assert chain.block_size == self.block_size, f"chain of {chain.block_size}-token blocks"
        nbytes = _payload_nbytes(payload)
        anchor = chain.anchor(position // self.block_size)
        with self._lock:
            ckpt, created = self._checkpoints.insert(
                anchor, chain.tail(position), position, reason, payload, nbytes
            )
            if not created:
                self._dedupe_hits += 1
                self._checkpoints.refresh(ckpt)
            elif self._ghosts.came_back(ckpt.key):
                ckpt.reads = SEEN_AGAIN
            thins = self.thin_periodic and not (
                self.keep_newest_periodic and reason is not CheckpointReason.PERIODIC
            )
            thinned = self._checkpoints.thin(chain, ckpt) if thins else []
            self._thinned += len(thinned)
            if supersedes:
                self._superseded += mark_superseded(self._pool, self._checkpoints, chain, ckpt)
            evicted = self._evict_to_budget()
        self._spill(evicted)
        return InsertResult(int(created), int(not created), len(thinned), len(evicted))

    # ---- budget -------------------------------------------------------------------------

    def reserve(self, nbytes: int) -> bool:
        """Set aside budget before promoting `nbytes` from SSD; False if pinned data leaves no room.

        Call `unreserve(nbytes)` before inserting the promoted entries, or after giving up.
        """
        assert nbytes >= 0, f"reserve of {nbytes} bytes"
        with self._lock:
            evicted = self._make_room(nbytes)
            if evicted is None:
                self._reserve_failures += 1
                return False
            self._reserved += nbytes
        self._spill(evicted)
        return True

    def set_budget(self, budget_bytes: int) -> int:
        """Change the byte budget; a smaller one evicts (and spills) LRU entries at once.

        Returns the bytes evicted. Pinned entries stay, so the tier may stay above a budget
        smaller than what running requests hold until they release it.
        """
        assert budget_bytes >= 0, f"budget {budget_bytes}"
        with self._lock:
            self.budget_bytes = budget_bytes
            evicted = self._evict_to_budget()
            reclaimers = list(self._reclaimers)
        self._spill(evicted)
        freed = sum(e.nbytes for e in evicted)
        # Still over with nothing unpinned left: ask the charged bytes' holders (outside the
        # lock: they take their own, then call `credit`).
        for reclaim in reclaimers:
            with self._lock:
                over = min(self._held() - budget_bytes, self._charged)
            if over <= 0:
                break
            freed += reclaim(over)
        return freed

    def ghost_hits(self) -> GhostHits:
        """Evicted entries that came back into RAM since the last call (ghosts.py)."""
        with self._lock:
            return self._ghosts.take()

    def ghost_bytes_waiting(self) -> int:
        """Bytes of evicted entries that came back since `ghost_hits` last took them."""
        with self._lock:
            return self._ghosts.waiting_bytes

    def add_reclaimer(self, reclaim: Reclaim) -> None:
        """Let a holder of charged bytes be asked for them when the budget shrinks."""
        with self._lock:
            self._reclaimers.append(reclaim)

    def remove_reclaimer(self, reclaim: Reclaim) -> None:
        with self._lock:
            if reclaim in self._reclaimers:
                self._reclaimers.remove(reclaim)

    def unreserve(self, nbytes: int) -> None:
        with self._lock:
            assert 0 <= nbytes <= self._reserved, f"unreserve {nbytes} of {self._reserved} bytes"
            self._reserved -= nbytes

    def charge(self, nbytes: int) -> bool:
        """Count `nbytes` held outside the tier (a vision model's encoder output) against
        the budget, evicting LRU entries to make room; False if pinned data leaves none.
        Hand them back with `credit`."""
        assert nbytes >= 0, f"charge of {nbytes} bytes"
        with self._lock:
            evicted = self._make_room(nbytes)
            if evicted is None:
                return False
            self._charged += nbytes
        self._spill(evicted)
        return True

    def credit(self, nbytes: int) -> None:
        with self._lock:
            assert 0 <= nbytes <= self._charged, f"credit {nbytes} of {self._charged} bytes"
            self._charged -= nbytes

    def _held(self) -> int:
        """Bytes counted against the budget: stored, reserved and charged (lock held)."""
        stored = self._pool.nbytes + self._checkpoints.nbytes
        return stored + self._reserved + self._charged

    def _make_room(self, nbytes: int) -> list[Entry] | None:
        """Evict for `nbytes` more (lock held): the entries evicted, or None (nothing
        evicted) when what is pinned, reserved and charged leaves no room."""
        if self._held() - self._lru.nbytes + nbytes > self.budget_bytes:
            return None
        return self._evict_to_budget(nbytes)

    def _evict_to_budget(self, incoming: int = 0) -> list[Entry]:
        """Evict LRU entries until stored + reserved + charged + incoming bytes fit."""
        evicted: list[Entry] = []
        spare = int(self.protect_frequent * self.budget_bytes)
        while self._held() + incoming > self.budget_bytes and len(self._lru):
            entry = self._lru.popleft()
            if entry.reads >= 2 and entry.nbytes <= spare:
                spare -= entry.nbytes
                entry.reads //= 2  # aged: spared again only if it is read again
                self._lru.append(entry)
                continue
            self._forget(entry)
            if entry.kind is EntryKind.BLOCK:
                self._evicted_blocks += 1
            else:
                self._evicted_checkpoints += 1
            self._evicted_bytes += entry.nbytes
            evicted.append(entry)
        self.evicted.add(e.key for e in evicted)
        self._ghosts.add(evicted)
        return evicted

    def _forget(self, entry: Entry) -> None:
        if entry.kind is EntryKind.BLOCK:
            self._pool.remove(entry)
        else:
            self._checkpoints.remove(entry)

    def _spill(self, evicted: list[Entry]) -> None:
        if self.on_evict is None:
            return
        for entry in evicted:
            try:
                self.on_evict(entry)
            except Exception:
                # A failed spill loses one entry to recompute later; the RAM tier is intact.
                log.exception("on_evict failed for %r", entry)
                with self._lock:
                    self._spill_errors += 1

    # ---- sessions (engine_bridge/sessions/catalog.py) -------------------------------------------

    def hold(self, ids: Sequence[tuple[EntryKind, BlockHash]]) -> list[Entry]:
        """Reference the entries of `ids` RAM holds now, so eviction skips them (a pinned
        session); hand them back with `unhold`."""
        held = []
        with self._lock:
            for kind, key in ids:
                store = self._pool if kind is EntryKind.BLOCK else self._checkpoints
                entry = store.get(key)
                if entry is not None:
                    store.acquire(entry)
                    held.append(entry)
        return held

    def unhold(self, entries: Sequence[Entry]) -> None:
        with self._lock:
            for entry in entries:
                (self._pool if entry.kind is EntryKind.BLOCK else self._checkpoints).release(entry)
            evicted = self._evict_to_budget()
        self._spill(evicted)

    def discard(self, ids: Sequence[tuple[EntryKind, BlockHash]]) -> tuple[int, int]:
        """Drop the unreferenced entries of `ids` without spilling them (a deleted session);
        returns (entries, bytes) dropped. Entries a running request holds stay."""
        n = nbytes = 0
        with self._lock:
            for kind, key in ids:
                entry = (self._pool if kind is EntryKind.BLOCK else self._checkpoints).get(key)
                if entry is not None and entry.ref_cnt == 0:
                    self._forget(entry)
                    if kind is EntryKind.CHECKPOINT:
                        entry.superseded = True  # a write still waiting for it is dropped
                    n += 1
                    nbytes += entry.nbytes
        return n, nbytes

    # ---- accounting ---------------------------------------------------------------------

    def stats(self) -> CacheStats:
        with self._lock:
            stored = self._pool.nbytes + self._checkpoints.nbytes
            return CacheStats(
                blocks=len(self._pool),
                checkpoints=len(self._checkpoints),
                bytes=stored,
                block_bytes=self._pool.nbytes,
                checkpoint_bytes=self._checkpoints.nbytes,
                pinned_bytes=stored - self._lru.nbytes,
                reserved_bytes=self._reserved,
                budget_bytes=self.budget_bytes,
                evicted_blocks=self._evicted_blocks,
                evicted_checkpoints=self._evicted_checkpoints,
                evicted_bytes=self._evicted_bytes,
                dedupe_hits=self._dedupe_hits,
                thinned_checkpoints=self._thinned,
                reserve_failures=self._reserve_failures,
                spill_errors=self._spill_errors,
                superseded_checkpoints=self._superseded,
                charged_bytes=self._charged,
            )
