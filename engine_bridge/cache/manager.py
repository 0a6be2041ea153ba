"""The RAM tier: find where a request can resume, pin what it restores, store what it computed.

Eviction is LRU by bytes over one queue holding unreferenced blocks and checkpoints. A
request's entries are released deepest first and blocks are inserted deepest first, so
within a conversation the leaves are evicted before the prefix they hang from; an evicted
block only cuts RAM lookups short at the hole (the SSD tier, fed by `on_evict`, can fill it).
"""

from __future__ import annotations

import logging
import operator
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from engine_bridge.cache.checkpoints import REASONS, Checkpoint, CheckpointStore, Reason
from engine_bridge.cache.hashing import (
    BLOCK_SIZE,
    BlockHash,
    ExtraKeys,
    anchors,
    chain_root,
    hash_chain,
)
from engine_bridge.cache.matching import Match, find_match
from engine_bridge.cache.pool import Block, BlockPool, FreeQueue

log = logging.getLogger(__name__)

EntryKind = Literal["block", "checkpoint"]
# on_evict(kind, hash, tokens, payload): for a block its hash and tokens, for a checkpoint
# its anchor and tail. Called after the cache's lock is released.
OnEvict = Callable[[EntryKind, BlockHash, tuple[int, ...], object], None]


@dataclass(slots=True, frozen=True)
class InsertResult:
    inserted: int
    deduped: int
    thinned: int = 0
    evicted: int = 0


