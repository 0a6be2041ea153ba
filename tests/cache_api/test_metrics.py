"""GET /metrics: Prometheus text from prometheus-client, checked against what requests got.

A real server with a RAM budget of about one conversation, so one run of SDK requests is a
miss, a RAM hit, an eviction and an SSD hit; every counter must move by exactly what the
responses reported, with the right model, tenant and source labels.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.cache_api import metric_names, metrics
from tests.conftest import fresh_cache_dir, start_server

LLAMA = "demo-llama"
P = "mlx_prompt_cache_"
# demo-llama's K/V: 2 layers x (K, V) x 2 heads x dim 16 x 4 bytes = 512 bytes a token.
BLOCK_BYTES = 512 * 64


def system_prompt(topic: str) -> str:
    """About 6 blocks of plain prose about `topic`."""
    line = f"The {topic} team writes every change to the {topic} ledger and checks it twice. "
    return line * 24


Samples = dict[tuple[str, frozenset], float]


def scrape(url: str, headers: dict | None = None) -> Samples:
    r = httpx.get(url + "/metrics", headers=headers or {}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    out: Samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((P + name, frozenset(labels.items())), 0.0)


def delta(after: Samples, before: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def label_values(samples: Samples, name: str, label: str) -> set[str]:
    return {dict(k)[label] for (n, k) in samples if n == P + name and label in dict(k)}


@dataclass(slots=True)
class Answer:
    tenant: str
    source: str  # the x-prompt-cache-source header, or "bypass"
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


def ask_openai(url: str, system: str, tenant: str, session: str) -> Answer:
    client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=120)
    raw = client.chat.completions.with_raw_response.create(
        model=LLAMA,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": "Go on."}],
        max_tokens=8,
        temperature=0,
        extra_headers={"x-tenant": tenant, "x-session-id": session},
    )
    usage = raw.parse().usage
    cached = usage.prompt_tokens_details.cached_tokens
    assert int(raw.headers["x-prompt-cache-hit-tokens"]) == cached
    return Answer(
        tenant,
        raw.headers["x-prompt-cache-source"],
        usage.prompt_tokens,
        cached,
        usage.completion_tokens,
    )


def ask_anthropic(url: str, system: str, tenant: str, *, bypass: bool = False) -> Answer:
    client = anthropic.Anthropic(base_url=url, api_key="k", max_retries=0, timeout=120)
    headers = {"x-tenant": tenant} | ({"x-prompt-cache": "bypass"} if bypass else {})
    raw = client.messages.with_raw_response.create(
        model=LLAMA,
        system=system,
        messages=[{"role": "user", "content": "Go on."}],
        max_tokens=8,
        extra_body={"temperature": 0},
        extra_headers=headers,
    )
    usage = raw.parse().usage
    prompt = usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens
    source = "bypass" if bypass else raw.headers["x-prompt-cache-source"]
    return Answer(tenant, source, prompt, usage.cache_read_input_tokens, usage.output_tokens)


@pytest.fixture(scope="module")
def server(demo_root, tmp_path_factory):
    cache_dir = fresh_cache_dir(demo_root, tmp_path_factory.mktemp("metrics-cache"))
    config = cache_dir / "config.toml"
    # Room for one conversation (6-7 blocks and its checkpoints), not two: a second
    # conversation evicts the first from RAM, and the first comes back from SSD. Tuning
    # runs (its counters are on /metrics) but may not grow the budget past that.
    budget = 10 * BLOCK_BYTES
    config.write_text(f'[cache.ram]\nbudget = "{budget}"\n\n[autotune]\nram_max = "{budget}"\n')
    s = start_server(cache_dir, "--config", str(config), "--upstream", "http://127.0.0.1:9")
    yield s
    s.stop()


def idle_stats(url: str) -> dict:
    """/v1/cache/stats once the SSD writer has nothing queued."""
    deadline = time.monotonic() + 30
    while True:
        stats = httpx.get(url + "/v1/cache/stats", timeout=30).json()
        if not stats["ssd"]["queued"] or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def test_counters_move_by_what_each_request_got_with_model_tenant_and_source(server):
    url = server.url
    before = scrape(url)
    a, b = system_prompt("billing"), system_prompt("shipping")
    answers = [
        ask_openai(url, a, "alice", "conv-a"),  # nothing cached yet
        ask_openai(url, a, "alice", "conv-a"),  # from RAM
        # Another tenant (nothing shared, not even the template's first tokens) evicts the
        # first conversation from RAM.
        ask_anthropic(url, b, "carol"),
        ask_openai(url, a, "alice", "conv-a"),  # back from SSD
        ask_anthropic(url, a, "bob", bypass=True),
    ]
    assert [x.source for x in answers] == ["none", "ram", "none", "ssd", "bypass"]
    with pytest.raises(openai.BadRequestError):
        openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0).chat.completions.create(
            model=LLAMA, messages=[{"role": "user", "content": "hi"}], max_tokens=-1
        )
    # The upstream is down: a passthrough error, grouped under one label, not its path.
    assert httpx.get(url + "/v1/embeddings/abc123", timeout=30).status_code >= 500
    after = scrape(url)

    counted: Counter = Counter()  # (counter, tenant, source) -> expected delta
    ttft, restore, prefill = Counter(), Counter(), 0
    for x in answers:
        counted["requests", x.tenant, x.source] += 1
        counted["prompt_tokens", x.tenant, x.source] += x.prompt_tokens
        counted["cached_tokens", x.tenant, x.source] += x.cached_tokens
        ttft[x.source] += x.completion_tokens > 0
        restore[x.source] += x.cached_tokens > 0
        # Every request computes at least its last prompt token, in the prefill's last
        # chunk, which samples the first token.
        prefill += x.prompt_tokens - x.cached_tokens > 0
    for (name, tenant, source), n in counted.items():
        got = delta(after, before, name + "_total", model=LLAMA, tenant=tenant, source=source)
        assert got == n, (name, tenant, source)
    assert sum(x.cached_tokens for x in answers if x.source in ("ram", "ssd")) > 0
    for source in ("none", "ram", "ssd", "bypass"):
        got = delta(after, before, "ttft_seconds_count", model=LLAMA, source=source)
        assert got == ttft[source] >= 1, source
        assert delta(after, before, "ttft_seconds_sum", model=LLAMA, source=source) > 0
    for source in ("ram", "ssd"):
        got = delta(after, before, "restore_seconds_count", model=LLAMA, source=source)
        assert got == restore[source] == 1, source
    assert delta(after, before, "restore_seconds_count", model=LLAMA, source="none") == 0
    assert delta(after, before, "prefill_tokens_per_second_count", model=LLAMA) == prefill
    assert delta(after, before, "completion_tokens_total", model=LLAMA, tenant="alice") == sum(
        x.completion_tokens for x in answers if x.tenant == "alice"
    )
    # Why each one hit or missed, as GET /v1/cache/requests lists them.
    listed = httpx.get(url + "/v1/cache/requests?limit=5", timeout=30).json()["requests"]
    reasons = Counter(r["reason"] for r in listed)
    assert reasons["bypass"] == 1 and reasons["new_session"] >= 1
    for reason, n in reasons.items():
        assert delta(after, before, "request_reasons_total", model=LLAMA, reason=reason) == n
    errors = "http_errors_total"
    assert delta(after, before, errors, status="400", route="/v1/chat/completions") == 1
    routes = label_values(after, errors, "route")
    assert "passthrough" in routes and not any("abc123" in r for r in routes)

    # The levels and totals read at scrape time are /v1/cache/stats' own.
    stats = idle_stats(url)
    now = scrape(url)
    ram, ssd = stats["ram"], stats["ssd"]
    assert value(now, "ram_bytes") == ram["bytes"] > 0
    assert value(now, "ram_budget_bytes") == ram["budget_bytes"] == 10 * BLOCK_BYTES
    assert value(now, "ram_entries", kind="block") == ram["blocks"]
    assert value(now, "ram_evictions_total", kind="block") == ram["evicted_blocks"] > 0
    assert value(now, "ram_evicted_bytes_total") == ram["evicted_bytes"] > 0
    assert value(now, "ssd_bytes") == ssd["bytes"] > 0
    assert value(now, "ssd_entries") == ssd["entries"] > 0
    assert value(now, "ssd_written_bytes_total") == ssd["bytes_written"] > 0
    assert value(now, "ssd_read_bytes_total") == ssd["bytes_read"] > 0
    assert value(now, "ssd_reads_total", result="hit") == ssd["hits"] > 0
    assert value(now, "ssd_budget_bytes") == ssd["max_bytes"] == 10 * 1000**3
    assert value(now, "ssd_write_drops_total", reason="queue_full") == ssd["queue_drops"]
    assert value(now, "ssd_quarantined_files_total") == ssd["quarantined"]
    assert value(now, "hit_ratio_alert") == (stats["alert"] is not None)
    assert value(now, "scheduler_running") == stats["scheduler"]["running"] == 0
    assert value(now, "scheduler_waiting") == stats["scheduler"]["waiting"] == 0
    listed = httpx.get(url + "/v1/cache/sessions", timeout=30).json()["sessions"]
    assert value(now, "sessions") == len(listed) >= 1


def test_tenant_labels_are_capped_and_the_rest_count_as_other(server):
    url = server.url
    before = scrape(url)
    known = label_values(before, "requests_total", "tenant") - {"other"}
    for i in range(40):
        body = {"model": LLAMA, "messages": [{"role": "user", "content": f"n{i}"}]}
        body["max_tokens"] = 1
        r = httpx.post(
            url + "/v1/chat/completions", json=body, headers={"x-tenant": f"t{i:02d}"}, timeout=60
        )
        assert r.status_code == 200, r.text
    after = scrape(url)
    for name in ("requests_total", "prompt_tokens_total", "completion_tokens_total"):
        tenants = label_values(after, name, "tenant")
        assert len(tenants - {"other"}) == metrics.MAX_TENANT_LABELS, name
    labelled = metrics.MAX_TENANT_LABELS - len(known)
    other = sum(
        v - before.get(k, 0.0)
        for k, v in after.items()
        if k[0] == P + "requests_total" and dict(k[1])["tenant"] == "other"
    )
    assert other == 40 - labelled
    assert {f"t{i:02d}" for i in range(labelled)} <= label_values(after, "requests_total", "tenant")


def test_a_client_that_hangs_up_mid_stream_is_still_counted(server):
    before = scrape(server.url)
    body = {"model": LLAMA, "max_tokens": 400, "stream": True, "temperature": 0}
    body["messages"] = [{"role": "user", "content": "Tell me a long story."}]
    headers = {"x-tenant": "hangup"}
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", json=body, headers=headers, timeout=60
    ) as r:
        assert r.status_code == 200
        next(r.iter_lines())
    deadline = time.monotonic() + 30
    while True:
        after = scrape(server.url)
        counted = sum(
            v - before.get(k, 0.0)
            for k, v in after.items()
            if k[0] == P + "requests_total" and dict(k[1])["tenant"] in ("hangup", "other")
        )
        if counted or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert counted == 1
    # Cancelled, unless the model finished before the hang-up was seen (400 tokens, or EOS).
    cancelled = delta(after, before, "requests_cancelled_total")
    generated = sum(
        v - before.get(k, 0.0)
        for k, v in after.items()
        if k[0] == P + "completion_tokens_total" and dict(k[1])["tenant"] in ("hangup", "other")
    )
    assert cancelled in (0, 1) and (generated < 400 if cancelled else generated >= 1)


def test_api_keys_scope_a_scrape_to_the_keys_tenant(demo_root, tmp_path):
    cache_dir = fresh_cache_dir(demo_root, tmp_path / "cache")
    config = tmp_path / "config.toml"
    config.write_text('[tenants.api_keys]\n"sk-alice" = "alice"\n"sk-bob" = "bob"\n')
    s = start_server(cache_dir, "--config", str(config), "--host", "0.0.0.0")
    try:
        r = httpx.get(s.url + "/metrics", timeout=30)
        assert r.status_code == 401 and "api_keys" in r.json()["error"]["message"]
        for key, content in (("sk-alice", "a"), ("sk-bob", "b"), ("sk-bob", "c")):
            body = {"model": LLAMA, "max_tokens": 1}
            body["messages"] = [{"role": "user", "content": content}]
            # A header naming another tenant does not make bob alice.
            headers = {"authorization": f"Bearer {key}", "x-tenant": "alice"}
            r = httpx.post(s.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
            assert r.status_code == 200, r.text
        for key, tenant, n in (("sk-alice", "alice", 1), ("sk-bob", "bob", 2)):
            seen = scrape(s.url, {"x-api-key": key})
            assert label_values(seen, "requests_total", "tenant") == {tenant}
            total = sum(v for (k, _), v in seen.items() if k == P + "requests_total")
            assert total == n
            # Process-wide series are everyone's; the refused scrape was counted.
            assert value(seen, "ram_bytes") > 0
            assert value(seen, "http_errors_total", status="401", route="/metrics") == 1
    finally:
        s.stop()


def test_openmetrics_is_served_when_asked_for(server):
    r = httpx.get(
        server.url + "/metrics", headers={"Accept": "application/openmetrics-text"}, timeout=30
    )
    assert r.headers["content-type"].startswith("application/openmetrics-text")
    assert r.text.endswith("# EOF\n")
    assert f"# TYPE {P}ttft_seconds histogram" in r.text


# ---------------------------------------------------------------------------------------
# Every stats field is a series: /metrics is a walk over Engine.stats(), not a copy by hand

# The families /metrics had before the walk (dashboards use them) keep their names and
# types: a histogram if HISTOGRAMS says, a counter if it ends in _total, else a gauge.
# ssd_write_cap_bytes is there with [cache.ssd] max_write_per_day, shared_* with a shared
# store: test_metric_names checks those.
OLD_FAMILIES = """
requests_total prompt_tokens_total cached_tokens_total completion_tokens_total ttft_seconds
prefill_tokens_per_second restore_seconds http_errors_total requests_cancelled_total
ram_bytes ram_budget_bytes ram_pinned_bytes ram_entries ram_evictions_total
ram_evicted_bytes_total ssd_bytes ssd_budget_bytes ssd_entries ssd_queued_writes ssd_disabled
ssd_written_bytes_total ssd_read_bytes_total ssd_writes_total ssd_written_today_bytes
ssd_write_capped ssd_superseded_skips_total ssd_write_drops_total ssd_quarantined_files_total
ssd_errors_total ssd_evictions_total ssd_reads_total scheduler_running scheduler_prefilling
scheduler_waiting scheduler_kv_bytes scheduler_rejected_total decode_steps_total
decode_tokens_total decode_tokens_per_step speculative_rounds_total
speculative_drafted_tokens_total speculative_accepted_tokens_total
speculative_acceptance_ratio speculative_replays_total speculative_paused_steps_total
request_reasons_total hit_ratio_alert sessions sessions_active sessions_pinned
""".split()
HISTOGRAMS = {"ttft_seconds", "prefill_tokens_per_second", "restore_seconds"}
HISTOGRAMS |= {"shared_promotion_seconds", "shared_promotion_bytes"}
# The SSD's fault counters /metrics left out before (issue 23): ssd_<field>_total.
FAULTS = ("folder_losses", "resumes", "spills", "write_throughs", "dedup_skips")
# Allocator figures move between any two reads: there, present is enough.
VOLATILE = (("memory", "mlx_"), ("memory", "heap_"))


def _typed(names: list[str]) -> set[tuple[str, str]]:
    kind = {True: "counter", False: "gauge"}
    return {(n, "histogram" if n in HISTOGRAMS else kind[n.endswith("_total")]) for n in names}


def _types(text: str) -> set[tuple[str, str]]:
    """(name, type) of each `# TYPE` line, prefix off."""
    lines = (line.split() for line in text.splitlines() if line.startswith("# TYPE "))
    return {(parts[2].removeprefix(P), parts[3]) for parts in lines}


def _expected(leaves) -> tuple[dict, set]:
    """What /metrics must show for each (path, value) stats leaf, by metric_names; and the
    leaves it skips. A leaf inside a LABELLED dict is that family's sample for its key."""
    want, skipped = {}, set()
    for path, v in leaves:
        labelled = metric_names.LABELLED.get(path[:-1])
        s = metric_names.series(path[:-1] if labelled else path, v)
        if path in metric_names.IN_HISTOGRAMS:
            want[path] = (P + metric_names.IN_HISTOGRAMS[path], frozenset()), float(v)
        elif s is None:
            skipped.add(path)
        else:
            labels = s.labels + (((labelled, path[-1]),) if labelled else ())
            name = P + s.name + ("_total" if s.counter else "")
            want[path] = (name, frozenset(labels)), float(v)
    return want, skipped


