"""SSD wear: bytes written per UTC day, kept across restarts, and an optional daily cap.

The meter lives in a small JSON file next to the SSD index (`wear.json`), rewritten
atomically at most every `save_every_s` seconds from the writer thread and at close, so a
restart does not reset today's count (a kill -9 loses at most that many seconds of it). A
flash drive's endurance is rated in bytes written, so that is what is counted: whole entry
files, header included. When `max_per_day` is reached, writes stop until the next UTC day;
reads go on, and one WARNING says so.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

log = logging.getLogger(__name__)

WEAR_FILE = "wear.json"
# Days of history kept in the file and shown in stats.
HISTORY_DAYS = 14


def utc_day(now: float) -> str:
    return datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%d")


@dataclass(frozen=True, slots=True)
class WearStats:
    written_today_bytes: int
    max_write_per_day: int | None
    capped: bool  # today's cap is reached: writes are dropped until the next UTC day
    capped_drops: int  # entries not written because of the cap, since start
    history: list[dict[str, int | str]]  # [{"day": "YYYY-MM-DD", "bytes": N}], newest first


class WearMeter:
    """Bytes written per UTC day; thread-safe; `allow` says whether a write may go ahead."""

    def __init__(
        self,
        path: Path,
        max_per_day: int | None = None,
        *,
        save_every_s: float = 5.0,
        clock=time.time,
    ) -> None:
        assert max_per_day is None or max_per_day > 0, f"max_per_day {max_per_day}"
        self.path = path
        self.max_per_day = max_per_day
        self._save_every = save_every_s
        self._clock = clock
        self._lock = threading.Lock()
        self._days: dict[str, int] = self._load()
        self._dirty = False
        self._saved_at = 0.0
        self._warned_day: str | None = None
        self._drops = 0

    def _load(self) -> dict[str, int]:
        try:
            raw = json.loads(self.path.read_text())
            days = raw["days"]
            return {str(d): int(n) for d, n in days.items() if int(n) >= 0}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            # A lost meter undercounts one day; it must never stop the tier from starting.
            log.warning("SSD cache: ignoring unreadable %s: %s", self.path, e)
            return {}

    def allow(self) -> bool:
        """Whether today's writes are still under the cap (the write that crosses it goes
        ahead: an entry is never cut); counts a refusal, and warns once a day."""
        if self.max_per_day is None:
            return True
        day = utc_day(self._clock())
        with self._lock:
            today = self._days.get(day, 0)
            if today < self.max_per_day:
                return True
            self._drops += 1
            warn = self._warned_day != day
            self._warned_day = day
        if warn:
            log.warning(
                "SSD cache: %d bytes written today (UTC %s) reached [cache.ssd] "
                "max_write_per_day = %d; no more writes until the next UTC day, reads go on",
                today, day, self.max_per_day,
            )  # fmt: skip
        return False

    def record(self, nbytes: int) -> None:
        day = utc_day(self._clock())
        with self._lock:
            self._days[day] = self._days.get(day, 0) + nbytes
            self._dirty = True

    def maybe_save(self) -> None:
        """Save if something changed and the last save is `save_every_s` old."""
        if self._dirty and time.monotonic() - self._saved_at >= self._save_every:
            self.save()

    def save(self) -> None:
        with self._lock:
            if not self._dirty:
                return
            keep = sorted(self._days)[-HISTORY_DAYS:]
            self._days = {d: self._days[d] for d in keep}
            body = json.dumps({"version": 1, "days": self._days}, sort_keys=True)
            self._dirty = False
            self._saved_at = time.monotonic()
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(body)
            os.replace(tmp, self.path)
        except OSError as e:
            log.debug("SSD cache: cannot save %s: %s", self.path, e)
            with self._lock:
                self._dirty = True

    def stats(self) -> WearStats:
        day = utc_day(self._clock())
        with self._lock:
            today = self._days.get(day, 0)
            history = [{"day": d, "bytes": self._days[d]} for d in sorted(self._days, reverse=True)]
            drops = self._drops
        capped = self.max_per_day is not None and today >= self.max_per_day
        return WearStats(today, self.max_per_day, capped, drops, history[:HISTORY_DAYS])
