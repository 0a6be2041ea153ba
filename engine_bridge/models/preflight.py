"""Memory preflight: whether a model's weights, the K/V budget and the RAM tier fit in what
the machine has free before the model loads, so a load never pushes it into swap.

What a load will add beyond what the process uses now is the weights, plus what the live
K/V and the RAM tier may still grow into under their budgets. That must fit in the memory
available now, less a headroom the system keeps (`[cache.ram] min_available`, 5% of RAM by
default). Budgets left to their defaults are derived after the weights: they share what
the weights leave, so a 20 GB model on a 32 GB Mac fits without any settings. A budget the
user set is taken as given, and a load it does not fit is refused, naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import psutil

from ..cache.tiers import TieredCache
from ..engine_settings import EngineSettings
from .loading import ModelRef

# Derived budgets never go below these: a few sessions' prefixes, a few sequences' K/V.
RAM_BUDGET_FLOOR = 100 << 20
KV_MEMORY_FLOOR = 512 << 20
# What the system keeps free when no [cache.ram] min_available floor is set.
DEFAULT_HEADROOM_SHARE = 0.05


def weights_bytes(path: Path) -> int:
    """The model's weights on disk: the sum of its safetensors files (what MLX loads)."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.glob("*.safetensors") if f.is_file())


@dataclass(frozen=True, slots=True)
class RamReading:
    total: int
    available: int  # what the system can hand out now without swapping


class Machine:
    """What the preflight reads: the system's RAM and a model's weights (tests fake it)."""

    def ram(self) -> RamReading:
        vm = psutil.virtual_memory()
        return RamReading(vm.total, vm.available)

    def weights(self, ref: ModelRef) -> int:
        return weights_bytes(ref.path)


@dataclass(frozen=True, slots=True)
class Usage:
    """What the caches hold now, and how their budgets are set."""

    kv_used: int  # live K/V of running sequences
    ram_held: int  # what the RAM tier holds
    kv_fixed: int | None  # `[engine] kv_memory` as set; None: derived
    ram_fixed: int | None  # `[cache.ram] budget` as a size; None: a share, derived
    ram_share: float  # the share of what the weights leave, when derived
    headroom: int  # what the system keeps free


@dataclass(frozen=True, slots=True)
class Plan:
    """The figures of one load: what it needs, what there is, and the budgets it runs under."""

    model: str
    weights: int
    kv_budget: int
    ram_budget: int
    need: int  # bytes beyond what is in use now: weights, and what the caches may grow into
    reading: RamReading
    headroom: int
    usage: Usage

    @property
    def room(self) -> int:
        return self.reading.available - self.headroom

    @property
    def fits(self) -> bool:
        return self.need <= self.room

    def figures(self) -> str:
        return (
            f"{gb(self.weights)} of weights + {gb(self.kv_budget)} K/V budget + "
            f"{gb(self.ram_budget)} RAM cache budget; {gb(self.reading.available)} of "
            f"{gb(self.reading.total)} RAM available, {gb(self.headroom)} kept free"
        )

    def refusal(self, unloaded: list[str]) -> str:
        """Why the load is refused, with the figures and what to change."""
        freed = f" after unloading idle {', '.join(unloaded)}" if unloaded else ""
        if self.weights > self.reading.total - self.headroom:
            advice = "its weights alone are more than this machine's RAM: use a smaller quant"
        elif self.weights > self.room:
            advice = (
                "its weights do not fit in the memory free now: close other apps or unload "
                "models elsewhere (LM Studio), or use a smaller quant"
            )
        else:
            fixed = []
            if self.usage.kv_fixed is not None:
                fixed.append("[engine] kv_memory")
            if self.usage.ram_fixed is not None:
                fixed.append("[cache.ram] budget")
            advice = (
                f"lower {' or '.join(fixed)}, or leave {'them' if len(fixed) > 1 else 'it'} "
                "unset to share what the weights leave"
                if fixed
                else "close other apps or unload models elsewhere (LM Studio)"
            )
        return (
            f"not enough memory to load {self.model}{freed}: it needs {gb(self.need)} more "
            f"({self.figures()}); {advice}"
        )


def gb(n: int) -> str:
    return f"{n / (1 << 30):.1f} GB"


def plan(model: str, weights: int, reading: RamReading, usage: Usage) -> Plan:
    """The budgets a load of `weights` bytes runs under, and whether it fits."""
    room = reading.available - usage.headroom
    # What the caches may hold in all once the weights are in: what is free after them,
    # plus what they hold now.
    cache_room = max(0, room - weights) + usage.kv_used + usage.ram_held
    ram = usage.ram_fixed
    if ram is None:
        ram = max(RAM_BUDGET_FLOOR, int(cache_room * usage.ram_share))
    kv = usage.kv_fixed
    if kv is None:
        # As the start-up default: half of what is left, less the RAM tier's share.
        kv = max(KV_MEMORY_FLOOR, cache_room // 2 - ram)
    need = weights + max(0, kv - usage.kv_used) + max(0, ram - usage.ram_held)
    return Plan(model, weights, kv, ram, need, reading, usage.headroom, usage)


class KvHolder(Protocol):
    """What the preflight reads of the scheduler (models/ sits below scheduling/): the live
    K/V it holds (`stats.kv_bytes`) and its budget (`settings.kv_memory_bytes`)."""

    stats: Any
    settings: Any


class Preflight:
    """Plans each load against the machine's memory, and sets the derived budgets."""

    def __init__(self, settings: EngineSettings, scheduler: KvHolder, tiers: TieredCache):
        self._settings = settings
        self._scheduler = scheduler
        self._tiers = tiers
        self.machine = Machine()
        self.last: Plan | None = None  # shown in /v1/cache/stats

    def usage(self, reading: RamReading) -> Usage:
        s = self._settings
        return Usage(
            kv_used=self._scheduler.stats.kv_bytes,
            ram_held=self._tiers.ram.stats().bytes if s.cache_enabled else 0,
            kv_fixed=s.kv_memory_bytes,
            # With the cache off the RAM tier holds nothing and never will.
            ram_fixed=0 if not s.cache_enabled else (
                None if s.ram_budget_share is not None else s.ram_budget_bytes
            ),
            ram_share=s.ram_budget_share or 0.0,
            headroom=s.ram_min_available_bytes
            if s.ram_min_available_bytes is not None
            else int(reading.total * DEFAULT_HEADROOM_SHARE),
        )  # fmt: skip

    def check(self, ref: ModelRef) -> Plan:
        reading = self.machine.ram()
        return plan(ref.id, self.machine.weights(ref), reading, self.usage(reading))

    def stats(self) -> dict[str, int | None]:
        p = self.last
        return {
            "kv_budget_bytes": self._scheduler.settings.kv_memory_bytes,
            "last_load_weights_bytes": p.weights if p else None,
            "last_load_need_bytes": p.need if p else None,
            "last_load_available_bytes": p.reading.available if p else None,
        }

    def apply(self, p: Plan) -> None:
        """Run the load under `p`'s budgets (on the MLX thread: a smaller RAM budget evicts,
        and an eviction spills arrays to SSD)."""
        self.last = p
        if p.usage.kv_fixed is None:
            self._scheduler.settings.kv_memory_bytes = p.kv_budget
        if p.usage.ram_fixed is None and p.ram_budget != self._settings.ram_budget_bytes:
            self._settings.ram_budget_bytes = p.ram_budget  # what the memory guard restores
            self._tiers.ram.set_budget(p.ram_budget)
