"""Prometheus `GET /metrics`, built with prometheus-client on a registry of the app's own.

Two sources, so nothing is counted twice:

- per request, as the engine finishes it (`Engine.on_result`): counters and
  histograms labelled by model, tenant and cache source;
- at scrape time, `EngineCollector` reads `Engine.stats()` and the session registry.
  `stats_families` walks every numeric field of the stats (the engine's stats dataclasses,
  nested: requests, scheduler, memory, RAM, SSD, shared, writes, vision) and the proxy's
  own stores (`proxy_stores`), so each counter of /v1/cache/stats is on /metrics too;
  metric_names says how a field is named and typed.

Label values are bounded: a model is one this process serves, a tenant one of the first
`MAX_TENANT_LABELS` seen (tenants named in [tenants] api_keys always have their own), and
the rest are "other". Histograms carry no tenant label: each tenant would cost a dozen
series per model.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from functools import partial

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine_bridge.engine import Engine
from engine_bridge.types import GenerationRequest, GenerationResult

from ..security import PASSTHROUGH_ROUTE, POLICY, api_key
from ..state import ENGINE, SETTINGS
from .metric_names import LABELLED, Path, is_labelled, series, skipped
from .metrics_shared import shared_histograms
from .proxy_stores import proxy_stats

PREFIX = "mlx_prompt_cache"
MAX_TENANT_LABELS = 32
MAX_LABEL_CHARS = 64
OTHER = "other"
# A session counts as active this long after its last request.
SESSION_WINDOW_S = 3600.0

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
PREFILL_BUCKETS = (25, 50, 100, 250, 500, 1000, 2000, 4000, 8000, 16000, 32000)
RESTORE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class TenantLabels:
    """Maps tenants to at most `cap` label values (first come), plus "other"."""

    def __init__(self, cap: int, always: Iterable[str] = ()):
        self.cap = cap
        # Tenants named in [tenants] api_keys are bounded by the config: never "other".
        self._known = {t for t in always if len(t) <= MAX_LABEL_CHARS}
        # At most `cap` names of at most MAX_LABEL_CHARS: bounded by construction.
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, tenant: str) -> str:
        if tenant in self._known or tenant in self._seen:
            return tenant
        if tenant == OTHER or len(tenant) > MAX_LABEL_CHARS:
            return OTHER
        with self._lock:
            if len(self._seen) < self.cap:
                self._seen.add(tenant)
                return tenant
        return OTHER


class RequestMetrics:
    """What each finished request adds; called on the MLX thread (the instruments lock)."""

    def __init__(self, registry: CollectorRegistry, engine: Engine, tenants: TenantLabels):
        self.engine = engine
        self.tenants = tenants
        by = ("model", "tenant", "source")

        def counter(name: str, doc: str, labels: tuple[str, ...] = by) -> Counter:
            return Counter(f"{PREFIX}_{name}", doc, labels, registry=registry)

        def histogram(name: str, doc: str, labels: tuple[str, ...], buckets) -> Histogram:
            return Histogram(f"{PREFIX}_{name}", doc, labels, buckets=buckets, registry=registry)

        self.requests = counter(
            "requests", "Generations finished, by cache source (bypass: the cache was not used)"
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished generations")
        self.cached_tokens = counter(
            "cached_tokens", "Prompt tokens restored from the cache instead of computed"
        )
        self.completion_tokens = counter(
            "completion_tokens", "Tokens generated", ("model", "tenant")
        )
        self.ttft = histogram(
            "ttft_seconds",
            "Time to first token, from queueing to the first sampled token",
            ("model", "source"),
            TTFT_BUCKETS,
        )
        self.prefill = histogram(
            "prefill_tokens_per_second",
            "Prefill speed of one request over the prompt tokens it computed",
            ("model",),
            PREFILL_BUCKETS,
        )
        self.restore = histogram(
            "restore_seconds",
            "Cache lookup, SSD promotion and restore of the cached prefix, per hit",
            ("model", "source"),
            RESTORE_BUCKETS,
        )

    def observe(self, req: GenerationRequest, r: GenerationResult) -> None:
        model = req.model if self.engine.has_model(req.model) else OTHER
        tenant = self.tenants(req.tenant)
        source = r.source if r.used_cache else "bypass"
        self.requests.labels(model, tenant, source).inc()
        self.prompt_tokens.labels(model, tenant, source).inc(r.prompt_tokens)
        self.cached_tokens.labels(model, tenant, source).inc(r.cached_tokens)
        self.completion_tokens.labels(model, tenant).inc(r.completion_tokens)
        if r.completion_tokens:  # a first token was sent (not cancelled before it)
            self.ttft.labels(model, source).observe(r.ttft_s)
        if (tok_s := r.prefill_tok_s) is not None:
            self.prefill.labels(model).observe(tok_s)
        if r.used_cache and r.cached_tokens:
            self.restore.labels(model, source).observe(r.restore_s)


class EngineCollector(Collector):
    """The engine's own totals and levels, and the proxy's stores (`proxy`, the section
    /v1/cache/stats adds), read at each scrape."""

    def __init__(self, engine: Engine, proxy: Callable[[], dict] = dict):
        self.engine = engine
        self.proxy = proxy

    def collect(self) -> Iterator[Metric]:
        stats = {**self.engine.stats(), "proxy": self.proxy()}
        yield from stats_families(stats)
        if stats.get("shared") is not None:
            yield from shared_histograms(stats["shared"])
        yield reason_metric(self.engine.miss_reasons(), self.engine.has_model)
        yield lost_metric(self.engine.lost_tokens(), self.engine.has_model)
        yield gauge(
            "hit_ratio_alert", "1 while the hit-ratio alert is on", int(bool(stats["alert"]))
        )
        yield from session_metrics(self.engine.session_records(), time.time())
        if stats.get("ranks"):
            yield from rank_metrics(stats["ranks"])


def rank_metrics(ranks: list[dict]) -> Iterator[Metric]:
    """A split model: what each rank's slices hold, as last gathered (every 10 s)."""
    held = GaugeMetricFamily(f"{PREFIX}_rank_cache_bytes",
                             "Bytes of cached state each rank holds, by tier",
                             labels=["rank", "tier"])  # fmt: skip
    kv = GaugeMetricFamily(f"{PREFIX}_rank_kv_bytes", "Live K/V bytes on each rank",
                           labels=["rank"])  # fmt: skip
    for r in ranks:
        rank = str(r["rank"])
        held.add_metric([rank, "ram"], r.get("ram_bytes", 0))
        held.add_metric([rank, "ssd"], r.get("ssd_bytes", 0))
        kv.add_metric([rank], r.get("kv_bytes", 0))
    yield held
    yield kv


