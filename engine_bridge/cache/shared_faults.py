"""Shared tier faults: what kind each one is, when calls may use the network again, and
the one warning per outage (shared_store.py counts them)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Literal

import redis

from engine_bridge.cache.ssd_format import FormatError

log = logging.getLogger("engine_bridge.cache.shared_store")

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
    """When calls may use the network, and the one warning per outage."""

    def __init__(self, retry_s: float, retry_max_s: float, url: str) -> None:
        self.url = url
        self._first, self._max = retry_s, retry_max_s
        self._delay = retry_s
        self._retry_at = 0.0  # no read or write before this (down, slow, wrong password)
        self._writes_at = 0.0  # no write before this (full)
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def reads_ok(self) -> bool:
        return time.monotonic() >= self._retry_at

    def writes_ok(self) -> bool:
        now = time.monotonic()
        return now >= self._retry_at and now >= self._writes_at

    def failed(self, kind: Fault, e: BaseException) -> None:
        with self._lock:
            now = time.monotonic()
            if kind == "full":
                self._writes_at = now + self._max
            elif kind in ("down", "timeout", "auth"):
                self._retry_at = now + self._delay
                self._delay = min(self._delay * 2, self._max)
            warn = kind not in self._warned
            self._warned.add(kind)
        if warn:
            log.warning(
                "shared cache %s: %s (%s: %s); serving from RAM and SSD, %s",
                self.url, _WHAT[kind], type(e).__name__, e, _THEN[kind],
            )  # fmt: skip

    def succeeded(self) -> None:
        if self._delay == self._first and not (self._warned & _OUTAGES):
            return
        with self._lock:
            back = self._warned & _OUTAGES
            self._warned -= _OUTAGES
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
    "down": "retrying with backoff",
    "timeout": "retrying with backoff",
    "auth": "retrying with backoff",
    "full": "writes pause a while (set maxmemory-policy allkeys-lru)",
    "corrupt": "the entry is deleted from the store",
    "error": "the call is counted as a miss",
}
