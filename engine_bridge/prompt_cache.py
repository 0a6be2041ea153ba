"""The prompt cache as the runner sees it: one session per request over the cache tiers.

A session restores the deepest cached state for the request's tokens, says where prefill
must pause so that checkpoints land on message starts, and stores what the request
computed at each save point (prefill chunks, end of prompt, end of generation).

Before the request is queued, `read_ahead` reads what its lookup needs below RAM (the
SSD's index and files, the shared store), and its images' features RAM lacks, on the tiers'
I/O threads, each tier under a deadline (cache/tier_reads.py); `restore`, on the MLX
thread, then looks up RAM and those bytes, promotes them and hands the features its
prefill needs to the vision feature cache, with no I/O of its own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import kv
from .cache.hashing import Chain, ExtraKeys
from .cache.kinds import CheckpointReason, EntryKind, SavePoint
from .cache.ram.matching import Match
from .cache.session_registry import SessionKey
from .cache.ssd.index import Scope
from .cache.tier_reads import Below, Prefetched
from .cache.tiers import Hit, TieredCache
from .distributed.world import ALONE, World
from .engine_settings import CachePolicy
from .models.loading import LoadedModel
from .scheduling.jobs import Job
from .types import CacheSource

if TYPE_CHECKING:
    from .cache.ssd.store import SSDEntry
    from .sessions.catalog import ClientSessions
    from .vision.features import FeatureCache

log = logging.getLogger("engine_bridge.prompt_cache")

# Across ranks, how many times the ranks offer a shallower resume point before all of
# them compute the whole prompt (in practice they agree at once: see `_agree`).
AGREE_ROUNDS = 4
# Text shown either side of a divergence: enough tokens to fill this many characters.
_CONTEXT_CHARS = 40
_CONTEXT_TOKENS = 24


@dataclass(slots=True)
class LookupReport:
    """What one request's lookup found, for its response header and the request log."""

    restored: int  # tokens the cache gave
    diverged_at: int | None  # where the prompt left a sequence RAM holds, if it did
    # Where this model can resume: any block boundary, or only at checkpoints (snapshot
    # layers), which prefill takes at message starts and every `checkpoint_interval`.
    block_size: int
    snapshots: bool
    checkpoint_interval: int
    # What came next was dropped lately: "evicted_ram", "evicted_ssd" or "expired".
    lost: str | None = None
    # Tiers whose read-ahead missed its deadline, so they were a miss: "ssd", "shared";
    # and how far the deepest of them said it reached before it was left behind (0: it
    # did not get that far).
    late: tuple[str, ...] = ()
    late_reach: int = 0
    message: int | None = None  # the message the divergence falls in
    before: str = ""  # the text just before and after the divergence
    after: str = ""


class ModelCache:
    """The prompt cache of one loaded model, over the process-wide tiers."""

    def __init__(
        self,
        loaded: LoadedModel,
        tiers: TieredCache,
        policy: CachePolicy,
        sessions: ClientSessions | None = None,
        world: World = ALONE,
    ):
        self.loaded = loaded
        # A split model: every rank holds its slice of each entry in its own tiers, under
        # its own layout's fingerprint, and the ranks agree on where each request resumes.
        self.world = world
        self.tiers = tiers
        self.policy = policy
        self.sessions = sessions  # told what each client session stored and used
        self.layout = kv.layout(kv.make_prompt_cache(loaded.model))
        self.needs_checkpoint = self.layout.has_snapshots

    def extra_keys(self, tenant: str) -> ExtraKeys:
        keys: list[tuple[str, str]] = [("model", self.loaded.fingerprint), ("tenant", tenant)]
        if self.policy.quantize_bits:
            # Quantized blocks must never be served to a run that expects exact ones.
            keys.append(("kv_bits", str(self.policy.quantize_bits)))
        return tuple(keys)

    def session(self, job: Job) -> CacheSession:
        return CacheSession(self, job)

    def probe(
        self, job: Job, below: Below | None = None, session: CacheSession | None = None
    ) -> tuple[Hit, int]:
        """What `job`'s lookup would find, and how far this machine's tiers (RAM and SSD)
        reach of it. It only reads: nothing promoted, pinned, reordered or written (no
        `catch_up`, which a request's restore makes first). `below`: what the tiers under
        RAM answered ahead on their I/O threads (cache_probe.survey), so the MLX thread
        does no I/O here; without it they are asked on this thread. `session`: `job`'s,
        its prompt already hashed."""
        session = session or self.session(job)
        needs = self.needs_checkpoint
        hit = self.tiers.lookup(session.chain, session.scope, needs_checkpoint=needs, below=below)
        return hit, self.tiers.local_length(hit)


