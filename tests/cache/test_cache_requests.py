"""Why a request missed: x-prompt-cache-diverged-at, GET /v1/cache/requests and its reason
classes, and the hit-ratio alert, on real servers through the OpenAI and Anthropic SDKs."""

from __future__ import annotations

import uuid

import anthropic
import httpx
import openai
import pytest

from engine_bridge.models import loading as models
from tests.cache.test_cache_http import long_system, tokens_of
from tests.conftest import fresh_cache_dir, start_server
from tests.support.cache_driver import common_prefix

LLAMA = "demo-llama"
DIVERGED = "x-prompt-cache-diverged-at"
SSD_OFF = {"MLX_PROMPT_CACHE_CACHE_SSD_ENABLED": "false"}


@pytest.fixture(scope="module")
def tokenizer(demo_root):
    return models.load(models.resolve(LLAMA, demo_root, [])).tokenizer


@pytest.fixture(scope="module")
def inspect_server(demo_root, tmp_path_factory):
    """demo-llama with two API keys (so /v1/cache/requests is tenant-scoped); on loopback
    a keyless request names its tenant with x-tenant."""
    cache_dir = fresh_cache_dir(demo_root, tmp_path_factory.mktemp("requests"))
    config = cache_dir / "config.toml"
    config.write_text('[tenants.api_keys]\n"key-alice" = "alice"\n"key-bob" = "bob"\n')
    s = start_server(
        cache_dir, "--config", str(config), "--model", LLAMA, "--upstream", "http://127.0.0.1:9"
    )
    yield s
    s.stop()


def new_tenant() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


def oai(server, tenant: str | None = None, key: str = "test", **headers) -> openai.OpenAI:
    if tenant:
        headers["x-tenant"] = tenant
    return openai.OpenAI(
        base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60, default_headers=headers
    )


def ant(server, tenant: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=server.url, api_key="test", max_retries=0, timeout=60,
        default_headers={"x-tenant": tenant},
    )  # fmt: skip


