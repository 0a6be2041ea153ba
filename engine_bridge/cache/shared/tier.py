"""The shared store as the tier under the SSD: what TieredCache asks of it, and when it
writes (`[cache.shared] write_policy`).

Lookups ask it only for what RAM and the SSD lack, in one round trip for the blocks and a
few doubling ones for checkpoints; promotion reads a run in one round trip, under the
same RAM reservation as an SSD read. Writes never wait for the network, but turning a
payload into host bytes evaluates it, so the choice of what to write is made here, on
the MLX thread, before the store's writer sends it:

- `all`: every block as it is stored, and checkpoints as the SSD's write-through has them
  (a generation end with snapshot state only once reused; superseded ones dropped);
- `second-use` (default): what a later request restores from, as it does so: an agent's
  system prompt and tools reach the store on their second use, a one-off prompt never;
- `first-n`: the first `first_n` blocks of each chain and the checkpoints within them, at
  store: the shared system prompts and tool lists of a team, little else.

An entry read from the store is marked as in it; whatever the policy, an entry is sent
at most once per process (the store's writer also skips what another machine wrote).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from engine_bridge.cache.checkpoint_writes import has_snapshots
from engine_bridge.cache.hashing import Chain
from engine_bridge.cache.kinds import CheckpointReason, EntryKind
from engine_bridge.cache.shared.config import SharedWritePolicy
from engine_bridge.cache.ssd.index import Scope
from engine_bridge.cache.ssd.store import SSDEntry, SSDStore
from engine_bridge.cache.tensors import HostTensor

if TYPE_CHECKING:
    # shared_store imports redis (the shared extra); this module is imported without it.
    from engine_bridge.cache.ram.manager import Entry
    from engine_bridge.cache.ram.matching import Match
    from engine_bridge.cache.shared.store import SharedStats, SharedStore

# Blocks asked about in the first round trip of a lookup, then four times as many.
_BLOCK_STEP = 64
# Checkpoint positions asked per round trip, then four times as many: a checkpoint near
# the deepest block (the usual case) costs one small pipeline.
_CHECKPOINT_STEP = 64
# Host bytes of an entry with its tier metadata (tier_writes.TierWrites.host_bytes).
Host = Callable[[Any, int, CheckpointReason | None], tuple[dict[str, HostTensor], dict[str, str]]]


class SharedTier:
    """Policy and lookups over one SharedStore, for one TieredCache."""

    def __init__(self, store: SharedStore) -> None:
        self.store = store
        self.policy = store.config.write_policy
        self.first_n = store.config.first_n
        self._host: Host | None = None
        self._ssd: SSDStore | None = None

    def bind(self, host: Host, ssd: SSDStore | None) -> None:
        """Called by TieredCache: how to make host bytes, and the SSD to read first."""
        self._host, self._ssd = host, ssd

    # ---- lookup -------------------------------------------------------------------------

    def present_blocks(
        self,
        scope: Scope,
        hashes: Sequence[bytes],
        in_ram: list[bool],
        beat: Callable[[], None] = lambda: None,
    ) -> int:
        """How many leading `hashes` RAM or the store holds. The store is asked about the
        next _BLOCK_STEP blocks RAM lacks, then four times as many: a prompt whose tail
        it lacks costs one small round trip, a 30k-token hit three. `beat()` is called
        before each round trip (a read-ahead's deadline, tier_reads.py)."""
        n, step = 0, _BLOCK_STEP
        while n < len(hashes):
            end = min(len(hashes), n + step)
            wanted = [h for h, here in zip(hashes[n:end], in_ram[n:end], strict=True) if not here]
            if wanted:
                beat()
            sizes = iter(self.store.sizes(scope, EntryKind.BLOCK, wanted))
            for here in in_ram[n:end]:
                if not (here or next(sizes)):
                    return n
                n += 1
            step *= 4
        return n

    def deepest_checkpoint(
        self, chain: Chain, scope: Scope, lo: int, hi: int, beat: Callable[[], None] = lambda: None
    ) -> int | None:
        """The deepest position in (lo, hi] with a checkpoint in the store for `chain`;
        `beat()` before each round trip."""
        top, step = hi, _CHECKPOINT_STEP
        while top > lo:
            positions = list(range(top, max(lo, top - step), -1))
            keys = [chain.checkpoint_key(p) for p in positions]
            beat()
            sizes = self.store.sizes(scope, EntryKind.CHECKPOINT, keys)
            for p, size in zip(positions, sizes, strict=True):
                if size:
                    return p
            if not self.store.health.reads_ok():
                return None  # the store failed meanwhile: no more round trips
            top, step = positions[-1] - 1, step * 4
        return None

    # ---- promotion ----------------------------------------------------------------------

    def fetch(
        self,
        scope: Scope,
        kind: EntryKind,
        keys: Sequence[bytes],
        reserve: Callable[[int], bool],
        release: Callable[[int], None],
        *,
        local: bool = True,
    ) -> dict[bytes, SSDEntry]:
        """Read from the store, in one round trip, those of `keys` the SSD lacks (SSD reads
        are local and need no network); the run stops where the reservation says no.
        `local=False`: all of them, the SSD not asked (it missed a read-ahead's deadline)."""
        on_ssd = [False] * len(keys)
        if self._ssd is not None and local:
            on_ssd = self._ssd.contains_many(scope, kind, keys)
        wanted = [k for k, local in zip(keys, on_ssd, strict=True) if not local]
        got = self.store.get_many(scope, kind, wanted, reserve=reserve, release=release)
        return {k: e for k, e in zip(wanted, got, strict=True) if e is not None}

    # ---- writes -------------------------------------------------------------------------

    def stored_blocks(self, chain: Chain, stored: Mapping[int, Any]) -> None:
        """Blocks of `chain` just stored in RAM (`Stored` by chain index)."""
        if self.policy is SharedWritePolicy.SECOND_USE:
            return
        for i in sorted(stored):
            if self.policy is SharedWritePolicy.FIRST_N and i >= self.first_n:
                break
            if not self._share(stored[i], EntryKind.BLOCK, chain.hashes[i], chain.block_size):
                break

    def stored_checkpoint(
        self, chain: Chain, entry: Entry | None, reason: CheckpointReason
    ) -> None:
        """A checkpoint just stored in RAM (`entry`, None if RAM did not keep it)."""
        if entry is None or entry.superseded or self.policy is SharedWritePolicy.SECOND_USE:
            return
        if reason is CheckpointReason.GENERATION_END and has_snapshots(entry.payload.payload):
            return  # the model's own output: a next turn rarely sends it back verbatim
        if not self._within_first_n(chain, entry.position):
            return
        self._share_checkpoint(entry)

    def reused(self, chain: Chain, match: Match) -> None:
        """A request restores from `match`: send what the store does not have yet (all a
        second-use policy ever sends; under the others, what came from the SSD or was
        dropped while the store was failing)."""
        for i, block in enumerate(match.blocks):
            if self.policy is SharedWritePolicy.FIRST_N and i >= self.first_n:
                break
            if not self._share(block.payload, EntryKind.BLOCK, block.key, len(block.tokens)):
                return
        ckpt = match.checkpoint
        if ckpt is not None and self._within_first_n(chain, ckpt.position):
            self._share_checkpoint(ckpt)

    def _within_first_n(self, chain: Chain, position: int) -> bool:
        """Whether first-n lets a checkpoint at `position` go (other policies always do)."""
        limit = self.first_n * chain.block_size
        return self.policy is not SharedWritePolicy.FIRST_N or position <= limit

    def _share_checkpoint(self, entry: Entry) -> bool:
        return self._share(
            entry.payload, EntryKind.CHECKPOINT, entry.key, entry.position, entry.reason,
            skip=_skip_if_superseded(entry),
        )  # fmt: skip

    def _share(
        self,
        stored: Any,
        kind: EntryKind,
        key: bytes,
        tokens: int,
        reason: CheckpointReason | None = None,
        skip: Callable[[], bool] | None = None,
    ) -> bool:
        """Queue one entry unless the store has it; False when the store takes no more now
        (failing, or its queue full), so callers stop converting payloads for nothing."""
        if stored.on_shared:
            return True
        if not self.store.accepts(stored.nbytes):
            return False
        assert self._host is not None, "SharedTier used before TieredCache bound it"
        tensors, meta = self._host(stored, tokens, reason)
        outcome = self.store.put(stored.scope, kind, key, tensors, meta, tokens=tokens, skip=skip)
        stored.on_shared = outcome in ("queued", "duplicate")
        return stored.on_shared

    # ---- upkeep -------------------------------------------------------------------------

    def stats(self) -> SharedStats:
        return self.store.stats()

    def close(self, timeout_s: float) -> None:
        self.store.close(timeout_s)


def _skip_if_superseded(entry: Entry) -> Callable[[], bool]:
    """For the store's writer: drop a checkpoint superseded while it waited (a request
    that reuses it later sends it after all)."""

    def skip() -> bool:
        if entry.superseded:
            entry.payload.on_shared = False
            return True
        return False

    return skip
