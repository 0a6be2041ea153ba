"""The configurations the autotune scenario sets side by side, and the config file of each.

"tuned" is the server's defaults (`[autotune] enabled = true`): it grows the RAM budget
from the configured one up to `[autotune] ram_max` and adapts `[cache.ram]
protect_frequent` from where "auto" starts it under tuning (0.5). Every other configuration has autotune off and holds its settings
fixed: a sweep of budgets {1, 1.5, 2} x the configured one and protect_frequent {0, 0.5},
never past the most memory the tuned run may take, so "best fixed" had no more RAM to use
than tuned did. The sweep's first point (1x, 0: plain LRU at the same budget) is "default
fixed", the server as it was before autotune.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_bridge.engine_settings import AutotuneSettings

TUNED = "tuned"
FACTORS = (1.0, 1.5, 2.0)
PROTECT = (0.0, 0.5)
# `[autotune] ram_max = "auto"`: twice the configured budget (capped by free memory,
# which a bench-sized budget never meets); the cap when the tuned run does not say its own.
AUTO_RAM_MAX = 2.0
# How often the tuner looks: the default is 10 s, between requests that an agent or a
# person spaces by seconds to minutes; the bench sends them back to back, several a second
# on a 2-core CPU, so it looks as often as the server allows (1 s), not once a trace.
INTERVAL = "1s"


@dataclass(frozen=True, slots=True)
class Config:
    key: str  # the samples' server name: "tuned", "fixed-1.5x-pf0.5"
    budget_bytes: int  # [cache.ram] budget (serve --ram-budget); tuned: where it starts
    protect_frequent: float  # fixed: [cache.ram] protect_frequent; tuned: where it starts
    tuned: bool
    factor: float = 1.0  # budget_bytes over the configured budget

    @property
    def label(self) -> str:
        if self.tuned:
            return "autotune on"
        return (
            f"fixed: budget {self.factor:g}x ({self.budget_bytes / 1e6:.2f} MB), "
            f"protect_frequent {self.protect_frequent:g}"
        )

    def toml(self) -> str:
        """The config file it is served with (the budget goes on the command line)."""
        if self.tuned:
            return f'[autotune]\nenabled = true\ninterval = "{INTERVAL}"\n'
        return (
            "[autotune]\nenabled = false\n\n"
            f"[cache.ram]\nprotect_frequent = {self.protect_frequent}\n"
        )


def tuned(budget_bytes: int) -> Config:
    return Config(TUNED, budget_bytes, AutotuneSettings.PROTECT_START, tuned=True)


def sweep(budget_bytes: int, cap_bytes: int) -> list[Config]:
    """Fixed settings: each factor's budget (at most `cap_bytes`) with each protect_frequent,
    smallest budget first; a budget the cap makes equal to a smaller one's is left out."""
    assert cap_bytes >= budget_bytes > 0, f"cap {cap_bytes} under the budget {budget_bytes}"
    out: list[Config] = []
    seen: set[int] = set()
    for factor in FACTORS:
        budget = min(int(budget_bytes * factor), cap_bytes)
        if budget in seen:
            continue
        seen.add(budget)
        for p in PROTECT:
            key = f"fixed-{factor:g}x-pf{p:g}"
            out.append(Config(key, budget, p, tuned=False, factor=budget / budget_bytes))
    return out


DEFAULT = "fixed-1x-pf0"  # autotune off, the same budget, plain LRU


def ram_cap(autotune: dict | None, budget_bytes: int) -> tuple[int, str]:
    """The most RAM the tuned run could give the tier, from its /v1/cache/stats `autotune`
    bounds, else `ram_max = "auto"`'s; and where it came from, in words."""
    bounds = (autotune or {}).get("bounds") or {}
    cap = bounds.get("ram_max_bytes")
    if isinstance(cap, int) and cap >= budget_bytes:
        return cap, "the tuned run's autotune bounds (ram_max_bytes)"
    return int(budget_bytes * AUTO_RAM_MAX), f'ram_max = "auto": {AUTO_RAM_MAX:g}x the budget'