def recent(server, tenant: str | None = None, key: str | None = None, **params) -> dict:
    headers = {"x-tenant": tenant} if tenant else {}
    if key:
        headers["authorization"] = f"Bearer {key}"
    r = httpx.get(server.url + "/v1/cache/requests", params=params, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


# --- the divergence header, on every generation route ---------------------------------------

QUESTION = {"role": "user", "content": "Which report needs the region and the month?"}
ANSWER = "The billing report needs the region, the month and the currency."
FOLLOW_UP = {"role": "user", "content": "And who may delete a record?"}


def send(route: str, server, tenant: str, system: str, messages: list[dict]) -> httpx.Headers:
    """One generation on `route`; the response headers."""
    if route.startswith("openai"):
        full = [{"role": "system", "content": system}, *messages]
        chat = oai(server, tenant).chat.completions
        if route == "openai":
            return chat.with_raw_response.create(
                model=LLAMA, messages=full, max_tokens=4, temperature=0
            ).headers
        with chat.with_streaming_response.create(
            model=LLAMA, messages=full, max_tokens=4, temperature=0, stream=True
        ) as r:
            assert "data: [DONE]" in list(r.iter_lines())
            return r.headers
    if route.startswith("anthropic"):
        kw = dict(model=LLAMA, system=system, messages=messages, max_tokens=4)
        kw["extra_body"] = {"temperature": 0}
        msgs = ant(server, tenant).messages
        if route == "anthropic":
            return msgs.with_raw_response.create(**kw).headers
        with msgs.with_streaming_response.create(**kw, stream=True) as r:
            assert any("message_stop" in line for line in r.iter_lines())
            return r.headers
    assert route == "lmstudio", route
    body = {
        "model": LLAMA,
        "messages": [{"role": "system", "content": system}, *messages],
        "max_tokens": 4,
        "temperature": 0,
    }
    r = httpx.post(server.url + "/api/v0/chat/completions", json=body, headers={"x-tenant": tenant})
    assert r.status_code == 200, r.text
    return r.headers


@pytest.mark.parametrize(
    "route", ["openai", "openai_stream", "anthropic", "anthropic_stream", "lmstudio"]
)
def test_diverged_at_header_is_where_an_edited_history_left_the_cache(
    inspect_server, tokenizer, route
):
    tenant, system = new_tenant(), long_system(12)
    history = [QUESTION, {"role": "assistant", "content": ANSWER}, FOLLOW_UP]
    edited_answer = ANSWER.replace("billing", "shipping")
    edited = [QUESTION, {"role": "assistant", "content": edited_answer}, FOLLOW_UP]

    first = send(route, inspect_server, tenant, system, history)
    assert DIVERGED not in first  # a cold tenant: no cached sequence to leave
    second = send(route, inspect_server, tenant, system, edited)

    lcp = common_prefix(tokens_of(tokenizer, system, history), tokens_of(tokenizer, system, edited))
    assert int(second[DIVERGED]) == lcp
    assert int(second["x-prompt-cache-hit-tokens"]) == lcp  # paged: the hit stops right there
    record = recent(inspect_server, tenant, limit=1)["requests"][0]
    assert (record["diverged_at"], record["diverged_message"]) == (lcp, 2)  # the answer
    assert record["reason"] == "history_edited"
    assert record["before"].endswith("The") and record["after"].startswith(" shipping"), record
    assert len(record["before"]) <= 40 and len(record["after"]) <= 40


# --- reason classes ------------------------------------------------------------------------


def ask(client: openai.OpenAI, messages, *, session: str, rid: str, tools=None, bypass=False):
    headers = {"x-session-id": session, "x-request-id": rid}
    if bypass:
        headers["x-prompt-cache"] = "bypass"
    extra = {"tools": tools} if tools else {}
    raw = client.chat.completions.with_raw_response.create(
        model=LLAMA, messages=messages, max_tokens=6, temperature=0, extra_headers=headers,
        **extra,
    )  # fmt: skip
    return raw.parse(), raw.headers


TOOL = {
    "type": "function",
    "function": {
        "name": "read_ledger",
        "description": "Read one ledger entry",
        "parameters": {"type": "object", "properties": {"id": {"type": "string"}}},
    },
}


def test_each_request_gets_the_reason_it_hit_or_missed(inspect_server):
    tenant, session = new_tenant(), f"s-{uuid.uuid4().hex[:8]}"
    client = oai(inspect_server, tenant)
    system = {"role": "system", "content": long_system(12)}
    turn1 = [system, QUESTION]
    reasons = {}

    def run(name, messages, **kw):
        reply, headers = ask(client, messages, session=kw.pop("session", session), rid=name, **kw)
        reasons[name] = (reply, headers)
        return reply

    answer = run("r-first", turn1).choices[0].message.content
    run("r-next-turn", [*turn1, {"role": "assistant", "content": answer}, FOLLOW_UP])
    changed = {"role": "system", "content": "Be brief. " + system["content"]}
    run("r-system", [changed, QUESTION])
    run("r-tools", [changed, QUESTION], tools=[TOOL])
    run("r-bypass", [changed, QUESTION], tools=[TOOL], bypass=True)
    # A new session with the shared system prompt, then a message of a few blocks.
    own = {"role": "user", "content": long_system(6, salt="My own question. ")}
    run("r-other-session", [system, own], session=session + "-2")

    records = {r["id"]: r for r in recent(inspect_server, tenant)["requests"]}
    assert {rid: records[rid]["reason"] for rid in reasons} == {
        "r-first": "new_session",
        "r-next-turn": "hit",
        "r-system": "system_or_tools_changed",
        "r-tools": "system_or_tools_changed",
        "r-bypass": "bypass",
        "r-other-session": "new_session",  # with the shared system prompt from the cache
    }
    for rid, (reply, headers) in reasons.items():
        r = records[rid]
        assert (r["tenant"], r["model"], r["prompt_tokens"]) == (
            tenant, LLAMA, reply.usage.prompt_tokens,
        )  # fmt: skip
        assert r["hit_tokens"] == int(headers["x-prompt-cache-hit-tokens"])
        assert r["source"] == headers["x-prompt-cache-source"]
        assert r["session"] == (session + "-2" if rid == "r-other-session" else session)
        assert r["diverged_at"] == (int(headers[DIVERGED]) if DIVERGED in headers else None)
        assert 0 < r["ttft_s"] < 30 and r["prefill_tok_s"] > 0
    assert records["r-first"]["hit_tokens"] == 0
    assert records["r-next-turn"]["hit_tokens"] >= records["r-first"]["prompt_tokens"] - 1
    assert records["r-other-session"]["hit_tokens"] >= 64  # the system prompt's blocks
    # Newest first, and `limit` counts.
    assert [r["id"] for r in recent(inspect_server, tenant, limit=2)["requests"]] == [
        "r-other-session",
        "r-bypass",
    ]


def test_a_history_the_template_rewrites_at_a_new_question_is_named(inspect_server):
    """The demo template keeps reasoning only after the last user message: once a new user
    message follows, an earlier turn's reasoning is dropped: the same messages, other tokens,
    named as the template's rewrite of history (what warming ahead is for)."""
    tenant, session = new_tenant(), f"s-{uuid.uuid4().hex[:8]}"
    client = oai(inspect_server, tenant)
    call = {"id": "call_1", "type": "function"}
    call["function"] = {"name": "read_ledger", "arguments": '{"id": "7"}'}
    agent = [
        {"role": "system", "content": long_system(8)},
        QUESTION,
        {
            "role": "assistant",
            "content": "Let me look.",
            "reasoning_content": "The ledger entry seven holds the report rules.",
            "tool_calls": [call],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "region, month, currency"},
    ]
    ask(client, agent, session=session, rid="t-1", tools=[TOOL])
    later = [*agent, {"role": "assistant", "content": "Region, month, currency."}, FOLLOW_UP]
    _, headers = ask(client, later, session=session, rid="t-2", tools=[TOOL])
    record = recent(inspect_server, tenant, limit=1)["requests"][0]
    assert record["reason"] == "history_rewritten"
    assert record["diverged_message"] == 2 and int(headers[DIVERGED]) == record["diverged_at"]
    # The cache holds the turn with its reasoning; this prompt renders it without.
    assert record["before"].endswith("assistant\n") and record["after"].startswith("Let me look")


def test_requests_are_tenant_scoped_with_api_keys(inspect_server):
    rid = f"alice-{uuid.uuid4().hex[:8]}"
    oai(inspect_server, key="key-alice").chat.completions.create(
        model=LLAMA, messages=[QUESTION], max_tokens=2, extra_headers={"x-request-id": rid}
    )
    alice = recent(inspect_server, key="key-alice")["requests"]
    assert [r["id"] for r in alice][:1] == [rid] and {r["tenant"] for r in alice} == {"alice"}
    # Bob's key sees none of it, even naming alice in the tenant header.
    bob = recent(inspect_server, tenant="alice", key="key-bob")["requests"]
    assert all(r["tenant"] == "bob" for r in bob) and rid not in {r["id"] for r in bob}


@pytest.mark.parametrize("limit", ["0", "501", "ten"])
def test_a_bad_limit_is_a_400_naming_it(inspect_server, limit):
    r = httpx.get(inspect_server.url + "/v1/cache/requests", params={"limit": limit})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "limit" and limit in r.json()["error"]["message"]


# --- eviction --------------------------------------------------------------------------------


def test_a_turn_whose_blocks_ram_evicted_is_evicted_ram(demo_root, tmp_path):
    # demo-llama blocks are 16 KB: the RAM tier holds 6, and SSD is off.
    s = start_server(
        fresh_cache_dir(demo_root, tmp_path / "c"), "--model", LLAMA, "--ram-budget", "100000",
        "--upstream", "http://127.0.0.1:9", env=SSD_OFF,
    )  # fmt: skip
    try:
        client = oai(s, "t")
        turn1 = [{"role": "system", "content": long_system(8, salt="Session A. ")}, QUESTION]
        answer = ask(client, turn1, session="a", rid="a-1")[0].choices[0].message.content
        other = [{"role": "system", "content": long_system(20, salt="Session B. ")}, QUESTION]
        ask(client, other, session="b", rid="b-1")  # its blocks push A's out
        turn2 = [*turn1, {"role": "assistant", "content": answer}, FOLLOW_UP]
        ask(client, turn2, session="a", rid="a-2")
        records = {r["id"]: r for r in recent(s, "t")["requests"]}
        assert records["a-2"]["reason"] == "evicted_ram"
        assert records["a-2"]["hit_tokens"] < records["a-1"]["prompt_tokens"] - 64
        assert httpx.get(s.url + "/v1/cache/stats").json()["ram"]["evicted_blocks"] > 0
    finally:
        s.stop()


def test_a_hit_from_ssd_past_where_ram_diverged_names_no_divergence(demo_root, tmp_path):
    """After a restart RAM may hold only another prompt, which this one leaves at its first
    tokens; the SSD restores far past there, so no divergence cut the hit short."""
    cache = fresh_cache_dir(demo_root, tmp_path / "c")
    args = ("--model", LLAMA, "--upstream", "http://127.0.0.1:9")
    turn = [{"role": "system", "content": long_system(8, salt="Restarted. ")}, QUESTION]
    first = start_server(cache, *args)
    try:
        ask(oai(first, "t"), turn, session="a", rid="a-1")
    finally:
        first.stop()
    second = start_server(cache, *args)
    try:
        client = oai(second, "t")
        ask(client, [{"role": "user", "content": "Something else."}], session="b", rid="b-1")
        headers = ask(client, turn, session="a", rid="a-2")[1]
        assert headers["x-prompt-cache-source"] == "ssd"
        assert int(headers["x-prompt-cache-hit-tokens"]) > 64
        assert DIVERGED not in headers
        record = {r["id"]: r for r in recent(second, "t")["requests"]}["a-2"]
        assert record["diverged_at"] is None
    finally:
        second.stop()


# --- the hit-ratio alert -------------------------------------------------------------------


def test_hit_ratio_alert_starts_and_clears_with_one_log_line_each(demo_root, tmp_path):
    s = start_server(
        fresh_cache_dir(demo_root, tmp_path / "c"), "--model", LLAMA,
        "--upstream", "http://127.0.0.1:9", env=SSD_OFF,
    )  # fmt: skip
    try:
        client = oai(s)
        states = []

        def check() -> None:
            """The alert is on exactly when the last 20 requests' token hit ratio is < 0.5."""
            listed = recent(s, limit=20)
            last = listed["requests"]
            ratio = sum(r["hit_tokens"] for r in last) / sum(r["prompt_tokens"] for r in last)
            expected = len(last) == 20 and ratio < 0.5
            alert = listed["alert"]
            assert (alert is not None) == expected, (len(last), ratio, alert)
            assert httpx.get(s.url + "/v1/cache/stats").json()["alert"] == alert
            if alert is not None:
                assert (alert["threshold"], alert["window"]) == (0.5, 20)
                assert alert["hit_ratio"] == pytest.approx(ratio, abs=1e-4)
                assert "/v1/cache/requests" in alert["message"]
            states.append(expected)

        for i in range(20):  # cold prompts: nothing to hit
            prompt = [{"role": "user", "content": f"Cold prompt number {i}: {uuid.uuid4()}"}]
            client.chat.completions.create(model=LLAMA, messages=prompt, max_tokens=1)
            check()
        warm = [{"role": "system", "content": long_system(6)}, QUESTION]
        for _ in range(20):  # the same prompt again and again: hits
            client.chat.completions.create(model=LLAMA, messages=warm, max_tokens=1)
            check()
        # Off for 19, on from the 20th, off again once enough hits came in, and it stays off.
        on = states.index(True)
        off = states.index(False, on)
        assert on == 19 and 20 < off < 40 and not any(states[off:]), states
        # Startup's own warnings (proxy.cli: the reference BLAS on mlx[cpu]) are not the alert's.
        warnings = [ln for ln in s.log().splitlines() if "WARNING" in ln and "proxy.cli" not in ln]
        assert len(warnings) == 1 and "of the last 20 requests is" in warnings[0], warnings
        assert "below 50%: GET /v1/cache/requests says why" in warnings[0]
        assert s.log().count("is back to") == 1
    finally:
        s.stop()