class CacheSession:
    """One request's view of the cache; lives on the model's worker thread."""

    def __init__(self, owner: ModelCache, job: Job):
        self.owner = owner
        self.job = job
        self.tiers = owner.tiers
        self.bs = owner.policy.block_size
        self._checkpointed_at: int | None = None  # where this request stored its last one
        tenant = job.request.tenant
        # Hashed once here; every tier and every save point works on these hashes.
        self.chain = Chain(job.prompt.tokens, self.bs, owner.extra_keys(tenant))
        self.scope = Scope.of(owner.loaded.fingerprint, tenant)
        self._stored_blocks = 0  # blocks [0, n) are known to be in the RAM tier
        session = job.request.session
        self.session_key = (
            SessionKey(tenant, owner.loaded.id, session)
            if session and owner.sessions is not None
            else None
        )
        self.lookup: LookupReport | None = None  # set by `restore`
        self._read: Prefetched | None = None  # set by `read_ahead`, taken by `restore`

    def decode(self, tokens: list[int]) -> str:
        """Text of `tokens` (the request log quotes what a client changed)."""
        return self.owner.loaded.tokenizer.decode(tokens)

    # -- restore ---------------------------------------------------------------------------

    async def read_ahead(self) -> None:
        """Read what this request's lookup needs below RAM on the tiers' I/O threads, while
        the request waits here, before it is queued for the MLX thread; with it, its
        images' features RAM lacks (the prefill may need them: `restore` hands them over)."""
        snapshots = self.owner.needs_checkpoint
        starts = self.job.prompt.message_starts if snapshots else ()
        features, images = self._images()
        digests = features.missing(self.job.request.tenant, list(images)) if features else []
        self._read = await self.tiers.reads.prefetch(
            self.chain, self.scope, snapshots, starts, digests
        )

    def _images(self) -> tuple[FeatureCache | None, dict[bytes, int]]:
        """The model's feature cache and, by digest, where the prompt's images end (the
        last one of a digest); (None, {}) without images."""
        seeing, vision = self.owner.loaded.vision, self.job.prompt.vision
        if seeing is None or vision is None or not vision.images:
            return None, {}
        ends: dict[bytes, int] = {}
        for image in vision.images:
            ends[image.digest] = max(ends.get(image.digest, 0), image.end)
        return seeing.feature_cache, ends

    def _take_features(self, read: Prefetched | None) -> dict[bytes, tuple[SSDEntry, bool]]:
        """The features read ahead for the prompt's images, by digest: (entry, shared)."""
        if read is None:
            return {}
        taken = ((d, read.take(EntryKind.FEATURES, d)) for d in self._images()[1])
        return {d: got for d, got in taken if got is not None}

    def _adopt_features(self, taken: dict[bytes, tuple[SSDEntry, bool]], restored: int) -> None:
        """Into the feature cache, those the prefill from `restored` on needs (an image
        inside the restored prefix needs none): the MLX thread makes their arrays."""
        features, ends = self._images()
        for digest, (entry, shared) in taken.items():
            if ends[digest] > restored:
                features.adopt(self.job.request.tenant, digest, entry.tensors, shared)

    def discard(self) -> None:
        """Let go of what was read ahead for a request that never reached `restore`."""
        read, self._read = self._read, None
        if read is not None:
            read.close()

    def restore(self) -> tuple[list[Any], int, CacheSource]:
        model = self.owner.loaded.model
        snapshots = self.owner.needs_checkpoint
        # The writes a request makes first (lost entries, due checkpoints), then a lookup
        # that only reads: RAM, and below it what was read ahead (without a read-ahead,
        # which only a cache with no tier below RAM skips, the tiers themselves).
        self.tiers.catch_up(self.scope, needs_checkpoint=snapshots)
        read, self._read = self._read, None
        try:
            hit = self.tiers.lookup(self.chain, self.scope, needs_checkpoint=snapshots, below=read)
            promoted = hit.ssd is not None and self.tiers.promote(hit)
            features = self._take_features(read)
        finally:
            if read is not None:
                read.close()  # promoted: arrays now; the rest is not needed
        source: CacheSource = ("shared" if hit.from_shared else "ssd") if promoted else "ram"
        # Pinned, so nothing is evicted before the copy below is taken; every step up to
        # the copy sits inside the `try`, since an entry left pinned is never evicted.
        match = self.tiers.pin(hit, promoted=promoted)
        try:
            match = self._agree(match)
            self._adopt_features(features, match.length)
            self.lookup = self._report(hit, match.length, read)
            self._log_divergence(self.lookup)
            ckpt_used = match.checkpoint
            self._note(match.length // self.bs, ckpt_used and (ckpt_used.key, ckpt_used.position))
            if match.length == 0:
                return kv.make_prompt_cache(model), 0, "none"
            ckpt = match.checkpoint.payload.payload if match.checkpoint is not None else None
            blocks = [b.payload.payload for b in match.blocks]
            cache = kv.restore(model, blocks, match.length, ckpt)
        finally:
            if match.pinned:  # a miss is not pinned
                self.tiers.ram.release(match)
        self._stored_blocks = match.length // self.bs
        return cache, match.length, source

    def _agree(self, match: Match) -> Match:
        """Where every rank resumes: the deepest position all of them restore.

        Each rank looks up its own tiers: the same requests stored the same entries at the
        same save points, so they nearly always agree at once. One that lost a slice (a
        file gone, a write the disk refused, a different eviction) holds less, and then
        every rank takes a shallower match of its own, so that no rank runs ahead of the
        others with a state they lack. Each step is a collective, so every rank takes the
        same branches. `match` is pinned (unless a miss); so is the one returned."""
        world = self.owner.world
        if world.alone:
            return match
        ram = self.tiers.ram
        try:
            for _ in range(AGREE_ROUNDS):
                agreed = world.least(match.length)
                if world.all_ok(match.length == agreed):
                    return match
                if match.length > agreed:
                    if match.pinned:
                        ram.release(match)
                    # RAM now holds what promotion brought up: the capped chain's deepest
                    # resume point within it, at `agreed` or shallower.
                    capped = self.chain.prefix(agreed + 1)
                    match = ram.match(
                        capped, needs_checkpoint=self.owner.needs_checkpoint, pin=True
                    )
            agreed = world.least(match.length)
            if world.all_ok(match.length == agreed):
                return match
        except BaseException:
            if match.pinned:
                ram.release(match)
            raise
        log.warning("the ranks found no common resume point in %d rounds; computing all "
                    "%d tokens", AGREE_ROUNDS, len(self.chain))  # fmt: skip
        if match.pinned:
            ram.release(match)
        return Match(0, (), 0, None, 0)

    def _report(self, hit: Hit, restored: int, read: Prefetched | None) -> LookupReport:
        prompt = self.job.prompt
        # What a deeper hit would have needed next: the block the hit ends in, and for
        # snapshot models the checkpoints at message starts past it.
        positions = (
            [p for p in prompt.message_starts if p > restored] if hit.needs_checkpoint else []
        )
        # Which evicted entries the SSD holds, as read ahead: no index query here.
        on_disk = read.on_disk if read is not None else None
        lost = self.tiers.lost(self.chain, self.scope, restored // self.bs, positions, on_disk)
        policy = self.owner.policy
        # Where the prompt left a sequence RAM holds, unless a tier below restored past it
        # (after a restart RAM may hold only a warm-up, which the prompt leaves at once):
        # then that divergence did not cut this hit short, and naming it would mislead.
        lcp = (
            hit.diverged_at if hit.diverged_at is not None and hit.diverged_at >= restored else None
        )
        report = LookupReport(
            restored,
            lcp,
            self.bs,
            hit.needs_checkpoint,
            policy.checkpoint_interval,
            lost,
            tuple(read.late) if read is not None else (),
            read.late_reach if read is not None else 0,
        )
        if lcp is not None:
            tokens, decode = self.chain.tokens, self.owner.loaded.tokenizer.decode
            report.message = prompt.message_at(lcp)
            report.before = decode(tokens[max(0, lcp - _CONTEXT_TOKENS) : lcp])[-_CONTEXT_CHARS:]
            report.after = decode(tokens[lcp : lcp + _CONTEXT_TOKENS])[:_CONTEXT_CHARS]
        return report

    def _log_divergence(self, report: LookupReport) -> None:
        """Say once where this prompt left the nearest cached sequence, when it did."""
        if report.diverged_at is None or not self.owner.policy.log_divergence:
            return
        log.info(
            "prompt diverges from the cache at token %d of %d (message %s): %r | %r; restored %d",
            report.diverged_at,
            len(self.chain),
            report.message,
            report.before,
            report.after,
            report.restored,
        )

    # -- save points -----------------------------------------------------------------------

    def stop_points(self) -> list[int]:
        if not self.owner.needs_checkpoint:
            return []
        interval = self.owner.policy.checkpoint_interval
        prompt = self.job.prompt
        points = set(prompt.resume_points)
        points.update(range(interval, len(self.chain), interval))
        return sorted(points)

    def save(self, cache: list[Any], tokens: list[int], position: int, point: SavePoint) -> None:
        """Store the blocks completed up to `position`, and a checkpoint where one is due.

        `tokens` is the prompt, or at the end of generation the prompt plus its output.
        """
        if len(tokens) > len(self.chain):
            self.chain.extend(tokens[len(self.chain) :])
        self._store_blocks(cache, position)
        reason = self._checkpoint_reason(position, point)
        stored = None
        if reason is not None:
            payload = kv.extract_checkpoint(cache, position, self.bs)
            # A warm-up's state supersedes nothing: the real next turn may leave its path.
            real = not self.job.request.prefill_only
            self.tiers.store_checkpoint(self.chain, self.scope, position, payload, reason, real)
            stored = (self.chain.checkpoint_key(position), position)
            self._checkpointed_at = position
        self._note(position // self.bs, stored)

    def _note(self, blocks: int, checkpoint: tuple[bytes, int] | None) -> None:
        """Tell the session registry this request's session stored or used these entries."""
        if self.session_key is not None:
            self.owner.sessions.note(
                self.session_key, self.scope, self.bs, self.chain.hashes[:blocks], checkpoint
            )

    def _store_blocks(self, cache: list[Any], position: int) -> None:
        full = position // self.bs
        if full <= self._stored_blocks:
            return
        first = self._stored_blocks
        in_ram = self.tiers.ram.has_blocks(self.chain.hashes[first:full])
        missing = [first + j for j, present in enumerate(in_ram) if not present]
        payloads: dict[int, Any] = {}
        for lo, hi in _runs(missing):
            for i, block in enumerate(kv.extract_blocks(cache, lo, hi, self.bs), lo):
                payloads[i] = self._maybe_quantize(block)
        if payloads:
            self.tiers.store_blocks(self.chain, self.scope, payloads)
        self._stored_blocks = full

    def _maybe_quantize(self, block: kv.BlockPayload) -> kv.BlockPayload:
        bits = self.owner.policy.quantize_bits
        # Groups of 32 fit every head dim that is a multiple of 32 (64 would skip 32-wide
        # heads), at a small cost in scales.
        return kv.quantize_block(block, bits=bits, group_size=32) if bits else block

    def _checkpoint_reason(self, position: int, point: SavePoint) -> CheckpointReason | None:
        if position == 0:
            # A one-token prompt ends its prefill here; an empty prefix is never a hit
            # (a request always prefills at least one token), so there is nothing to keep.
            return None
        snapshots = self.owner.needs_checkpoint
        if point is SavePoint.PREFILL:
            if not snapshots:
                return None
            prompt = self.job.prompt
            if position in prompt.resume_points:
                return CheckpointReason.BOUNDARY
            if position % self.owner.policy.checkpoint_interval == 0:
                return CheckpointReason.PERIODIC
            return None
        if position % self.bs == 0 and not snapshots:
            return None  # the blocks already hold everything a paged model needs
        if point is SavePoint.PROMPT_END and position == self._checkpointed_at:
            return None  # the prompt ends at a save point (the last chunk starts there)
        if point is SavePoint.PROMPT_END and snapshots and self.job.prompt.reply_opens_at:
            # The next turn leaves this prompt where its reply opened <think>, a token or two
            # back, and keeps that checkpoint. One here would supersede it, and would serve
            # only a retry of this very prompt.
            return None
        return CheckpointReason(point.value)  # prompt_end / generation_end


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """Sorted indices as half-open runs of consecutive values: [1,2,3,7] → [(1,4), (7,8)]."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs
