"""The process's memory: the guard that shrinks the RAM tier while the system runs short,
MLX's allocator figures, and the default cap on running sequences' K/V."""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

import mlx.core as mx
import psutil

from ..cache.tiers import TieredCache
from ..engine_settings import EngineSettings
from . import heap

# The guard logged as part of the engine before it had a module; the name stays so log
# filters and readers of old logs find its lines where they were.
log = logging.getLogger("engine_bridge.ops.memory")

# How often the memory guard also hands freed heap back to the system (see heap.py).
HEAP_TRIM_S = 30.0


def mlx_memory() -> dict[str, int]:
    """MLX's own allocator: arrays alive, freed buffers it keeps for reuse, and the peak;
    and, where the C library says, the heap under it (heap.usage)."""
    return {
        "mlx_active_bytes": mx.get_active_memory(),
        "mlx_cache_bytes": mx.get_cache_memory(),
        "mlx_peak_bytes": mx.get_peak_memory(),
        **heap.usage(),
    }


def release_memory() -> None:
    """Return an unloaded model's buffers to the system (on the MLX thread)."""
    gc.collect()
    mx.clear_cache()


def default_kv_memory(settings: EngineSettings) -> int:
    """Live K/V of running sequences may take half the RAM available at start, less the
    RAM tier's budget, and never less than 1 GB."""
    available = psutil.virtual_memory().available
    return max(1 << 30, available // 2 - settings.ram_budget_bytes)


def _mb(n: int) -> str:
    return f"{n / (1 << 20):.0f} MB"


@dataclass(slots=True)
class MemoryPressure:
    """The memory guard's state, shown in /v1/cache/stats."""

    floor_bytes: int | None = None
    available_bytes: int | None = None
    budget_bytes: int | None = None  # the RAM tier's budget now
    active: bool = False
    shrinks: int = 0
    freed_bytes: int = 0


class MemoryGuard:
    """Keeps the RAM tier's budget within what the system can spare (settings are read on
    every check, so a changed floor takes effect at the next one)."""

    def __init__(self, tiers: TieredCache, settings: EngineSettings):
        self._tiers = tiers
        self._settings = settings
        self.pressure = MemoryPressure(
            floor_bytes=settings.ram_min_available_bytes, budget_bytes=settings.ram_budget_bytes
        )
        # What the autotuner added to the configured budget (autotune.py): the guard holds,
        # and grows back to after pressure, the sum.
        self.extra_bytes = 0

    @property
    def target_bytes(self) -> int:
        """The budget to hold: the configured one (the preflight may derive it again at a
        load) plus what tuning added."""
        return self._settings.ram_budget_bytes + self.extra_bytes

    def check(self, available: int | None = None) -> int:
        """Shrink the RAM tier while the system's available memory is under the floor, and
        give the budget back (in steps) once it is not. Returns the RAM tier's budget."""
        floor = self._settings.ram_min_available_bytes
        ram = self._tiers.ram
        configured = self.target_bytes
        if floor is None:
            return ram.budget_bytes
        available = psutil.virtual_memory().available if available is None else available
        held = ram.stats().bytes
        if available < floor:
            # Free the shortfall from what the tier holds; never below the floor budget.
            target = max(self._settings.ram_pressure_min_budget_bytes, held - (floor - available))
            if target < ram.budget_bytes:
                freed = ram.set_budget(target)
                self.pressure.shrinks += 1
                self.pressure.freed_bytes += freed
                if not self.pressure.active:
                    log.warning(
                        "memory pressure: %s available, under the %s floor; RAM cache budget "
                        "%s -> %s (evicted entries go to SSD)",
                        _mb(available), _mb(floor), _mb(configured), _mb(target),
                    )  # fmt: skip
                self.pressure.active = True
        elif ram.budget_bytes < configured and available > floor + configured // 4:
            # Pressure is gone: grow back a quarter of the configured budget per check.
            grown = min(configured, ram.budget_bytes + max(configured // 4, 1))
            ram.set_budget(grown)
            if grown == configured and self.pressure.active:
                log.info("memory pressure over: RAM cache budget back to %s", _mb(configured))
                self.pressure.active = False
        self.pressure.budget_bytes = ram.budget_bytes
        self.pressure.available_bytes = available
        return ram.budget_bytes