@dataclass(slots=True, frozen=True)
class CacheStats:
    """A snapshot of the RAM tier and of the requests the runner recorded."""

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
    requests: int
    prompt_tokens: int
    cached_tokens: int
    requests_by_source: dict[str, int] = field(default_factory=dict)

    @property
    def token_hit_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


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
    ) -> None:
        assert budget_bytes >= 0 and block_size > 0, f"budget {budget_bytes}, block {block_size}"
        self.budget_bytes = budget_bytes
        self.block_size = block_size
        self.on_evict = on_evict
        self.thin_periodic = thin_periodic
        # The runner's worker thread mutates; the event loop thread reads stats.
        self._lock = threading.Lock()
        self._lru = FreeQueue()
        self._pool = BlockPool(self._lru)
        self._checkpoints = CheckpointStore(self._lru)
        self._reserved = 0
        self._evicted_blocks = 0
        self._evicted_checkpoints = 0
        self._evicted_bytes = 0
        self._dedupe_hits = 0
        self._thinned = 0
        self._reserve_failures = 0
        self._spill_errors = 0
        self._requests = 0
        self._prompt_tokens = 0
        self._cached_tokens = 0
        self._by_source: dict[str, int] = {}

    # ---- lookup -------------------------------------------------------------------------

    def match(
        self, tokens: Sequence[int], extra_keys: ExtraKeys = (), *, needs_checkpoint: bool
    ) -> Match:
        """The deepest restorable position P < len(tokens), so at least one token is prefilled.

        With `needs_checkpoint` (snapshot layers), P must be a checkpoint's exact position.
        """
        tokens = tuple(tokens)
        hashes = tuple(hash_chain(tokens, self.block_size, extra_keys))
        root = chain_root(extra_keys)
        with self._lock:
            return find_match(
                self._pool,
                self._checkpoints,
                tokens,
                hashes,
                root,
                self.block_size,
                needs_checkpoint,
            )

    def has_block(self, block_hash: BlockHash) -> bool:
        with self._lock:
            return block_hash in self._pool

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
            for block in match.blocks:
                self._pool.acquire(block)
            if ckpt is not None:
                self._checkpoints.acquire(ckpt)
            match.pinned = True
            return True

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

    def insert_blocks(
        self,
        tokens: Sequence[int],
        extra_keys: ExtraKeys,
        payloads_by_block_index: Mapping[int, object],
    ) -> InsertResult:
        """Store full blocks of `tokens`; a block already cached keeps its payload (dedupe)."""
        tokens = tuple(tokens)
        bs = self.block_size
        hashes = hash_chain(tokens, bs, extra_keys)
        root = chain_root(extra_keys)
        inserted = deduped = 0
        with self._lock:
            # Deepest first, so the shallow blocks other requests share end up most recent.
            for i in sorted(payloads_by_block_index, reverse=True):
                assert 0 <= i < len(hashes), f"block {i} of a {len(tokens)}-token sequence"
                payload = payloads_by_block_index[i]
                parent = root if i == 0 else hashes[i - 1]
                block, created = self._pool.insert(
                    hashes[i],
                    parent,
                    tokens[i * bs : (i + 1) * bs],
                    payload,
                    _payload_nbytes(payload),
                )
                if created:
                    inserted += 1
                else:
                    deduped += 1
                    self._pool.refresh(block)
            self._dedupe_hits += deduped
            evicted = self._evict_to_budget()
        self._spill(evicted)
        return InsertResult(inserted, deduped, evicted=len(evicted))

    def insert_checkpoint(
        self, tokens_prefix: Sequence[int], extra_keys: ExtraKeys, payload: object, reason: Reason
    ) -> InsertResult:
        """Store the state after `tokens_prefix`, then thin periodic checkpoints on its path."""
        assert reason in REASONS, f"checkpoint reason {reason!r} not in {sorted(REASONS)}"
        tokens = tuple(tokens_prefix)
        assert tokens, "a checkpoint at position 0 restores nothing"
        bs = self.block_size
        k = len(tokens) // bs
        path = anchors(chain_root(extra_keys), hash_chain(tokens, bs, extra_keys), k)
        nbytes = _payload_nbytes(payload)
        with self._lock:
            ckpt, created = self._checkpoints.insert(
                path[k], tokens[k * bs :], len(tokens), reason, payload, nbytes
            )
            if not created:
                self._dedupe_hits += 1
                self._checkpoints.refresh(ckpt)
            thinned = self._checkpoints.thin(path, tokens, ckpt, bs) if self.thin_periodic else []
            self._thinned += len(thinned)
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
            stored = self._pool.nbytes + self._checkpoints.nbytes
            pinned = stored - self._lru.nbytes
            if pinned + self._reserved + nbytes > self.budget_bytes:
                self._reserve_failures += 1
                return False
            evicted = self._evict_to_budget(nbytes)
            self._reserved += nbytes
        self._spill(evicted)
        return True

    def unreserve(self, nbytes: int) -> None:
        with self._lock:
            assert 0 <= nbytes <= self._reserved, f"unreserve {nbytes} of {self._reserved} bytes"
            self._reserved -= nbytes

    def clear(self) -> int:
        """Drop every unreferenced entry without spilling it; returns how many."""
        with self._lock:
            count = len(self._lru)
            while len(self._lru):
                self._forget(self._lru.popleft())
            return count

    def _evict_to_budget(self, incoming: int = 0) -> list[Block | Checkpoint]:
        """Evict LRU entries until stored + reserved + incoming bytes fit the budget."""
        evicted: list[Block | Checkpoint] = []
        while (
            self._pool.nbytes + self._checkpoints.nbytes + self._reserved + incoming
            > self.budget_bytes
            and len(self._lru)
        ):
            entry = self._lru.popleft()
            self._forget(entry)
            if isinstance(entry, Block):
                self._evicted_blocks += 1
            else:
                self._evicted_checkpoints += 1
            self._evicted_bytes += entry.nbytes
            evicted.append(entry)
        return evicted

    def _forget(self, entry: Block | Checkpoint) -> None:
        if isinstance(entry, Block):
            self._pool.remove(entry)
        else:
            self._checkpoints.remove(entry)

    def _spill(self, evicted: list[Block | Checkpoint]) -> None:
        if self.on_evict is None:
            return
        for entry in evicted:
            try:
                if isinstance(entry, Block):
                    self.on_evict("block", entry.hash, entry.tokens, entry.payload)
                else:
                    self.on_evict("checkpoint", entry.anchor, entry.tail, entry.payload)
            except Exception:
                # A failed spill loses one entry to recompute later; the RAM tier is intact.
                log.exception("on_evict failed for %r", entry)
                with self._lock:
                    self._spill_errors += 1

    # ---- accounting ---------------------------------------------------------------------

    def record_request(self, prompt_tokens: int, cached_tokens: int, source: str) -> None:
        """Count one request; the runner knows the final source (ram, ssd or none)."""
        assert 0 <= cached_tokens <= prompt_tokens, f"{cached_tokens} of {prompt_tokens} cached"
        with self._lock:
            self._requests += 1
            self._prompt_tokens += prompt_tokens
            self._cached_tokens += cached_tokens
            self._by_source[source] = self._by_source.get(source, 0) + 1

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
                requests=self._requests,
                prompt_tokens=self._prompt_tokens,
                cached_tokens=self._cached_tokens,
                requests_by_source=dict(self._by_source),
            )
