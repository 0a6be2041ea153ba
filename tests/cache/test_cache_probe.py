"""POST /v1/cache/probe and /v1/cache/warm on real servers: the probe's numbers are what the
next real request gets, a warm-up makes that request a full RAM hit with the uncached
answer, and a bad body gets exactly the chat route's 4xx."""

from __future__ import annotations

import uuid

import anthropic
import httpx
import openai
import orjson
import pytest

from tests.cache.test_cache_http import long_system
from tests.conftest import fresh_cache_dir, start_server

LLAMA, HYBRID = "demo-llama", "demo-hybrid"
MODELS = (LLAMA, HYBRID)
ANTHROPIC = {"anthropic-version": "2023-06-01"}


@pytest.fixture(scope="module")
def probe_server(demo_root, tmp_path_factory):
    s = start_server(
        fresh_cache_dir(demo_root, tmp_path_factory.mktemp("probe")),
        "--model", LLAMA, "--model", HYBRID, "--upstream", "http://127.0.0.1:9",
    )  # fmt: skip
    yield s
    s.stop()


def new_tenant() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


def post(server, path: str, body, tenant: str = "local", **headers) -> httpx.Response:
    headers["x-tenant"] = tenant
    if isinstance(body, bytes):
        headers.setdefault("content-type", "application/json")
        return httpx.post(server.url + path, content=body, headers=headers, timeout=60)
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60)


def probe(server, body: dict, tenant: str, **headers) -> dict:
    r = post(server, "/v1/cache/probe", body, tenant, **headers)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["ram_tokens"] + out["ssd_tokens"] + out["recompute_tokens"] == out["prompt_tokens"]
    return out


def chat(server, body: dict, tenant: str) -> tuple[dict, httpx.Headers]:
    client = openai.OpenAI(
        base_url=server.url + "/v1", api_key="test", max_retries=0, timeout=60,
        default_headers={"x-tenant": tenant},
    )  # fmt: skip
    raw = client.chat.completions.with_raw_response.create(**body)
    return raw.parse().model_dump(), raw.headers


def got(probed: dict) -> tuple[int, str]:
    """The hit tokens and source a request should get, from a probe's numbers."""
    hit = probed["ram_tokens"] + probed["ssd_tokens"]
    return hit, "ssd" if probed["ssd_tokens"] else ("ram" if hit else "none")


def counters(server) -> tuple[int, int]:
    stats = httpx.get(server.url + "/v1/cache/stats").json()
    return stats["requests"]["total"], stats["scheduler"]["prefill_tokens"]


@pytest.mark.parametrize("model", MODELS)
def test_probe_numbers_are_what_the_next_request_gets(probe_server, model):
    tenant = new_tenant()
    messages = [
        {"role": "system", "content": long_system(10)},
        {"role": "user", "content": "Which report needs a currency?"},
    ]
    body = {"model": model, "messages": messages, "max_tokens": 6, "temperature": 0}
    seen = []
    for turn in range(3):
        before = counters(probe_server)
        probed = probe(probe_server, body, tenant)
        assert counters(probe_server) == before  # no request ran, nothing was prefilled
        reply, headers = chat(probe_server, body, tenant)
        hit = int(headers["x-prompt-cache-hit-tokens"])
        assert (hit, headers["x-prompt-cache-source"]) == got(probed), (turn, probed)
        assert probed["prompt_tokens"] == reply["usage"]["prompt_tokens"]
        diverged = headers.get("x-prompt-cache-diverged-at")
        assert probed["diverged_at"] == (int(diverged) if diverged else None)
        seen.append(hit)
        answer = reply["choices"][0]["message"]["content"]
        messages = [*messages, {"role": "assistant", "content": answer}]
        messages.append({"role": "user", "content": f"And turn {turn + 2}?"})
        body = {**body, "messages": messages}
    assert seen[0] == 0 and seen[1] > 0 and seen[2] > seen[1], seen
    # The same conversation as an Anthropic body probes the same.
    system, rest = messages[0]["content"], messages[1:]
    as_anthropic = {"model": model, "system": system, "messages": rest, "max_tokens": 6}
    assert probe(probe_server, as_anthropic, tenant) == probe(probe_server, body, tenant)


