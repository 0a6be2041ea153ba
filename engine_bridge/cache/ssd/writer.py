"""The SSD tier's writer: one thread behind a bounded queue that drops rather than blocks.

Only queue mechanics live here (admission, dedupe of queued entries, a tick at least once
a second, periodic maintenance, a bounded drain at close); what a write does is the
store's callback.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from engine_bridge.cache.kinds import PutReason
from engine_bridge.cache.ssd.index import RawId
from engine_bridge.cache.tensors import HostTensor

log = logging.getLogger(__name__)

Admission = Literal["queued", "duplicate", "dropped", "closed"]


@dataclass(frozen=True, slots=True)
class WriteJob:
    rid: RawId
    tensors: dict[str, HostTensor]
    meta: dict[str, str]
    tokens: int
    tags: str
    reason: PutReason
    nbytes: int
    # Asked just before writing: True drops the job (it became useless while it waited).
    skip: Callable[[], bool] | None = None


class Writer:
    def __init__(
        self,
        *,
        process: Callable[[WriteJob], None],
        maintain: Callable[[], None],
        startup: Callable[[], None],
        on_drop: Callable[[WriteJob], None],
        on_exit: Callable[[], None],
        tick: Callable[[], None] | None = None,
        queue_size: int,
        queue_max_bytes: int | None,
        interval_s: float,
    ) -> None:
        self._process, self._maintain, self._startup = process, maintain, startup
        self._on_drop, self._on_exit, self._tick = on_drop, on_exit, tick
        self._queue: queue.Queue[WriteJob | None] = queue.Queue(queue_size)
        self._max_bytes = queue_max_bytes
        self._interval = interval_s
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending: set[RawId] = set()  # queued or being written
        self._queued_bytes = 0
        self._stopping = threading.Event()
        self._deadline = math.inf
        self._thread = threading.Thread(target=self._run, name="ssd-writer", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def room(self) -> int:
        """About how many more jobs `submit` would take now (by count, not bytes)."""
        return max(0, self._queue.maxsize - len(self._pending))

    def submit(self, job: WriteJob) -> Admission:
        """Queue a job without ever waiting for room."""
        with self._lock:
            if self._stopping.is_set():
                return "closed"
            if job.rid in self._pending:
                return "duplicate"
            if self._max_bytes is not None and self._queued_bytes + job.nbytes > self._max_bytes:
                return "dropped"
            try:
                self._queue.put_nowait(job)
            except queue.Full:
                return "dropped"
            self._pending.add(job.rid)
            self._queued_bytes += job.nbytes
        return "queued"

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued job is done (written or dropped); False on timeout."""
        end = time.monotonic() + timeout_s
        with self._idle:
            while self._pending:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self, timeout_s: float) -> bool:
        """Keep writing for at most `timeout_s`, then drop what is left; True if the
        thread finished (a write already under way when time runs out is not cut short)."""
        with self._lock:
            if not self._stopping.is_set():
                self._deadline = time.monotonic() + timeout_s
                self._stopping.set()
        try:
            self._queue.put_nowait(None)  # wake the thread if it is waiting
        except queue.Full:
            pass
        self._thread.join(timeout_s + 0.5)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            self._startup()
            next_maintenance = time.monotonic() + self._interval
            while not self._stopping.is_set() or (
                not self._queue.empty() and time.monotonic() < self._deadline
            ):
                wait = min(1.0, max(0.0, next_maintenance - time.monotonic()))
                try:
                    job = self._queue.get(timeout=0.05 if self._stopping.is_set() else wait)
                except queue.Empty:
                    job = None
                if job is not None:
                    try:
                        self._process(job)
                    finally:
                        self._done(job)
                if self._tick is not None:
                    self._tick()  # after each job, and at least once a second when idle
                if time.monotonic() >= next_maintenance:
                    self._maintain()
                    next_maintenance = time.monotonic() + self._interval
        except Exception:
            log.exception("SSD cache: writer thread failed")
        finally:
            self._drain()
            self._on_exit()

    def _drain(self) -> None:
        with self._lock:
            self._stopping.set()  # also after a crash of the loop: refuse new jobs
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                self._on_drop(job)
                self._done(job)

    def _done(self, job: WriteJob) -> None:
        with self._idle:
            self._pending.discard(job.rid)
            self._queued_bytes -= job.nbytes
            self._idle.notify_all()