def stats_families(stats: dict) -> Iterator[Metric]:
    """Every numeric field of `Engine.stats()` as a series, named and typed by
    metric_names (its docstring has the rules); fields folded into one family share it."""
    families: dict[str, Metric] = {}
    for path, value, labels in stats_fields(stats):
        s = series(path, value)
        if s is None:
            continue
        family = families.get(s.name)
        if family is None:
            make = CounterMetricFamily if s.counter else GaugeMetricFamily
            names = [k for k, _ in s.labels] + [k for k, _ in labels]
            family = families[s.name] = make(f"{PREFIX}_{s.name}", s.doc, labels=names)
        family.add_metric([v for _, v in s.labels + labels], float(value))
    return iter(families.values())


def stats_fields(stats: dict, path: Path = ()) -> Iterator[tuple[Path, object, tuple]]:
    """(path, value, labels) of each leaf: a section's fields recursively, a LABELLED
    dict's entries one by one (labelled by key), anything else as it is."""
    for key, value in stats.items():
        here = (*path, key)
        if isinstance(value, dict) and is_labelled(here):
            label = LABELLED[here]
            for k, v in value.items():
                yield here, v, ((label, str(k)),)
        elif isinstance(value, dict) and not skipped(here):
            yield from stats_fields(value, here)
        else:
            yield here, value, ()


def gauge(name: str, doc: str, value: float) -> Metric:
    return GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)


def reason_metric(totals: dict[tuple[str, str], int], served) -> Metric:
    doc = "Requests by why they hit or missed (GET /v1/cache/requests has each one's)"
    return _by_model(f"{PREFIX}_request_reasons", doc, "reason", totals, served)


def lost_metric(totals: dict[tuple[str, str], int], served) -> Metric:
    doc = "Prompt tokens computed again, by cause (GET /v1/cache/diagnosis ranks them)"
    return _by_model(f"{PREFIX}_lost_tokens", doc, "cause", totals, served)