def test_probe_counts_what_only_the_ssd_has_after_a_restart(demo_root, tmp_path):
    cache_dir = fresh_cache_dir(demo_root, tmp_path / "c")
    args = ("--model", LLAMA, "--model", HYBRID, "--upstream", "http://127.0.0.1:9")
    bodies = {
        m: {
            "model": m,
            "messages": [
                {"role": "system", "content": long_system(10, salt=f"{m}. ")},
                {"role": "user", "content": "Where do the logs go?"},
            ],
            "max_tokens": 4,
            "temperature": 0,
        }
        for m in MODELS
    }
    s = start_server(cache_dir, *args)
    try:
        for body in bodies.values():
            chat(s, body, "local")
    finally:
        s.stop()  # drains the SSD writes
    s = start_server(cache_dir, *args)
    try:
        for model, body in bodies.items():
            probed = probe(s, body, "local")
            assert probed["ram_tokens"] == 0 and probed["ssd_tokens"] > 0, (model, probed)
            _, headers = chat(s, body, "local")
            assert (int(headers["x-prompt-cache-hit-tokens"]), "ssd") == (
                probed["ssd_tokens"], headers["x-prompt-cache-source"],
            )  # fmt: skip
            again = probe(s, body, "local")  # promoted: RAM has it now
            assert (again["ram_tokens"], again["ssd_tokens"]) == (probed["ssd_tokens"], 0)
    finally:
        s.stop()


@pytest.mark.parametrize("model", MODELS)
def test_warm_then_a_real_request_hits_fully_from_ram_with_the_uncached_answer(probe_server, model):
    tenant = new_tenant()
    system = long_system(12, salt="Claude Code system prompt. ")
    messages = [{"role": "user", "content": "List the rules about records."}]
    body = {"model": model, "system": system, "messages": messages, "max_tokens": 8}
    before = httpx.get(probe_server.url + "/v1/cache/stats").json()["requests"]

    r = post(probe_server, "/v1/cache/warm", body, tenant)  # Anthropic, from its `system`
    assert r.status_code == 200, r.text
    warm = r.json()
    # What a repeat resumes from: one token short of the end, or for demo-hybrid (a
    # Qwen3.6 template) where the reply opens `<think>`, one further back.
    n = warm["prompt_tokens"]
    resume = n - 2 if model == "demo-hybrid" else n - 1
    assert (warm["model"], warm["cached_tokens"], warm["stored_tokens"]) == (model, 0, resume)
    assert 0 < warm["elapsed_s"] < 30
    after = httpx.get(probe_server.url + "/v1/cache/stats").json()["requests"]
    assert after["total"] == before["total"]  # a warm-up is not a request

    def ask(bypass: bool):
        client = anthropic.Anthropic(
            base_url=probe_server.url, api_key="test", max_retries=0, timeout=60,
            default_headers={"x-tenant": tenant, "x-prompt-cache": "bypass" if bypass else ""},
        )  # fmt: skip
        raw = client.messages.with_raw_response.create(**body, extra_body={"temperature": 0})
        return raw.parse(), raw.headers

    cached, headers = ask(bypass=False)
    assert cached.usage.cache_read_input_tokens == resume
    assert headers["x-prompt-cache-source"] == "ram"
    uncached, _ = ask(bypass=True)
    assert cached.content == uncached.content

    again = post(probe_server, "/v1/cache/warm", body, tenant).json()
    assert (again["cached_tokens"], again["stored_tokens"]) == (resume, 0)


# --- bad input ---------------------------------------------------------------------------

