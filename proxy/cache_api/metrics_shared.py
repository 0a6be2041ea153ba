"""Prometheus families of the shared Redis/Valkey tier, read from `Engine.stats()["shared"]`
at each scrape: its traffic, faults by kind, and each promotion's time and bytes."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from engine_bridge.cache.shared.config import BYTES_BUCKETS, LATENCY_BUCKETS_S

PREFIX = "mlx_prompt_cache"


def shared_metrics(s: dict) -> Iterator[Metric]:
    def counter(name: str, doc: str, value: float) -> Metric:
        return CounterMetricFamily(f"{PREFIX}_shared_{name}", doc, value=value)

    def gauge(name: str, doc: str, value: float) -> Metric:
        return GaugeMetricFamily(f"{PREFIX}_shared_{name}", doc, value=value)

    yield gauge(
        "available", "1 unless a fault keeps calls off the shared store", int(s["available"])
    )
    yield gauge("queued_writes", "Entries waiting to be sent to the shared store", s["queued"])
    yield counter("promotions", "Runs of entries read from the shared store", s["promotions"])
    yield counter("promoted_entries", "Entries read from the shared store", s["promoted_entries"])
    yield counter("read_bytes", "Bytes read from the shared store", s["bytes_read"])
    yield counter("writes", "Entries sent to the shared store", s["writes"])
    yield counter("written_bytes", "Bytes sent to the shared store", s["bytes_written"])
    yield counter(
        "write_skips", "Entries not sent: another machine had written them", s["write_skips"]
    )
    yield counter(
        "unavailable_skips",
        "Calls answered locally while the shared store was failing",
        s["unavailable_skips"],
    )
    drops = CounterMetricFamily(
        f"{PREFIX}_shared_write_drops",
        "Entries not sent: queue full, too large, or the store failing",
        labels=["reason"],
    )
    for reason, key in (("queue_full", "queue_drops"), ("oversize", "oversize_drops"), ("fault", "fault_drops")):  # fmt: skip
        drops.add_metric([reason], s[key])
    yield drops
    errors = CounterMetricFamily(
        f"{PREFIX}_shared_errors",
        "Shared store faults: down, timeout, auth, full, corrupt, error",
        labels=["kind"],
    )
    for kind, n in s["errors"].items():
        errors.add_metric([kind], n)
    yield errors
    yield _histogram(
        "promotion_seconds",
        "Time of each read round trip (a run of entries) from the shared store",
        LATENCY_BUCKETS_S,
        s["promotion_seconds_buckets"],
        s["promotion_seconds_sum"],
    )
    yield _histogram(
        "promotion_bytes",
        "Bytes of each read round trip from the shared store",
        BYTES_BUCKETS,
        s["promotion_bytes_buckets"],
        s["bytes_read"],
    )


def _histogram(name: str, doc: str, bounds, counts: list[int], total: float) -> Metric:
    buckets = [(repr(float(b)), n) for b, n in zip(bounds, counts, strict=False)]
    buckets.append(("+Inf", counts[-1] if counts else 0))
    return HistogramMetricFamily(f"{PREFIX}_shared_{name}", doc, buckets=buckets, sum_value=total)
