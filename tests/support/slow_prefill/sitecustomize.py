"""A slow prefill for a real server process, loaded through PYTHONPATH by the server tests.

With `$MPC_SLOW_PREFILL` naming a file, each request's prefill first sleeps the seconds that
file holds (read when its prefill starts; missing, empty or 0: no sleep), on the MLX thread,
as a cold prefill of a long prompt on a Mac holds it for minutes: the cache lookup is done
and the response started, and no token comes until the sleep is over. A test changes the
file between requests to give each its own delay.
"""

from __future__ import annotations

import os
import time

_FILE = os.environ.get("MPC_SLOW_PREFILL")


def _seconds() -> float:
    try:
        with open(_FILE) as f:  # noqa: PTH123 - no pathlib needed this early
            return float(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0.0


def _install() -> None:
    from engine_bridge.scheduling.runner import Runner

    original = Runner._prefill
    slept: set[object] = set()

    def slow_prefill(self, budget):
        for seq in self.prefilling:
            key = seq.job.request.request_id or id(seq.job)
            if key not in slept:
                slept.add(key)
                time.sleep(_seconds())
        return original(self, budget)

    Runner._prefill = slow_prefill


if _FILE:
    _install()
