"""How one field of `Engine.stats()` (what /v1/cache/stats shows, with the proxy's own
stores under `proxy`) becomes a Prometheus series.

The stats are the engine's dataclasses turned into dicts (`asdict`), nested: sections
(`ram`, `ssd`, `writes.deferred`, ...) hold fields. `series(path, value)` says what a field
is on /metrics; `metrics.stats_families` walks every field through it, so a field added to
a stats dataclass is on /metrics at the next scrape with nothing copied by hand.

Names. A field is `mlx_prompt_cache_<section>_<field>`, nested sections joined by `_`
(`writes.deferred.held` is `writes_deferred_held`); prometheus-client adds `_total` to a
counter. NAMED keeps the names that existed before this walk (dashboards use them): some
differ from the rule (`ssd.max_bytes` is `ssd_budget_bytes`), and some fold several fields
into one family with a label (`ssd.queue_drops` is `ssd_write_drops_total{reason="queue_full"}`).

Types, by rule (`is_counter`): a bool is a gauge (0 or 1); a field COUNTERS names is a
counter; any other float is a gauge (means, percentiles, rates, ratios); an int is a gauge
when LEVELS names it, when it is `bytes` or ends in `_bytes`, or starts with `max_` or
`last_` (what a tier holds now, a setting, the last one); every other int is a counter,
a count since the process started.

Dicts. A dict at a path LABELLED names is one family with a label per key (per source, per
fault kind); any other dict is a section.

Skipped, by rule: strings and lists (`models`, `write_history`; the shared store's histogram
buckets, which `metrics_shared` turns into histograms), None (no sample this scrape: an
SSD without a daily cap has no `ssd_write_cap_bytes`), the top-level copies of
`requests.hits`, `misses` and `hit_ratio` (ALIASES), and `alert`, whose state is
`hit_ratio_alert`.

Help text comes from DOCS where the field's name alone is unclear, else from the section
and the field's name.
"""

from __future__ import annotations

from dataclasses import dataclass

Path = tuple[str, ...]

LEVELS = frozenset({
    "running", "prefilling", "waiting", "largest_batch", "blocks", "checkpoints", "entries",
    "queued", "held", "rewrites_pending", "feature_entries", "prepared_entries", "pending",
    "checkpoint_interval", "checkpoint_interval_min",
})  # fmt: skip
COUNTERS = frozenset({"evicted_bytes", "freed_bytes", "came_back_bytes", "decode_s", "prefill_s"})
LABELLED = {("requests", "by_source"): "source", ("shared", "errors"): "kind"}
ALIASES = frozenset({("hits",), ("misses",), ("hit_ratio",)})
SKIPPED = frozenset({("alert",)})
# Fields a histogram carries (metrics_shared): the sample they are, for tests to find.
IN_HISTOGRAMS = {("shared", "promotion_seconds_sum"): "shared_promotion_seconds_sum"}

SECTIONS = {
    "requests": "Requests, all models and tenants",
    "scheduler": "Scheduler",
    "memory": "Memory guard and allocator",
    "ram": "RAM tier",
    "ssd": "SSD tier",
    "shared": "Shared store",
    "writes": "SSD writes",
    "vision": "Vision caches",
    "warm_ahead": "Warming ahead (the next question's prefix, prefilled while idle)",
    "autotune": "Tuning by load (the RAM budget and eviction policy)",
    "reasoning_memo": "Reasoning kept per assistant turn, put back where clients drop it",
    "proxy": "The proxy's own stores",
}


@dataclass(frozen=True, slots=True)
class Series:
    name: str  # after the prefix, before a counter's `_total`
    counter: bool
    doc: str
    labels: tuple[tuple[str, str], ...] = ()  # fixed: a field folded into a labelled family


@dataclass(frozen=True, slots=True)
class Named:
    name: str
    doc: str
    labels: tuple[tuple[str, str], ...] = ()


def _fold(name: str, doc: str, label: str, by_field: dict[str, str]) -> dict[str, Named]:
    return {f: Named(name, doc, ((label, v),)) for f, v in by_field.items()}


def _section(section: str, named: dict[str, Named]) -> dict[Path, Named]:
    return {(*section.split("."), f): n for f, n in named.items()}