def _json_leaves(d: dict, path: tuple = ()):
    """Every number of a /v1/cache/stats answer (bools are numbers), by its key path."""
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _json_leaves(v, (*path, k))
        elif isinstance(v, (int, float)):
            yield (*path, k), v


def test_every_number_in_the_stats_is_a_series_with_its_value(server):
    url = server.url
    # Its own request, so it holds alone: the SSD tier has written something through.
    ask_openai(url, system_prompt("every number"), "numbers", "numbers")
    text = httpx.get(url + "/metrics", timeout=30).text
    assert _typed(OLD_FAMILIES) <= _types(text)
    for _ in range(20):  # until nothing but allocator figures moved around the scrape
        first = idle_stats(url)
        got = scrape(url)
        second = httpx.get(url + "/v1/cache/stats", timeout=30).json()
        if _steady(first) == _steady(second):
            break
    want, skipped = _expected(_json_leaves(first))
    # Skipped numbers are the copies of requests.* at the top, and the alert's own state.
    assert {p for p in skipped if p[0] != "alert"} == metric_names.ALIASES
    assert len(want) > 100
    for path, (key, v) in want.items():
        assert key in got, (path, key)
        if not _volatile(path):
            assert got[key] == v, (path, key)
    for field in FAULTS:
        assert got[(f"{P}ssd_{field}_total", frozenset())] == first["ssd"][field], field
    assert first["ssd"]["write_throughs"] > 0


