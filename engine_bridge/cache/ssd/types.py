"""The SSD tier's value types: its config, what `put` answers, an entry read back, and the
stats it reports with the counters behind them."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, NamedTuple

from engine_bridge.cache.ssd.index import Scope
from engine_bridge.cache.tensors import HostTensor

PutOutcome = Literal["queued", "duplicate", "dropped", "disabled"]
# Told that entries it put may be gone from disk (of one scope, or None: all of them);
# returns how many entries it still holds in RAM and will put again.
OnLost = Callable[[Scope | None], int]
_LATENCY_WINDOW = 1024


@dataclass(frozen=True, slots=True)
class SSDConfig:
    root: Path
    max_bytes: int = 10 * 1000**3
    ttl_s: float | None = None  # drop entries not used for this long
    queue_size: int = 256  # entries waiting for the writer
    queue_max_bytes: int | None = None  # and their total size, if bounded
    maintenance_interval_s: float = 30.0  # TTL sweep, last-access flush, scope folders
    check_interval_s: float = 1.0  # an idle writer looks for its folder this often
    retry_s: float = 1.0  # first probe after a failed write; then doubling, up to maintenance
    # "background": the store is usable at once and the writer reconciles first.
    reconcile: Literal["background", "sync", "off"] = "background"
    # Bytes the tier may write per UTC day; None: no cap (see wear.py).
    max_write_per_day: int | None = None


@dataclass(slots=True)
class SSDStats:
    """Counters since this store opened; entries and bytes are what the root holds now.

    Every get is exactly one of: hit, miss, promotion failure (the reservation said no).
    Quarantined reads also count as misses. Reload figures are over recent hits.
    """

    entries: int = 0
    bytes: int = 0
    max_bytes: int = 0  # the capacity limit ([cache.ssd] max_size) `bytes` is held under
    queued: int = 0
    writes: int = 0
    bytes_written: int = 0
    bytes_read: int = 0  # payload bytes read back by hits (promotions)
    spills: int = 0
    write_throughs: int = 0
    dedup_skips: int = 0
    queue_drops: int = 0
    disabled_drops: int = 0
    oversize_drops: int = 0
    write_errors: int = 0
    hits: int = 0
    misses: int = 0
    read_errors: int = 0
    reload_ms_mean: float = 0.0
    reload_ms_p95: float = 0.0
    reload_bytes_per_s: float = 0.0
    promotion_failures: int = 0
    quarantined: int = 0
    evictions: int = 0
    expired: int = 0
    folder_losses: int = 0  # folder or index found deleted while serving, and made again
    resumes: int = 0  # times writing came back after a failed write had turned it off
    disabled: bool = False
    disabled_reason: str | None = None
    # Wear (wear.py): bytes written today (UTC), kept across restarts, and the daily cap.
    written_today_bytes: int = 0
    max_write_per_day: int | None = None
    write_capped: bool = False
    capped_drops: int = 0
    superseded_skips: int = 0  # checkpoints a deeper one replaced before they were written
    write_history: list = field(default_factory=list)


class SSDEntry(NamedTuple):
    tensors: dict[str, HostTensor]  # read-only views into one buffer per entry
    meta: dict[str, str]


# Int fields of SSDStats that are not counters kept here (totals, gauges, the wear meter's).
_NOT_COUNTERS = (
    "entries", "bytes", "max_bytes", "queued", "folder_losses", "resumes",
    "bytes_read", "written_today_bytes", "capped_drops",
)  # fmt: skip
_COUNTER_NAMES = tuple(
    f.name for f in fields(SSDStats) if f.type == "int" and f.name not in _NOT_COUNTERS
)


@dataclass(slots=True)
class Counters:
    """The store's counters and recent read figures; the store guards them with its lock."""

    values: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_COUNTER_NAMES, 0))
    read_seconds: float = 0.0
    read_bytes: int = 0
    latencies_ms: deque = field(default_factory=lambda: deque(maxlen=_LATENCY_WINDOW))

    def hit(self, seconds: float, nbytes: int) -> None:
        self.values["hits"] += 1
        self.read_seconds += seconds
        self.read_bytes += nbytes
        self.latencies_ms.append(seconds * 1000)

    def snapshot(self, **gauges: Any) -> SSDStats:
        """SSDStats from the counters, plus the totals and gauges the store passes."""
        lat = sorted(self.latencies_ms)
        return SSDStats(
            **(self.values | gauges),
            bytes_read=self.read_bytes,
            reload_ms_mean=sum(lat) / len(lat) if lat else 0.0,
            reload_ms_p95=lat[math.ceil(0.95 * len(lat)) - 1] if lat else 0.0,
            reload_bytes_per_s=self.read_bytes / self.read_seconds if self.read_seconds else 0.0,
        )