MSG = [{"role": "user", "content": "hi"}]
OPENAI_BAD = [
    b"{not json",
    b"[1, 2]",
    {"messages": MSG},
    {"model": LLAMA},
    {"model": LLAMA, "messages": [{"role": "robot", "content": "x"}]},
    {"model": LLAMA, "messages": MSG, "max_tokens": "ten"},
    {"model": LLAMA, "messages": MSG, "temperature": 9},
    {"model": LLAMA, "messages": MSG, "max_tokens": 10**9},
]
ANTHROPIC_BAD = [
    b"{not json",
    {"model": LLAMA, "messages": MSG},  # no max_tokens
    {"model": LLAMA, "max_tokens": 4, "messages": [{"role": "user", "content": [{"x": 1}]}]},
    {"model": LLAMA, "max_tokens": 4, "messages": MSG, "temperature": 1.5},
    {"model": LLAMA, "max_tokens": 4, "system": 7, "messages": MSG},
]


@pytest.mark.parametrize("path", ["/v1/cache/probe", "/v1/cache/warm"])
@pytest.mark.parametrize("body", OPENAI_BAD, ids=range(len(OPENAI_BAD)))
def test_a_bad_openai_body_gets_the_chat_routes_4xx(probe_server, path, body):
    chat_route = post(probe_server, "/v1/chat/completions", body)
    ours = post(probe_server, path, body)
    assert 400 <= chat_route.status_code < 500
    assert (ours.status_code, ours.json()) == (chat_route.status_code, chat_route.json())


@pytest.mark.parametrize("path", ["/v1/cache/probe", "/v1/cache/warm"])
@pytest.mark.parametrize("body", ANTHROPIC_BAD, ids=range(len(ANTHROPIC_BAD)))
def test_a_bad_anthropic_body_gets_the_messages_routes_4xx(probe_server, path, body):
    chat_route = post(probe_server, "/v1/messages", body, **ANTHROPIC)
    ours = post(probe_server, path, body, **ANTHROPIC)
    assert 400 <= chat_route.status_code < 500
    assert (ours.status_code, ours.json()) == (chat_route.status_code, chat_route.json())
    assert ours.json()["type"] == "error"  # Anthropic's shape


def test_the_dialect_is_the_query_s_then_the_body_s(probe_server):
    anthropic_body = {"model": LLAMA, "system": "Be brief.", "messages": MSG}  # no max_tokens
    by_shape = post(probe_server, "/v1/cache/probe", anthropic_body)
    by_query = post(probe_server, "/v1/cache/probe?dialect=anthropic", {**anthropic_body})
    messages_route = post(probe_server, "/v1/messages", anthropic_body, **ANTHROPIC)
    assert by_shape.json() == by_query.json() == messages_route.json()
    assert by_shape.status_code == 400
    # Asked for OpenAI, the same body reads as a chat completion (which ignores `system`).
    as_openai = post(probe_server, "/v1/cache/probe?dialect=openai", anthropic_body)
    assert as_openai.status_code == 200 and as_openai.json()["model"] == LLAMA
    bad = post(probe_server, "/v1/cache/probe?dialect=klingon", anthropic_body)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "dialect"


def test_warm_passes_the_chat_routes_host_origin_and_content_type_checks(probe_server):
    body = orjson.dumps({"model": LLAMA, "messages": MSG})
    for headers, status, code in [
        ({"Origin": "https://evil.example"}, 403, "origin_not_allowed"),
        ({"Host": "evil.example"}, 403, "host_not_allowed"),
        ({"content-type": "text/plain"}, 415, "unsupported_media_type"),
    ]:
        for path in ("/v1/chat/completions", "/v1/cache/warm", "/v1/cache/probe"):
            r = post(probe_server, path, body, **headers)
            assert (r.status_code, r.json()["error"]["code"]) == (status, code), (path, headers)
    plain = {"model": LLAMA, "messages": MSG}
    bypass = post(probe_server, "/v1/cache/warm", plain, **{"x-prompt-cache": "bypass"})
    assert bypass.status_code == 409 and "bypass" in bypass.json()["error"]["message"]