NAMED: dict[Path, Named] = {
    **_section("requests", {
        # "requests_total" is the per-request family's (model, tenant, source).
        "total": Named("requests_finished", "Generations finished, all models and tenants"),
        "cancelled": Named("requests_cancelled", "Generations ended by the client going away"),
    }),
    **_section("ram", {
        "bytes": Named("ram_bytes", "Bytes the RAM tier holds"),
        "budget_bytes": Named("ram_budget_bytes", "The RAM tier's budget now"),
        "pinned_bytes": Named(
            "ram_pinned_bytes", "RAM tier bytes held by running requests and pins"
        ),
        **_fold("ram_entries", "Entries in the RAM tier", "kind",
                {"blocks": "block", "checkpoints": "checkpoint"}),
        **_fold("ram_evictions", "Entries evicted from RAM", "kind",
                {"evicted_blocks": "block", "evicted_checkpoints": "checkpoint"}),
        "evicted_bytes": Named("ram_evicted_bytes", "Bytes evicted from the RAM tier"),
    }),
    **_section("ssd", {
        "bytes": Named("ssd_bytes", "Bytes the SSD tier holds"),
        "max_bytes": Named("ssd_budget_bytes", "The SSD tier's capacity limit"),
        "entries": Named("ssd_entries", "Entries (files) in the SSD tier"),
        "queued": Named("ssd_queued_writes", "Entries waiting for the SSD writer"),
        "disabled": Named("ssd_disabled", "1 while SSD writes are off after a fault"),
        "bytes_written": Named("ssd_written_bytes", "Bytes written to SSD files"),
        "bytes_read": Named("ssd_read_bytes", "Bytes read back from SSD files"),
        "writes": Named("ssd_writes", "Entries written to SSD"),
        "written_today_bytes": Named("ssd_written_today_bytes", "Bytes written today (UTC day)"),
        "max_write_per_day": Named("ssd_write_cap_bytes", "[cache.ssd] max_write_per_day"),
        "write_capped": Named("ssd_write_capped", "1 while today's write cap stops writes"),
        "superseded_skips": Named(
            "ssd_superseded_skips", "Checkpoints never written: a deeper one replaced them first"
        ),
        **_fold("ssd_write_drops",
                "Entries not written: queue full, writes off, larger than the tier, daily cap",
                "reason", {"queue_drops": "queue_full", "disabled_drops": "disabled",
                           "oversize_drops": "oversize", "capped_drops": "daily_cap"}),
        "quarantined": Named("ssd_quarantined_files", "Corrupt files moved to quarantine"),
        **_fold("ssd_errors", "SSD I/O errors", "op",
                {"write_errors": "write", "read_errors": "read"}),
        **_fold("ssd_evictions", "Entries removed from SSD", "reason",
                {"evictions": "capacity", "expired": "expired"}),
        **_fold("ssd_reads", "SSD entry reads by outcome", "result",
                {"hits": "hit", "misses": "miss", "promotion_failures": "no_ram"}),
    }),
    **_section("shared", {
        "available": Named(
            "shared_available", "1 unless a fault keeps calls off the shared store"
        ),
        "queued": Named("shared_queued_writes", "Entries waiting to be sent to the shared store"),
        "promotions": Named("shared_promotions", "Runs of entries read from the shared store"),
        "promoted_entries": Named("shared_promoted_entries", "Entries read from the shared store"),
        "bytes_read": Named("shared_read_bytes", "Bytes read from the shared store"),
        "writes": Named("shared_writes", "Entries sent to the shared store"),
        "bytes_written": Named("shared_written_bytes", "Bytes sent to the shared store"),
        "write_skips": Named(
            "shared_write_skips", "Entries not sent: another machine had written them"
        ),
        "unavailable_skips": Named(
            "shared_unavailable_skips", "Calls answered locally while the shared store was failing"
        ),
        **_fold("shared_write_drops",
                "Entries not sent: queue full, too large, or the store failing", "reason",
                {"queue_drops": "queue_full", "oversize_drops": "oversize",
                 "fault_drops": "fault"}),
        "errors": Named(
            "shared_errors", "Shared store faults: down, timeout, auth, full, corrupt, error"
        ),
    }),
    **_section("scheduler", {
        "running": Named("scheduler_running", "Sequences decoding now"),
        "prefilling": Named("scheduler_prefilling", "Sequences in prefill now"),
        "waiting": Named("scheduler_waiting", "Requests waiting for a batch slot"),
        "kv_bytes": Named("scheduler_kv_bytes", "Live K/V bytes of admitted sequences"),
        "rejected": Named("scheduler_rejected", "Requests refused with 429 (queue full)"),
        "decode_steps": Named(
            "decode_steps", "Model decode steps (one token per row, or one verify pass)"
        ),
        "decode_tokens": Named("decode_tokens", "Tokens decoded"),
        "tokens_per_step": Named("decode_tokens_per_step", "Tokens decoded per model step"),
        "spec_rounds": Named("speculative_rounds", "Speculative verify passes"),
        "spec_drafted": Named("speculative_drafted_tokens", "Draft tokens verified"),
        "spec_accepted": Named("speculative_accepted_tokens", "Draft tokens the model kept"),
        "spec_acceptance": Named("speculative_acceptance_ratio", "Draft tokens kept / verified"),
        "spec_replays": Named(
            "speculative_replays", "Verify passes whose rejection replayed recurrent state"
        ),
        "spec_paused_steps": Named(
            "speculative_paused_steps", "Batched steps in which speculation paused"
        ),
        # Seconds, Prometheus' base unit, in the name.
        "decode_s": Named("scheduler_decode_seconds", "Time spent in decode steps"),
        "prefill_s": Named("scheduler_prefill_seconds", "Time spent in prefill"),
    }),
}  # fmt: skip

