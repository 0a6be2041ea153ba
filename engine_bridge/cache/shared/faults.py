"""Shared tier faults: what kind each one is, when calls may use the network again, and
the one warning per outage (shared/store.py counts them)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Literal

import redis

from engine_bridge.cache.ssd.format import FormatError

log = logging.getLogger(__name__)

FAULTS = ("down", "timeout", "auth", "full", "corrupt", "error")
Fault = Literal["down", "timeout", "auth", "full", "corrupt", "error"]


def fault_of(e: BaseException) -> Fault:
    """What kind of store fault an exception is; checked most specific first, since redis-py
    raises AuthenticationError as a ConnectionError and OOM as a ResponseError."""
    text = str(e)
    if isinstance(e, FormatError):
        return "corrupt"
    if isinstance(e, redis.AuthenticationError | redis.exceptions.NoPermissionError) or any(
        s in text for s in ("WRONGPASS", "NOAUTH", "NOPERM")
    ):
        return "auth"
    if isinstance(e, redis.exceptions.OutOfMemoryError) or text.startswith("OOM"):
        return "full"
    if isinstance(e, redis.TimeoutError | TimeoutError):
        return "timeout"
    if isinstance(e, redis.ConnectionError | OSError):
        return "down"
    return "error"


class Health:
    """When calls may use the network, and the one warning per outage.

    After an outage (down, slow, a wrong password) requests stay off the network until
    the store's writer thread, probing on a doubling backoff, finds it answering again:
    a store that went away costs one request its timeout, not one request per retry.
    """

    def __init__(self, retry_s: float, retry_max_s: float, url: str) -> None:
        self.url = url
        self._first, self._max = retry_s, retry_max_s
        self._delay = retry_s
        self._down = False  # no read or write until a probe succeeds
        self._probe_at = 0.0  # the next probe, while down
        self._writes_at = 0.0  # no write before this (full)
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def reads_ok(self) -> bool:
        return not self._down

    def writes_ok(self) -> bool:
        return not self._down and time.monotonic() >= self._writes_at

    def probe_in(self) -> float | None:
        """Seconds until the next probe is due (0: now), or None while the store is up."""
        return max(0.0, self._probe_at - time.monotonic()) if self._down else None

    def failed(self, kind: Fault, e: BaseException) -> None:
        with self._lock:
            now = time.monotonic()
            if kind == "full":
                self._writes_at = now + self._max
            elif kind in _OUTAGES:
                if self._down:  # a probe failed: wait longer
                    self._delay = min(self._delay * 2, self._max)
                self._down = True
                self._probe_at = now + self._delay
            # Warned under the lock: a thread that finds the kind already warned of must
            # find the warning already written, or a caller could see the fault counted
            # and no warning yet (the writer thread and a request can fail together).
            if kind not in self._warned:
                self._warned.add(kind)
                log.warning(
                    "shared cache %s: %s (%s: %s); serving from RAM and SSD, %s",
                    self.url, _WHAT[kind], type(e).__name__, e, _THEN[kind],
                )  # fmt: skip

    def succeeded(self) -> None:
        if not self._down and not (self._warned & _OUTAGES):
            return
        with self._lock:
            back = self._warned & _OUTAGES
            self._warned -= _OUTAGES
            self._down = False
            self._delay = self._first
            if back:
                log.warning("shared cache %s: reachable again after %s", self.url, ", ".join(back))


_OUTAGES = frozenset({"down", "timeout", "auth"})
_WHAT = {
    "down": "unreachable",
    "timeout": "no answer within the timeout",
    "auth": "authentication refused, or the ACL user may not use these keys (check the password, the user and its key pattern)",
    "full": "full (maxmemory reached with a noeviction policy)",
    "corrupt": "an entry failed its checksum or was truncated",
    "error": "a command failed",
}
_THEN = {
    "down": "probing it with backoff",
    "timeout": "probing it with backoff",
    "auth": "probing it with backoff",
    "full": "writes pause a while (set maxmemory-policy allkeys-lru)",
    "corrupt": "the entry is deleted from the store",
    "error": "the call is counted as a miss",
}