def _by_model(
    name: str, doc: str, label: str, totals: dict[tuple[str, str], int], served
) -> Metric:
    """A counter by model and `label`; models no longer served count as one "other"."""
    out = CounterMetricFamily(name, doc, labels=["model", label])
    merged: dict[tuple[str, str], int] = {}
    for (model, value), n in totals.items():
        key = (model if served(model) else OTHER, value)
        merged[key] = merged.get(key, 0) + n
    for labels, n in sorted(merged.items()):
        out.add_metric(list(labels), n)
    return out


def session_metrics(records: list, now: float) -> Iterator[Metric]:
    yield gauge("sessions", "Client sessions with cached state", len(records))
    active = sum(1 for r in records if now - r.last_used <= SESSION_WINDOW_S)
    yield gauge("sessions_active", "Sessions used in the last hour", active)
    yield gauge(
        "sessions_pinned", "Sessions pinned against eviction", sum(r.pinned for r in records)
    )


# ---------------------------------------------------------------------------------------
# The app side: one registry per app (tests run several apps in a process), the error
# middleware, the route


class Metrics:
    """One app's registry and the instruments on it."""

    def __init__(
        self, engine: Engine, tenants: Iterable[str] = (), proxy: Callable[[], dict] = dict
    ):
        self.registry = CollectorRegistry()
        labels = TenantLabels(MAX_TENANT_LABELS, tenants)
        self.requests = RequestMetrics(self.registry, engine, labels)
        self.errors = Counter(
            f"{PREFIX}_http_errors",
            "Answers with status 400 or more, by route (passthrough: the upstream's routes)",
            ("status", "route"),
            registry=self.registry,
        )
        self.registry.register(EngineCollector(engine, proxy))


METRICS = web.AppKey("metrics", Metrics)


def setup_metrics(app: web.Application) -> None:
    """Count finished requests while the app runs (the engine may outlive the app)."""
    engine, settings = app[ENGINE], app[SETTINGS]
    # The stores are read at each scrape: the Responses route adds its store after this.
    proxy = partial(proxy_stats, app)
    app[METRICS] = metrics = Metrics(engine, settings.tenant_api_keys.values(), proxy)

    async def listen(app: web.Application):
        stop = engine.on_result(metrics.requests.observe)
        yield
        stop()

    app.cleanup_ctx.append(listen)


def route_group(request: web.Request) -> str:
    """The route's canonical path ("/v1/cache/sessions/{id}"), never the raw path."""
    route = request.match_info.route
    if route.resource is None:
        return "unmatched"
    if route.name == PASSTHROUGH_ROUTE:
        return "passthrough"
    return route.resource.canonical


@web.middleware
async def count_errors(request: web.Request, handler):
    """Outermost middleware: sees the final status of every answer, refusals included."""
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as e:
        status = e.status
        raise
    finally:
        if status >= 400:
            request.app[METRICS].errors.labels(str(status), route_group(request)).inc()


async def serve(request: web.Request) -> web.Response:
    registry = request.app[METRICS].registry
    tenant = scrape_tenant(request)
    if tenant is not None:
        registry = TenantView(registry, tenant)
    encode, content_type = choose_encoder(request.headers.get("Accept", ""))
    # Tens of ms with many tenants: off the event loop, which is streaming tokens. The stats
    # it reads are as safe to read from here as from the loop (the MLX thread writes them).
    body = await asyncio.to_thread(encode, registry)
    return web.Response(body=body, headers={"Content-Type": content_type})


def scrape_tenant(request: web.Request) -> str | None:
    """With API keys enforced, a scrape sees the per-tenant series of its key's tenant
    only; process-wide series (bytes, queue) it sees whole. None: it sees everything."""
    if not request.app[POLICY].api_keys:
        return None
    return request.app[SETTINGS].tenant_api_keys.get(api_key(request) or "", "")


class TenantView(Collector):
    """A registry's families without the samples of other tenants."""

    def __init__(self, source: CollectorRegistry, tenant: str):
        self.source = source
        self.tenant = tenant

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            kept = Metric(family.name, family.documentation, family.type, family.unit)
            kept.samples = [
                s for s in family.samples if s.labels.get("tenant", self.tenant) == self.tenant
            ]
            yield kept