# Help where the field's name says too little; the rest read "<section>: <field name>".
DOCS: dict[Path, str] = {
    **_section("requests", {
        "bypassed": "Generations that did not use the cache (bypass, cache-less models)",
        "hits": "Generations that restored cached tokens",
        "misses": "Generations that restored nothing",
        "by_source": "Generations that used the cache, by where their prefix came from",
        "last_cancelled_completion_tokens": "Tokens the last cancelled generation had sent",
        "hit_ratio": "Cached / prompt tokens of the generations that used the cache",
    }),
    **_section("scheduler", {
        "max_batch": "[engine] max_batch", "max_queue": "[engine] max_queue",
        "largest_batch": "The largest decode batch so far",
        "decode_rows": "Sequences per decode step, summed",
        "kv_memory_bytes": "The live K/V budget of admitted sequences",
        "admission_waits": "Steps in which the K/V budget held a request back",
        "mean_batch": "Sequences per decode step, on average",
        "decode_tok_s": "Tokens decoded per second of decode time",
        "prefill_tok_s": "Prompt tokens prefilled per second of prefill time",
    }),
    **_section("memory", {
        "floor_bytes": "Available memory the guard keeps ([cache.ram] min_available)",
        "available_bytes": "Available system memory at the guard's last check",
        "budget_bytes": "The RAM tier's budget as the memory guard set it",
        "active": "1 while memory pressure has shrunk the RAM tier's budget",
        "shrinks": "Times memory pressure shrank the RAM tier's budget",
        "freed_bytes": "Bytes the RAM tier evicted because of memory pressure",
        "kv_budget_bytes": "The live K/V budget the last load's preflight left",
        "mlx_active_bytes": "Bytes of MLX arrays alive",
        "mlx_cache_bytes": "Bytes MLX keeps freed for reuse",
        "mlx_peak_bytes": "The peak of MLX array bytes",
        "heap_in_use_bytes": "C heap bytes in use (MLX's CPU buffers included)",
        "heap_free_bytes": "C heap bytes free but kept",
        "heap_mmap_bytes": "C heap bytes in mmapped chunks",
        "last_load_weights_bytes": "Weight bytes of the last model load",
        "last_load_need_bytes": "Bytes the last load's preflight asked for",
        "last_load_available_bytes": "Bytes available at the last load's preflight",
    }),
    **_section("ram", {
        "reserved_bytes": "RAM tier bytes reserved for promotions in flight",
        "charged_bytes": "Bytes held outside the RAM tier against its budget (vision features)",
        "dedupe_hits": "Stores that found the entry already in RAM",
        "thinned_checkpoints": "Checkpoints dropped to keep fewer per sequence",
        "reserve_failures": "Reservations the RAM budget refused",
        "spill_errors": "Evicted entries that could not be spilled to SSD",
        "superseded_checkpoints": "Checkpoints a deeper one made first in line for eviction",
    }),
    **_section("ssd", {
        "spills": "Entries written to SSD because RAM evicted them",
        "write_throughs": "Entries written to SSD when stored (write_policy)",
        "dedup_skips": "Writes skipped: the SSD already held the entry",
        "folder_losses": "Times the cache folder or index was found deleted, and made again",
        "resumes": "Times SSD writes came back after a fault had turned them off",
        "reload_ms_mean": "Mean milliseconds of recent SSD promotions",
        "reload_ms_p95": "95th percentile milliseconds of recent SSD promotions",
        "reload_bytes_per_s": "Bytes per second of recent SSD promotions",
    }),
    **_section("shared", {
        "lookups": "Presence round trips to the shared store",
        "hits": "Entries the shared store's lookups found",
    }),
    **_section("writes", {
        "rewrites_pending": "Entries the SSD lost that RAM holds, waiting to be written again",
        "rewrite_failures": "Lost entries given up after failed rewrites",
    }),
    **_section("writes.deferred", {
        "held": "Checkpoint writes held back now", "held_bytes": "Bytes of those",
        "max_held": "The bound on held checkpoint writes",
        "max_held_bytes": "The bound on their bytes",
        "dropped": "Held checkpoint writes a deeper one superseded: never written",
        "early": "Held checkpoint writes sent early because the bound was reached",
    }),
    ("cache_enabled",): "1 unless the proxy runs with --no-cache",
    ("vision", "encoder_runs"): "Images the vision tower encoded (missed in every tier)",
    **_section("warm_ahead", {
        "offered": "Answers after which the next question's prefix was offered for warming",
        "warmed": "Warm-ups that stored the next question's whole prefix",
        "tokens": "Tokens prefilled ahead of the next question",
        "already_cached": "Offers the cache held already (history only grew at its end)",
        "preempted": "Warm-ups a request interrupted (offered again later)",
        "dropped": "Offers pushed out by newer sessions or given up after retries",
        "over_budget": "Offers skipped for the tokens-per-minute budget or the RAM share",
        "pending": "Warm-ups waiting or running now",
    }),
    **_section("proxy.responses", {
        "entries": "Responses stored for previous_response_id",
        "bytes": "JSON bytes of the stored responses' items, each item counted once",
        "max_bytes": "The bound on those bytes; the least recently used go first",
        "evicted": "Stored responses evicted to stay within the bound",
    }),
    **_section("reasoning_memo", {
        "restored": "Assistant turns a client sent without reasoning, given it back",
        "remembered": "Turns whose generated reasoning was kept",
    }),
}  # fmt: skip


