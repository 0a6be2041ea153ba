"""metric_names: how each field of Engine.stats() is named and typed on /metrics, checked over
every stats dataclass with every field set to a different value (test_metrics checks a real
server's /v1/cache/stats against its /metrics)."""

from __future__ import annotations

from dataclasses import asdict, fields, is_dataclass

from engine_bridge.cache.checkpoint_writes import DeferredStats
from engine_bridge.cache.ram.manager import CacheStats
from engine_bridge.cache.shared.store import SharedStats
from engine_bridge.cache.ssd.store import SSDStats
from engine_bridge.cache.tier_writes import WriteStats
from engine_bridge.cache.tiers import TierStats
from engine_bridge.ops.memory import MemoryPressure
from engine_bridge.ops.request_stats import RequestStats
from engine_bridge.scheduling.scheduler import SchedulerStats
from engine_bridge.vision.features import FeatureStats
from proxy.cache_api import metric_names, metrics
from proxy.cache_api.metrics_shared import shared_histograms
from proxy.dialects.response_store import StoreStats
from tests.cache_api.test_metrics import FAULTS, P, Samples, _expected, _typed

# Families that existed before, seen only with a daily SSD cap or a shared store.
OLD_SHARED = """
shared_available shared_queued_writes shared_promotions_total shared_promoted_entries_total
shared_read_bytes_total shared_writes_total shared_written_bytes_total
shared_write_skips_total shared_unavailable_skips_total shared_write_drops_total
shared_errors_total shared_promotion_seconds shared_promotion_bytes ssd_write_cap_bytes
""".split()
# series{label:value}=section.field: what the families before read, where the name is
# not the rule's <section>_<field>.
OLD_READS = """
ram_entries{kind:block}=ram.blocks ram_entries{kind:checkpoint}=ram.checkpoints
ram_evictions_total{kind:block}=ram.evicted_blocks ssd_budget_bytes=ssd.max_bytes
ram_evictions_total{kind:checkpoint}=ram.evicted_checkpoints ssd_queued_writes=ssd.queued
ssd_written_bytes_total=ssd.bytes_written ssd_read_bytes_total=ssd.bytes_read
ssd_write_drops_total{reason:queue_full}=ssd.queue_drops ssd_quarantined_files_total=ssd.quarantined
ssd_write_drops_total{reason:disabled}=ssd.disabled_drops ssd_write_cap_bytes=ssd.max_write_per_day
ssd_write_drops_total{reason:oversize}=ssd.oversize_drops ssd_errors_total{op:read}=ssd.read_errors
ssd_write_drops_total{reason:daily_cap}=ssd.capped_drops ssd_errors_total{op:write}=ssd.write_errors
ssd_evictions_total{reason:capacity}=ssd.evictions ssd_evictions_total{reason:expired}=ssd.expired
ssd_reads_total{result:hit}=ssd.hits ssd_reads_total{result:miss}=ssd.misses
ssd_reads_total{result:no_ram}=ssd.promotion_failures shared_read_bytes_total=shared.bytes_read
shared_write_drops_total{reason:fault}=shared.fault_drops shared_queued_writes=shared.queued
shared_errors_total{kind:timeout}=shared.errors.timeout decode_steps_total=scheduler.decode_steps
speculative_accepted_tokens_total=scheduler.spec_accepted
"""


def _filled(cls, counter: list[int], **nested):
    """`cls` with every number a different value (bools true), `nested` as given."""
    values = {}
    for f in fields(cls):
        if f.name in nested:
            values[f.name] = nested[f.name]
            continue
        counter[0] += 1
        n = counter[0] * 1000
        if f.type in ("int", "int | None", "float", "bool"):
            values[f.name] = {"float": n + 0.5, "bool": True}.get(f.type, n)
        elif f.type.startswith("dict"):
            values[f.name] = {k: n + i for i, k in enumerate(f.default_factory())}
    return cls(**values)


def _dataclass_leaves(obj, path: tuple):
    """Every numeric field of a stats dataclass, nested ones recursively (dataclasses.fields),
    a dict field's entries one by one."""
    for f in fields(obj):
        v, here = getattr(obj, f.name), (*path, f.name)
        if is_dataclass(v):
            yield from _dataclass_leaves(v, here)
        elif isinstance(v, dict):
            yield from (((*here, k), n) for k, n in v.items())
        elif isinstance(v, (int, float)):
            yield here, v


def test_every_numeric_field_of_every_stats_dataclass_is_a_series():
    """The sections Engine.stats() is built from, shared store and vision included (the
    demo server has neither), each field distinct: each is the series metric_names names."""
    n = [0]
    tiers = TierStats(
        ram=_filled(CacheStats, n),
        ssd=_filled(SSDStats, n),
        shared=_filled(SharedStats, n),
        writes=_filled(WriteStats, n, deferred=_filled(DeferredStats, n)),
    )
    sections = {
        "requests": _filled(RequestStats, n),
        "scheduler": _filled(SchedulerStats, n),
        "memory": _filled(MemoryPressure, n),
        "vision": _filled(FeatureStats, n),
    }
    # The proxy's own stores, which the proxy adds to the engine's stats.
    responses = _filled(StoreStats, n)
    stats = {k: asdict(v) for k, v in sections.items()} | asdict(tiers)
    stats["proxy"] = {"responses": asdict(responses)}
    leaves = [leaf for k, v in sections.items() for leaf in _dataclass_leaves(v, (k,))]
    leaves += list(_dataclass_leaves(tiers, ()))
    leaves += list(_dataclass_leaves(responses, ("proxy", "responses")))
    assert {("ssd", "resumes"), ("writes", "deferred", "early")} <= dict(leaves).keys()
    assert ("proxy", "responses", "max_bytes") in dict(leaves)
    families = [*metrics.stats_families(stats), *shared_histograms(stats["shared"])]
    got: Samples = {}
    for family in families:
        for s in family.samples:
            got[(s.name, frozenset(s.labels.items()))] = s.value
    types = {(f.name + ("_total" if f.type == "counter" else ""), f.type) for f in families}
    assert {(P + n, t) for n, t in _typed(OLD_SHARED)} <= types
    want, skipped = _expected(leaves)
    assert not skipped
    for path, (key, v) in want.items():
        assert got.get(key) == v, (path, key)
    # Distinct values: no two fields feed one sample.
    assert len({key for key, _ in want.values()}) == len(want)
    for field in FAULTS:
        assert got[(f"{P}ssd_{field}_total", frozenset())] == stats["ssd"][field]

    # The families that existed before read the fields they always read.
    for spec in OLD_READS.split():
        series, field = spec.split("=")
        name, _, label = series.rstrip("}").partition("{")
        labels = frozenset([tuple(label.split(":"))] if label else [])
        want = stats
        for key in field.split("."):
            want = want[key]
        assert got[(P + name, labels)] == want, spec


def test_a_field_is_a_counter_or_a_gauge_by_the_rule():
    counters = ("folder_losses", 3), ("bytes_written", 3), ("decode_s", 0.5), ("evicted_bytes", 3)
    gauges = ("disabled", True), ("reload_ms_p95", 1.5), ("held_bytes", 3), ("max_queue", 3)
    gauges += ("last_promotion_bytes", 3), ("queued", 3), ("rewrites_pending", 3), ("bytes", 3)
    assert [metric_names.is_counter(*c) for c in counters + gauges] == [1] * 4 + [0] * 8
    # None and strings have no sample; the top-level copies of requests.* neither.
    for path, v in ((("ssd", "max_write_per_day"), None), (("ssd", "x"), "y"), (("hits",), 3)):
        assert metric_names.series(path, v) is None
