"""Two proxies, two cache folders, one redis-server (issue 14, item 6): a prompt computed
on proxy A is served to proxy B from the shared store with `x-prompt-cache-source: shared`
and the same greedy output as bypass; tenants stay apart across machines; a corrupt, slow,
stopped or password-locked store leaves B answering 200 from its own tiers."""

from __future__ import annotations

import time

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from bench.scenarios.shared_relay import DelayRelay
from tests.cache.test_cache_http import ask_openai, long_system
from tests.conftest import QWEN36, fresh_cache_dir, start_server
from tests.support.redis_helpers import RedisServer, redis_fixture

LLAMA, HYBRID = "demo-llama", "demo-hybrid"


@pytest.fixture(scope="module")
def redis_store(tmp_path_factory):
    yield from redis_fixture(tmp_path_factory.mktemp("redis"))


@pytest.fixture(scope="module")
def relay(redis_store):
    """B reaches the store through a relay whose delay a test can raise (a slow store)."""
    r = DelayRelay(("127.0.0.1", redis_store.port), delay_s=0.0)
    yield r
    r.close()


def proxy(demo_root, tmp_path_factory, name: str, url: str, **env: str):
    cache = fresh_cache_dir(demo_root, tmp_path_factory.mktemp(name))
    settings = {
        "MLX_PROMPT_CACHE_CACHE_SHARED_URL": url,
        "MLX_PROMPT_CACHE_CACHE_SHARED_WRITE_POLICY": "all",
        "MLX_PROMPT_CACHE_CACHE_SHARED_TIMEOUT": "0.5",
        "MLX_PROMPT_CACHE_CACHE_SSD_CHECKPOINT_WRITE_DELAY": "0",
        **env,
    }
    served = [arg for model in (LLAMA, HYBRID, QWEN36) for arg in ("--model", model)]
    return start_server(cache, "--upstream", "http://127.0.0.1:9", *served, env=settings)


@pytest.fixture(scope="module")
def pair(demo_root, tmp_path_factory, redis_store, relay):
    a = proxy(demo_root, tmp_path_factory, "proxy-a", redis_store.url)
    b = proxy(demo_root, tmp_path_factory, "proxy-b", relay.url)
    yield a, b
    a.stop()
    b.stop()


def shared_stats(url: str) -> dict:
    return httpx.get(url + "/v1/cache/stats", timeout=30).json()["shared"]


def sent(url: str) -> dict:
    """Wait until the proxy has sent what it queued for the store; its shared stats."""
    deadline = time.monotonic() + 60
    while (s := shared_stats(url))["queued"] and time.monotonic() < deadline:
        time.sleep(0.1)
    return s