def is_counter(field: str, value: object) -> bool:
    """The type rule of the module's docstring, from the field's name and value."""
    if isinstance(value, bool):
        return False
    if field in COUNTERS:
        return True
    if isinstance(value, float):
        return False
    level = field in LEVELS or field == "bytes" or field.endswith("_bytes")
    return not (level or field.startswith(("max_", "last_")))


def is_labelled(path: Path) -> bool:
    return path in LABELLED


def skipped(path: Path) -> bool:
    return path in ALIASES or path[:1] in SKIPPED or path in IN_HISTOGRAMS


def series(path: Path, value: object) -> Series | None:
    """What the stats field at `path` (or one entry of a LABELLED dict there) is on
    /metrics; None for what the rules skip: not a number, None, ALIASES and the like."""
    if skipped(path) or not isinstance(value, (int, float)):
        return None
    counter = is_counter(path[-1], value)
    if (named := NAMED.get(path)) is not None:
        return Series(named.name, counter, named.doc, named.labels)
    return Series("_".join(path), counter, _doc(path))


def _doc(path: Path) -> str:
    if (doc := DOCS.get(path)) is not None:
        return doc
    section = SECTIONS.get(path[0], path[0]) if len(path) > 1 else "Engine"
    return f"{section}: {' '.join(path[1:-1] + (path[-1].replace('_', ' '),))}"
