"""What each rank of a split model holds, gathered on rank 0 for stats, /metrics, the
dashboard and `doctor`.

Each rank reads its own figures (its RAM and SSD tiers' slices, its live K/V, its MLX
memory) on a thread of its own every few seconds, since the SSD's counts wait on its
index; rank 0 then gathers every rank's latest in one shared call between two steps, on
the MLX thread, with no I/O there.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from .world import World

log = logging.getLogger("engine_bridge.distributed.figures")

REFRESH_S = 5.0


class RankFigures:
    def __init__(self, world: World, read: Callable[[], dict[str, Any]], every_s=REFRESH_S):
        self.world = world
        self._read = read
        self._every_s = every_s
        self._mine: dict[str, Any] = {}
        self.last: list[dict[str, Any]] | None = None  # by rank, as last gathered
        self._stop = threading.Event()
        self._refresh()
        threading.Thread(target=self._loop, name="rank-figures", daemon=True).start()

    def gather(self) -> list[dict[str, Any]]:
        """Every rank's latest figures, by rank (a shared call: every rank at once)."""
        mine = {"rank": self.world.rank, "layout": self.world.layout, **self._mine}
        self.last = self.world.gather(mine)
        return self.last

    def close(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self._every_s):
            self._refresh()

    def _refresh(self) -> None:
        try:
            self._mine = self._read()
        except Exception:
            log.exception("reading this rank's figures failed")
