"""What each rank of a split model holds, gathered on rank 0 for stats, /metrics, the
dashboard and `doctor`.

Rank 0 gathers every rank's figures in one shared call between two steps, on the MLX
thread: what is in memory (the RAM tier's slices, the live K/V, MLX's memory) is read
there and then; the SSD's counts wait on its index, so each rank reads those on a thread
of its own every second, and the gather takes the latest.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from .world import World

log = logging.getLogger("engine_bridge.distributed.figures")

REFRESH_S = 1.0


class RankFigures:
    def __init__(
        self,
        world: World,
        now: Callable[[], dict[str, Any]],
        read: Callable[[], dict[str, Any]],
        every_s: float = REFRESH_S,
    ):
        self.world = world
        self._now = now  # in memory: read at the gather
        self._read = read  # with I/O: read on this rank's own thread
        self._every_s = every_s
        self._mine: dict[str, Any] = {}
        self.last: list[dict[str, Any]] | None = None  # by rank, as last gathered
        self._stop = threading.Event()
        self._refresh()
        threading.Thread(target=self._loop, name="rank-figures", daemon=True).start()

    def gather(self) -> list[dict[str, Any]]:
        """Every rank's latest figures, by rank (a shared call: every rank at once)."""
        mine = {"rank": self.world.rank, "layout": self.world.layout, **self._mine}
        mine.update(self._now())
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
