"""The shared Redis/Valkey tier's histograms, read from `Engine.stats()["shared"]` at each
scrape: each promotion's time and bytes. Its counters and levels are fields like any other
(metrics.stats_families); the bucket lists are the part of its stats a walk cannot read."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.metrics_core import HistogramMetricFamily, Metric

from engine_bridge.engine_settings import BYTES_BUCKETS, LATENCY_BUCKETS_S

PREFIX = "mlx_prompt_cache"


def shared_histograms(s: dict) -> Iterator[Metric]:
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