def probe(url: str, model: str, system: str, messages: list[dict], *, tenant: str) -> dict:
    body = {"model": model, "messages": [{"role": "system", "content": system}, *messages]}
    r = httpx.post(url + "/v1/cache/probe", json=body, headers={"x-tenant": tenant}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.mark.parametrize("model", [LLAMA, HYBRID, QWEN36])
def test_a_prompt_computed_on_a_is_served_to_b_from_shared(pair, model):
    a, b = pair
    system = long_system(40, salt=f"{model} shared ")
    first = ask_openai(a.url, model, system, user("Which queue?"), tenant="alice")
    assert first.source == "none"
    assert sent(a.url)["writes"] > 0
    probed = probe(b.url, model, system, user("Which queue?"), tenant="alice")
    on_b = ask_openai(b.url, model, system, user("Which queue?"), tenant="alice")
    assert on_b.source == "shared" and on_b.cached > 0
    # The probe told, before the request, what the shared store (not B's SSD) would give.
    assert (probed["ssd_tokens"], probed["shared_tokens"]) == (
        0,
        on_b.cached - probed["ram_tokens"],
    )
    if model == LLAMA:  # blocks alone: all but the last partial block and token
        assert on_b.cached >= first.prompt_tokens - 64
    bypass = ask_openai(b.url, model, system, user("Which queue?"), tenant="alice", bypass=True)
    assert on_b.text == bypass.text == first.text
    s = shared_stats(b.url)
    assert s["promotions"] >= 1 and s["bytes_read"] > 0 and s["promotion_ms_mean"] > 0


def test_b_reports_promotions_in_its_metrics_and_request_stats(pair):
    _, b = pair
    text = httpx.get(b.url + "/metrics", timeout=30).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    promotions = families["mlx_prompt_cache_shared_promotions"].samples[0].value
    assert promotions >= 2
    hist = families["mlx_prompt_cache_shared_promotion_seconds"]
    assert [s.value for s in hist.samples if s.name.endswith("_count")] == [promotions]
    requests = httpx.get(b.url + "/v1/cache/stats", timeout=30).json()["requests"]
    assert requests["by_source"]["shared"] >= 2


def test_another_tenant_on_b_gets_nothing_alice_computed_on_a(pair):
    a, b = pair
    system = long_system(30, salt="tenants ")
    ask_openai(a.url, LLAMA, system, user("Hello"), tenant="alice")
    sent(a.url)
    bob = ask_openai(b.url, LLAMA, system, user("Hello"), tenant="bob")
    assert (bob.source, bob.cached) == ("none", 0)
    # The official SDK against B, alice's key: the shared copy.
    client = OpenAI(base_url=b.url + "/v1", api_key="unused", default_headers={"x-tenant": "alice"})
    raw = client.chat.completions.with_raw_response.create(
        model=LLAMA,
        messages=[{"role": "system", "content": system}, *user("Hello")],
        max_tokens=8,
        temperature=0,
    )
    assert raw.headers["x-prompt-cache-source"] == "shared"


def test_corrupt_entries_in_the_store_are_recomputed_not_served(pair, redis_store):
    a, b = pair
    system = long_system(30, salt="corrupt ")
    ask_openai(a.url, LLAMA, system, user("Hi"), tenant="alice")
    sent(a.url)
    store = redis_store.client()
    for name in store.keys("mlx-prompt-cache:*:alice:b:*"):
        value = bytearray(store.get(name))
        value[-1] ^= 0x01
        store.set(name, bytes(value))
    before = shared_stats(b.url)["errors"]["corrupt"]
    got = ask_openai(b.url, LLAMA, system, user("Hi"), tenant="alice")
    bypass = ask_openai(b.url, LLAMA, system, user("Hi"), tenant="alice", bypass=True)
    # At most the chat template's opening tokens, which B's RAM holds from other prompts.
    assert got.source != "shared" and got.cached < 64 and got.text == bypass.text
    assert shared_stats(b.url)["errors"]["corrupt"] > before


def test_a_slow_store_is_skipped_within_the_timeout(pair, relay):
    _, b = pair
    relay.delay_s = 1.0  # each way: a reply takes 2 s, the timeout is 0.5 s
    try:
        system = long_system(20, salt="slow ")
        for q in ("One", "Two"):
            got = ask_openai(b.url, LLAMA, system, user(q), tenant="alice")
            assert got.source in ("none", "ram")
        s = shared_stats(b.url)
        assert s["errors"]["timeout"] >= 1 and s["unavailable_skips"] >= 1
    finally:
        relay.delay_s = 0.0


def test_a_stopped_then_password_locked_store_leaves_b_serving(pair, redis_store):
    a, b = pair
    redis_store.stop()
    system = long_system(20, salt="down ")
    for url in (a.url, b.url):
        got = ask_openai(url, LLAMA, system, user("Still there?"), tenant="alice")
        assert got.source in ("none", "ram")
    assert shared_stats(a.url)["errors"]["down"] >= 1
    locked = RedisServer(redis_store.dir, port=redis_store.port, args=("--requirepass", "pw-9f3k"))
    locked.start()
    try:
        got = ask_openai(
            a.url, LLAMA, long_system(20, salt="auth "), user("And now?"), tenant="alice"
        )
        assert got.source in ("none", "ram")
        deadline = time.monotonic() + 30  # A's writer probes the store on a backoff
        while not shared_stats(a.url)["errors"]["auth"]:
            assert time.monotonic() < deadline, shared_stats(a.url)
            ask_openai(a.url, LLAMA, long_system(20, salt="auth "), user("Again?"), tenant="alice")
            time.sleep(0.5)
        warnings = [line for line in a.log().splitlines() if "authentication refused" in line]
        assert len(warnings) == 1 and "pw-9f3k" not in warnings[0]
    finally:
        locked.stop()
