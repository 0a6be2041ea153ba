"""The prompt cache as the runner sees it: one session per request over the cache tiers.

A session restores the deepest cached state for the request's tokens, says where prefill
must pause so that checkpoints land on message starts, and stores what the request
computed at each save point (prefill chunks, end of prompt, end of generation).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mlx_lm.models.cache import make_prompt_cache

from . import kv
from .cache.checkpoints import REASONS
from .cache.hashing import BlockHash, ExtraKeys, chain_root, checkpoint_key, hash_chain
from .cache.manager import CacheManager, EntryKind
from .models import LoadedModel
from .runner import Job
from .ssd_tier import SSDTier, Stored, scope_for
from .types import CacheSource

log = logging.getLogger("engine_bridge.prompt_cache")


@dataclass(slots=True)
class CachePolicy:
    block_size: int = 64
    # Snapshot models also checkpoint every this many tokens of a long prefill.
    checkpoint_interval: int = 1024
    # 0 keeps K/V exact; 8 or 4 quantizes stored blocks (smaller, slightly lossy).
    quantize_bits: int = 0
    # Log, once per request, where a prompt left the nearest cached sequence.
    log_divergence: bool = True


class ModelCache:
    """The prompt cache of one loaded model, over the process-wide RAM tier."""

    def __init__(
        self,
        loaded: LoadedModel,
        ram: CacheManager,
        policy: CachePolicy,
        ssd: SSDTier | None = None,
    ):
        self.loaded = loaded
        self.ram = ram
        self.policy = policy
        self.ssd = ssd
        self.layout = kv.layout(make_prompt_cache(loaded.model))
        self.needs_checkpoint = self.layout.has_snapshots

    def extra_keys(self, tenant: str) -> ExtraKeys:
        keys: list[tuple[str, str]] = [("model", self.loaded.fingerprint), ("tenant", tenant)]
        if self.policy.quantize_bits:
            # Quantized blocks must never be served to a run that expects exact ones.
            keys.append(("kv_bits", str(self.policy.quantize_bits)))
        return tuple(keys)

    def session(self, job: Job) -> CacheSession:
        return CacheSession(self, job)


class CacheSession:
    """One request's view of the cache; lives on the model's worker thread."""

    def __init__(self, owner: ModelCache, job: Job):
        self.owner = owner
        self.job = job
        self.bs = owner.policy.block_size
        self.extra = owner.extra_keys(job.request.tenant)
        self.scope = scope_for(owner.loaded.fingerprint, job.request.tenant)
        self.tokens = job.prompt.tokens
        self._chain = hash_chain(self.tokens, self.bs, self.extra)
        self._stored_blocks = 0  # blocks [0, n) are known to be in the RAM tier

    # -- restore ---------------------------------------------------------------------------

    def restore(self) -> tuple[list[Any], int, CacheSource]:
        owner = self.owner
        model = owner.loaded.model
        source: CacheSource = "ram"
        match = owner.ram.match(self.tokens, self.extra, needs_checkpoint=owner.needs_checkpoint)
        # RAM already reaching the last prompt token leaves the SSD nothing to add. Count
        # full blocks of this chain only: a paged hit that ends mid-block may end in a
        # sibling's block, which is not on the request's chain.
        deeper = match.length < len(self.tokens) - 1
        if owner.ssd is not None and deeper:
            if self._promote(match.length, match.length // self.bs):
                source = "ssd"
                match = owner.ram.match(
                    self.tokens, self.extra, needs_checkpoint=owner.needs_checkpoint
                )
        for _ in range(3):  # an eviction between match and acquire: look again
            if match.length == 0 or owner.ram.acquire(match):
                break
            match = owner.ram.match(
                self.tokens, self.extra, needs_checkpoint=owner.needs_checkpoint
            )
        else:
            match = None
        if match is None or match.length == 0:
            self._log_divergence(0)
            return make_prompt_cache(model), 0, "none"
        try:
            ckpt = match.checkpoint.payload.payload if match.checkpoint is not None else None
            blocks = [b.payload.payload for b in match.blocks]
            cache = kv.restore(model, blocks, match.length, ckpt)
        finally:
            owner.ram.release(match)
        self._stored_blocks = match.length // self.bs
        self._log_divergence(match.length)
        return cache, match.length, source

    def _log_divergence(self, restored: int) -> None:
        """Say once where this prompt left the nearest cached sequence, when it did."""
        if not self.owner.policy.log_divergence:
            return
        m = self.owner.ram.match(self.tokens, self.extra, needs_checkpoint=False)
        lcp = m.length
        if lcp == 0 or lcp >= len(self.tokens) - 1:
            return
        # Only a cached entry cut short is a divergence; a prompt that simply runs past the
        # end of what is cached (the next turn of a conversation) is the normal case.
        if m.checkpoint is not None:
            diverged = m.checkpoint_tokens < len(m.checkpoint.tail)
        else:
            diverged = bool(m.blocks) and m.used_tokens < self.bs
        if not diverged:
            return
        prompt = self.job.prompt
        tok = self.owner.loaded.tokenizer
        before = tok.decode(self.tokens[max(0, lcp - 12) : lcp])
        after = tok.decode(self.tokens[lcp : lcp + 12])
        log.info(
            "prompt diverges from the cache at token %d of %d (message %s): %r | %r; restored %d",
            lcp,
            len(self.tokens),
            prompt.message_at(lcp),
            before,
            after,
            restored,
        )

    # -- save points -----------------------------------------------------------------------

    def stop_points(self) -> list[int]:
        if not self.owner.needs_checkpoint:
            return []
        interval = self.owner.policy.checkpoint_interval
        points = set(self.job.prompt.message_starts)
        points.update(range(interval, len(self.tokens), interval))
        return sorted(points)

    def save(self, cache: list[Any], tokens: Sequence[int], position: int, reason: str) -> None:
        """Store the blocks completed up to `position`, and a checkpoint where one is due."""
        tokens = list(tokens)
        if len(tokens) > len(self.tokens):
            self.tokens = tokens
            self._chain = hash_chain(tokens, self.bs, self.extra)
        self._store_blocks(cache, tokens, position)
        ckpt_reason = self._checkpoint_reason(position, reason)
        if ckpt_reason is not None:
            payload = kv.extract_checkpoint(cache, position, self.bs)
            k = position // self.bs
            anchor = chain_root(self.extra) if k == 0 else self._chain[k - 1]
            key = checkpoint_key(anchor, tokens[k * self.bs : position])
            stored = Stored(payload, self.scope, key, ckpt_reason)
            self.owner.ram.insert_checkpoint(tokens[:position], self.extra, stored, ckpt_reason)
            self._write_through(stored, "checkpoint", position)

    def _store_blocks(self, cache: list[Any], tokens: list[int], position: int) -> None:
        full = position // self.bs
        if full <= self._stored_blocks:
            return
        ram = self.owner.ram
        missing = [i for i in range(self._stored_blocks, full) if not ram.has_block(self._chain[i])]
        payloads: dict[int, Any] = {}
        for lo, hi in _runs(missing):
            for j, b in enumerate(kv.extract_blocks(cache, lo, hi, self.bs)):
                i = lo + j
                payloads[i] = Stored(self._maybe_quantize(b), self.scope, self._chain[i], "block")
        if payloads:
            ram.insert_blocks(tokens[: full * self.bs], self.extra, payloads)
            for stored in payloads.values():
                self._write_through(stored, "block", self.bs)
        self._stored_blocks = full

    def _maybe_quantize(self, block: kv.BlockPayload) -> kv.BlockPayload:
        bits = self.owner.policy.quantize_bits
        # Groups of 32 fit every head dim that is a multiple of 32 (64 would skip 32-wide
        # heads), at a small cost in scales.
        return kv.quantize_block(block, bits=bits, group_size=32) if bits else block

    def _checkpoint_reason(self, position: int, reason: str) -> str | None:
        if reason == "prefill":
            if not self.owner.needs_checkpoint:
                return None
            if position in self.job.prompt.message_starts:
                return "boundary"
            if position % self.owner.policy.checkpoint_interval == 0:
                return "periodic"
            return None
        if position % self.bs == 0 and not self.owner.needs_checkpoint:
            return None  # the blocks already hold everything a paged model needs
        return reason  # prompt_end / generation_end

    # -- SSD tier --------------------------------------------------------------------------

    def _write_through(self, stored: Stored, kind: EntryKind, tokens: int) -> None:
        ssd = self.owner.ssd
        if ssd is not None and ssd.write_through:
            ssd.write(stored, kind, tokens, "write_through")

    def _promote(self, ram_length: int, ram_blocks: int) -> bool:
        """Bring what the SSD holds past the RAM hit into RAM; True if the hit grew."""
        ssd = self.owner.ssd
        assert ssd is not None
        bs, tokens = self.bs, self.tokens
        last = len(tokens) - 1  # always leave one token to prefill
        present = ssd.present_blocks(self.scope, self._chain, self.owner.ram.has_block)
        usable = max(present, ram_blocks)
        reach = min(last, usable * bs + bs - 1)  # a checkpoint can sit inside the next block
        ram = self.owner.ram
        # Pin what RAM holds of the path: under a tight budget it is the least recently used
        # part, and inserting the promoted entries would evict the very prefix they extend.
        held = ram.match(tokens, self.extra, needs_checkpoint=False)
        pinned = ram.acquire(held)
        try:
            # A corrupt entry on disk is quarantined and read as a miss: then fall back to
            # the next shallower checkpoint rather than to nothing.
            for _ in range(4):
                found = self._find_target(ram_length, usable, reach)
                if found is None or found[0] <= ram_length:
                    return False
                outcome = self._read_into_ram(*found, ram_length)
                if isinstance(outcome, bool):
                    return outcome
                reach = outcome
            return False
        finally:
            if pinned:
                ram.release(held)

    def _find_target(
        self, ram_length: int, usable: int, reach: int
    ) -> tuple[int, BlockHash | None] | None:
        """The deepest position the SSD can restore up to `reach`, and its checkpoint key."""
        ssd, bs, tokens = self.owner.ssd, self.bs, self.tokens
        assert ssd is not None
        root = chain_root(self.extra)
        if self.owner.needs_checkpoint:
            return ssd.find_checkpoint(self.scope, root, self._chain, tokens, bs, ram_length, reach)
        # Paged layers restore from blocks alone; a checkpoint only adds its partial tail.
        base = min(usable * bs, len(tokens) - 1, reach)
        lo = max(ram_length, base)
        found = ssd.find_checkpoint(self.scope, root, self._chain, tokens, bs, lo, reach)
        return found if found is not None else (base, None)

    def _read_into_ram(
        self, target: int, ckpt_key: BlockHash | None, ram_length: int
    ) -> bool | int:
        """Promote what `target` needs; True/False when done, or a lower reach to retry with."""
        ssd, ram, bs, tokens = self.owner.ssd, self.owner.ram, self.bs, self.tokens
        assert ssd is not None
        snapshots = self.owner.needs_checkpoint
        need_blocks = target // bs if ckpt_key is not None else -(-target // bs)
        for i in range(need_blocks):
            if ram.has_block(self._chain[i]):
                continue
            stored = ssd.read(ram, self.scope, "block", self._chain[i])
            if stored is None:
                # Blocks [0, i) are in RAM now: a paged model uses them as they are, a
                # snapshot model needs a checkpoint no deeper than block i.
                return i * bs + bs - 1 if snapshots else i * bs > ram_length
            ram.insert_blocks(tokens[: (i + 1) * bs], self.extra, {i: stored})
        if ckpt_key is not None:
            stored = ssd.read(ram, self.scope, "checkpoint", ckpt_key)
            if stored is None:  # the blocks alone still serve a paged model
                return target - 1 if snapshots else need_blocks * bs > ram_length
            reason = stored.reason if stored.reason in REASONS else "boundary"
            ram.insert_checkpoint(tokens[:target], self.extra, stored, reason)
        return True


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """Sorted indices as half-open runs of consecutive values: [1,2,3,7] → [(1,4), (7,8)]."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs
