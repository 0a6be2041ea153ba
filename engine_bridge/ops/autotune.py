"""Tuning by load: the RAM budget and the eviction policy, from the RAM tier's ghost lists.

Every `interval`, and as soon as ghosts come back between two (the janitor asks every
`EARLY_S`: in the requests a look waits out, eviction goes on taking what the ghosts say
to keep), on the MLX thread, where the memory guard's pressure always wins:

- **RAM budget.** Ghosts that came back (cache/ram/ghosts.py: entries evicted, then needed
  again) are what a larger budget would have kept, and each ghost's depth (the bytes
  evicted after it went) says how much larger. While they keep coming (at least
  `MIN_GHOST_SHARE` of the budget a tick), the budget grows in one look to what would
  have kept them all: by the deepest ghost's depth, or by what came back, at least a step
  (a quarter of the configured one), and by twice the last look's growth while looks in a
  row see ghosts (a slow start); up to `ram_max` and only while the machine keeps twice the
  guard's floor free after it (never toward swap). After `QUIET_TICKS` ticks without a
  ghost it gives a step back, never below the configured budget.
- **Eviction policy.** `protect_frequent` (manager.py: the share of the budget entries read
  twice or more keep past eviction's turn) moves as ARC moves its target: ghosts of entries
  that had been read push it up (frequency: a shared system prompt must survive a burst of
  one-off prompts), ghosts of entries never read push it down (recency).
- **Checkpoint spacing.** Where the diagnosis says hybrid models resumed short of where
  prompts diverged, each path's newest periodic checkpoint is kept ([cache.ram]
  keep_periodic); where they still do, in requests after that change, periodic
  checkpoints come closer ([cache.ram] checkpoint_interval): to the power of two at or
  below the typical gap and at most half the interval, never under `SPACING_MIN`. Only
  requests after a change count for the next, so each change is judged on its own. Not
  on a model split across ranks, whose prefills must stop at the same points on each.
- **SSD writes.** With a wear budget ([cache.ssd] max_write_per_day), a day whose writes
  are on course past it switches "through" to "second-use" (only what a later request
  reuses is written), and back once the course is under half of it.

Each change is logged with its reason and listed in /v1/cache/stats `autotune`. Tuning
changes what is kept, never what is computed: cached answers still equal bypass.
`[autotune] enabled = false` builds none of this, and the fixed settings hold exactly.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import psutil

from ..cache.write_policy import WritePolicy
from .fixes import closer_interval

if TYPE_CHECKING:
    from ..cache.ram.manager import CacheManager
    from ..cache.tiers import TieredCache
    from ..engine_settings import AutotuneSettings, CachePolicy
    from .diagnosis import Diagnosis
    from .memory import MemoryGuard

log = logging.getLogger(__name__)

STEP = 0.25  # of the configured budget, per growth or give-back
MIN_GHOST_SHARE = 0.01  # ghost bytes a tick, of the budget, that count as ghosts hitting
QUIET_TICKS = 30  # ticks without a ghost before a step of memory goes back
POLICY_STEP = 0.2
POLICY_MAX = 0.9
# Checkpoint spacing: its share of the tokens computed again in the last window, and the
# least tokens, before periodic checkpoints are kept.
SPACING_SHARE, SPACING_TOKENS, SPACING_WINDOW_S = 0.1, 1024, 900.0
SPACING_MIN = 256  # the closest periodic checkpoints tuning sets, in tokens
HISTORY = 100


@dataclass(frozen=True, slots=True)
class Change:
    time: float  # unix seconds
    setting: str
    before: Any
    after: Any
    reason: str

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["from"], out["to"] = out.pop("before"), out.pop("after")
        return out


class Autotune:
    EARLY_S = 0.25  # how often the janitor asks whether ghosts came back between looks

    def __init__(
        self,
        settings: AutotuneSettings,
        tiers: TieredCache,
        guard: MemoryGuard,
        diagnosis: Diagnosis | None = None,
        policy: CachePolicy | None = None,  # whose checkpoint_interval it may set
    ):
        self.settings = settings
        self.policy = policy
        self._spaced_at = 0.0  # when checkpoint spacing last changed (unix seconds)
        self.tiers = tiers
        self.ram: CacheManager = tiers.ram
        self._eased_writes = False  # whether tuning chose second-use (it undoes only its own)
        self.guard = guard
        self.diagnosis = diagnosis
        self.changes: deque[Change] = deque(maxlen=HISTORY)
        self._quiet = 0
        self._grew = 0  # bytes the last look grew the budget by (0: it did not)
        self._ghosts = {"recent": 0, "frequent": 0, "came_back_bytes": 0}

    @property
    def base_bytes(self) -> int:
        return self.guard.target_bytes - self.guard.extra_bytes

    @property
    def max_bytes(self) -> int:
        return self.settings.ram_max_bytes or 2 * self.base_bytes

    def due(self, since_last: float) -> bool:
        """Whether to look now: the interval has passed since the last look, or evicted
        entries came back since it. Each request that waits out the interval then evicts
        more of what the ghosts say the budget should keep."""
        if since_last >= self.settings.interval_s:
            return True
        early = MIN_GHOST_SHARE * self.guard.target_bytes
        return since_last >= self.EARLY_S and self.ram.ghost_bytes_waiting() >= early

    def tick(
        self, available: int | None = None, total: int | None = None, now: float | None = None
    ) -> list[Change]:
        """One look at what came back since the last; the changes it made."""
        hits = self.ram.ghost_hits()
        self._ghosts["recent"] += hits.recent
        self._ghosts["frequent"] += hits.frequent
        self._ghosts["came_back_bytes"] += hits.bytes
        made: list[Change] = []
        if hits.bytes:
            # ARC's move: a ghost of a read entry wants frequency kept, one never read wants
            # recency; weighed by bytes.
            lean = (hits.frequent_bytes - hits.recent_bytes) / hits.bytes
            p = round(min(max(self.ram.protect_frequent + POLICY_STEP * lean, 0.0), POLICY_MAX), 2)
            if p != self.ram.protect_frequent:
                why = (f"ghosts came back: {_mb(hits.frequent_bytes)} of entries that had been "
                       f"read, {_mb(hits.recent_bytes)} of entries never read")  # fmt: skip
                made.append(self._change("cache.ram.protect_frequent",
                                         self.ram.protect_frequent, p, why))  # fmt: skip
                self.ram.protect_frequent = p
        if not self.guard.pressure.active:  # the guard is shrinking the tier: it decides
            made += self._budget(hits.bytes, hits.depth, available, total)
        now = time.time() if now is None else now
        made += self._spacing(now)
        made += self._writes(now)
        return made

    def _writes(self, now: float) -> list[Change]:
        ssd, writes = getattr(self.tiers, "ssd", None), getattr(self.tiers, "writes", None)
        if ssd is None or writes is None:
            return []
        wear = ssd.wear.stats()
        cap = wear.max_write_per_day
        if cap is None:
            return []
        # Today's writes at today's pace, from the second hour of the UTC day on.
        pace = wear.written_today_bytes / max((now % 86400) / 86400, 1 / 24)
        course = f"today's SSD writes are on course for {_mb(int(pace))} a day"
        if writes.policy is WritePolicy.THROUGH and pace > cap:
            self._eased_writes = True
            why = f"{course}, past max_write_per_day {_mb(cap)}"
            return [self._set_policy(writes, WritePolicy.SECOND_USE, why)]
        if self._eased_writes and writes.policy is WritePolicy.SECOND_USE and pace < cap / 2:
            self._eased_writes = False
            why = f"{course}, under half of max_write_per_day {_mb(cap)}"
            return [self._set_policy(writes, WritePolicy.THROUGH, why)]
        return []

    def _set_policy(self, writes: Any, policy: WritePolicy, why: str) -> Change:
        change = self._change("cache.ssd.write_policy", str(writes.policy), str(policy), why)
        writes.policy = policy
        return change

    def _budget(
        self, ghost_bytes: int, depth: int, available: int | None, total: int | None
    ) -> list[Change]:
        budget, base = self.guard.target_bytes, self.base_bytes
        step = max(int(base * STEP), 1)
        if ghost_bytes >= MIN_GHOST_SHARE * budget:
            self._quiet = 0
            if available is None or total is None:
                vm = psutil.virtual_memory()
                available, total = vm.available, vm.total
            # Free memory after the step must stay above twice the guard's floor (or a
            # tenth of the machine without a guard): tuning never brings the guard on.
            keep = 2 * (self.guard.pressure.floor_bytes or total // 20)
            # What would have kept every ghost that came back (the deepest one's depth), or
            # as much as came back, at least a step; and twice the last look's growth when
            # that one grew too: a ghost comes back only once its prompt's turn comes round,
            # so the first looks see part of the working set, and doubling finds the rest
            # in a look or two (a slow start), within ram_max and free memory.
            want = max(step, ghost_bytes, depth, 2 * self._grew)
            grown = min(budget + want, self.max_bytes, budget + max(available - keep, 0))
            self._grew = max(grown - budget, 0)
            if grown <= budget:
                return []
            why = (f"{_mb(ghost_bytes)} of evicted entries came back since the last look, "
                   f"the deepest after {_mb(depth)} more was evicted")  # fmt: skip
            return [self._set_budget(grown, why)]
        self._quiet += 1
        self._grew = 0
        if self._quiet < QUIET_TICKS or budget <= base:
            return []
        self._quiet = 0
        return [self._set_budget(max(budget - step, base), f"no evicted entry came back for "
                                 f"{QUIET_TICKS} looks: memory given back")]  # fmt: skip

    def _set_budget(self, budget: int, why: str) -> Change:
        change = self._change("cache.ram.budget", self.guard.target_bytes, budget, why)
        self.guard.extra_bytes = budget - self.base_bytes
        self.ram.set_budget(budget)
        self.guard.pressure.budget_bytes = budget
        return change

    def _spacing(self, now: float) -> list[Change]:
        if self.diagnosis is None:
            return []
        losses = self.diagnosis.losses(min(SPACING_WINDOW_S, now - self._spaced_at), now=now)
        computed = sum(x.computed for x in losses)
        spacing = sum(x.tokens.get("checkpoint_spacing", 0) for x in losses)
        if spacing < SPACING_TOKENS or spacing < SPACING_SHARE * computed:
            return []
        why = (f"hybrid models resumed {spacing:,} tokens short of where prompts diverged "
               f"({spacing / computed:.0%} of the tokens computed again)")  # fmt: skip
        if not self.ram.keep_newest_periodic:
            self.ram.keep_newest_periodic = True
            self._spaced_at = now
            return [self._change("cache.ram.keep_periodic", False, True, why)]
        if self.policy is None:
            return []
        interval = self.policy.checkpoint_interval
        gaps = [e.gap for x in losses if (e := x.evidence.get("checkpoint_spacing")) and e.gap]
        closer, typical = closer_interval(gaps, interval, self.policy.block_size)
        closer = max(closer, SPACING_MIN)
        if closer >= interval:
            return []
        self.policy.checkpoint_interval = closer
        self._spaced_at = now
        why += f", typically {typical:,.0f} tokens short, with periodic checkpoints kept"
        return [self._change("cache.ram.checkpoint_interval", interval, closer, why)]

    def _change(self, setting: str, before: Any, after: Any, why: str) -> Change:
        change = Change(time.time(), setting, before, after, why)
        self.changes.append(change)
        shown = (_mb(before), _mb(after)) if setting.endswith("budget") else (before, after)
        log.info("autotune: %s %s -> %s: %s", setting, *shown, why)
        return change

    def stats(self) -> dict[str, Any]:
        return {
            "enabled": True,
            "ram_budget_bytes": self.guard.target_bytes,
            "protect_frequent": self.ram.protect_frequent,
            "keep_periodic": self.ram.keep_newest_periodic,
            "checkpoint_interval": self.policy.checkpoint_interval if self.policy else None,
            "ssd_write_policy": str(w.policy)
            if (w := getattr(self.tiers, "writes", None))
            else None,
            "bounds": {
                "ram_min_bytes": self.base_bytes,
                "ram_max_bytes": self.max_bytes,
                "protect_frequent_max": POLICY_MAX,
                "checkpoint_interval_min": SPACING_MIN if self.policy else None,
            },
            "ghost_hits": dict(self._ghosts),
            "changes": [c.to_json() for c in self.changes],
        }


def _mb(n: Any) -> str:
    return f"{n / 1e6:.1f} MB" if isinstance(n, int) else str(n)