def _volatile(path: tuple) -> bool:
    return any(path[0] == section and path[1].startswith(f) for section, f in VOLATILE)


def _steady(stats: dict) -> list:
    return [(p, v) for p, v in _json_leaves(stats) if not _volatile(p)]


# Every counter family /metrics exposes, written out here rather than read from
# metric_names (the code under test): a counter retyped as a gauge, or one that lost its
# `_total`, breaks dashboards' rate() queries, and fails this test.
COUNTER_FAMILIES = frozenset(
    """
autotune_ghost_hits_came_back_bytes_total autotune_ghost_hits_frequent_total
autotune_ghost_hits_recent_total
cached_tokens_total completion_tokens_total decode_steps_total decode_tokens_total
http_errors_total lost_tokens_total memory_freed_bytes_total memory_shrinks_total
prompt_tokens_total
proxy_responses_evicted_total ram_dedupe_hits_total ram_evicted_bytes_total
ram_evictions_total ram_reserve_failures_total ram_spill_errors_total
ram_superseded_checkpoints_total ram_thinned_checkpoints_total
reads_budget_refusals_total reads_bytes_read_total reads_entries_read_total reads_errors_total
reads_late_shared_total
reads_late_ssd_total reads_prefetches_total reasoning_memo_evicted_total
reasoning_memo_remembered_total reasoning_memo_restored_total request_reasons_total
requests_by_source_total requests_bypassed_total requests_cached_tokens_total
requests_cancelled_total requests_completed_total requests_completion_tokens_total
requests_finished_total requests_hits_total requests_misses_total
requests_prompt_tokens_total requests_total scheduler_admission_waits_total
scheduler_decode_rows_total scheduler_decode_seconds_total
scheduler_prefill_seconds_total scheduler_prefill_tokens_total scheduler_rejected_total
speculative_accepted_tokens_total speculative_drafted_tokens_total
speculative_paused_steps_total speculative_replays_total speculative_rounds_total
ssd_dedup_skips_total ssd_errors_total ssd_evictions_total ssd_folder_losses_total
ssd_quarantined_files_total ssd_read_bytes_total ssd_reads_total ssd_resumes_total
ssd_spills_total ssd_superseded_skips_total ssd_write_drops_total
ssd_write_throughs_total ssd_writes_total ssd_written_bytes_total
warm_ahead_already_cached_total warm_ahead_dropped_total warm_ahead_failed_total
warm_ahead_offered_total warm_ahead_over_budget_total warm_ahead_preempted_total
warm_ahead_prefill_s_total warm_ahead_tokens_total warm_ahead_warmed_total
writes_deferred_dropped_total writes_deferred_early_total writes_rewrite_failures_total
""".split()
)


def test_the_counter_families_are_the_ones_dashboards_rate(server):
    ask_openai(server.url, system_prompt("counters"), "counters", "counters")
    text = httpx.get(server.url + "/metrics", timeout=30).text
    counters = {name for name, kind in _types(text) if kind == "counter"}
    assert counters == COUNTER_FAMILIES, sorted(counters)
