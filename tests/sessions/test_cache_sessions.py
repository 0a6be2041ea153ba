"""Client sessions over one shared real server: ids, listing, deleting, route checks, clear.

Each test drives a real proxy subprocess with the SDKs and checks the cache's own figures
(hit tokens, source, the sessions listing) against what the operation must have done, and
every cached answer against the bypass answer. Tests that need a server of their own config
(pin caps, idle expiry, tenants, restarts) are in test_session_lifecycle.py.
"""

from __future__ import annotations

import re
import threading
import time
from urllib.parse import quote

import httpx
import openai
import pytest

from tests.conftest import fresh_cache_dir, start_server

BS = 64  # the demo models' block size
SYSTEM = "You are a careful assistant for a cache test. Answer briefly. " * 24
SESSIONS = "/v1/cache/sessions"


def _client(server, key: str = "test") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def chat(
    server,
    user: str,
    *,
    session: str | None = None,
    model: str = "demo-llama",
    system: str = SYSTEM,
    history: list[dict] | None = None,
    key: str = "test",
    headers: dict | None = None,
    bypass: bool = False,
    max_tokens: int = 6,
) -> tuple[str, int, str]:
    """(answer, hit tokens, source) of one greedy turn."""
    extra = dict(headers or {})
    if session is not None:
        extra["x-session-id"] = session
    if bypass:
        extra["x-prompt-cache"] = "bypass"
    messages = [{"role": "system", "content": system}, *(history or [])]
    messages.append({"role": "user", "content": user})
    raw = _client(server, key).chat.completions.with_raw_response.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, extra_headers=extra
    )
    text = raw.parse().choices[0].message.content or ""
    return text, int(raw.headers["x-prompt-cache-hit-tokens"]), raw.headers["x-prompt-cache-source"]


def sessions(server, **params) -> dict[str, dict]:
    r = httpx.get(server.url + SESSIONS, params=params, headers=params.pop("headers", None))
    assert r.status_code == 200, r.text
    listed = r.json()["sessions"]
    used = [s["last_used"] for s in listed]
    assert used == sorted(used, reverse=True), "most recently used first"
    return {s["id"]: s for s in listed}


def stats(server) -> dict:
    return httpx.get(server.url + "/v1/cache/stats").json()


def wait_ssd_idle(server, timeout: float = 10.0) -> None:
    """Until the SSD writer has written everything queued (listing counts what is on disk)."""
    deadline = time.monotonic() + timeout
    while stats(server)["ssd"]["queued"] and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.1)  # the entry being written when the queue emptied


def sid_url(server, sid: str, tail: str = "") -> str:
    return server.url + SESSIONS + "/" + quote(sid, safe="") + tail


@pytest.fixture(scope="module")
def main_server(demo_root, tmp_path_factory):
    cache = fresh_cache_dir(demo_root, tmp_path_factory.mktemp("sessions-main"))
    # Checkpoints (and a hybrid model's blocks, written with them) go to SSD at once, so
    # the tests can count each session's bytes there right after its turn.
    env = {"MLX_PROMPT_CACHE_CACHE_SSD_CHECKPOINT_WRITE_DELAY": "0"}
    s = start_server(cache, "--upstream", "http://127.0.0.1:9", env=env)
    yield s
    s.stop()


# ---- session ids -------------------------------------------------------------------------


def test_session_ids_come_from_headers_then_the_body_then_the_first_user_message(main_server):
    import anthropic

    s = main_server
    claude = anthropic.Anthropic(base_url=s.url, api_key="test", max_retries=0, timeout=120)

    def ask(user: str, headers: dict | None = None, metadata: dict | None = None) -> None:
        claude.messages.create(
            model="demo-llama",
            max_tokens=2,
            system="Ids test. " * 10,
            messages=[{"role": "user", "content": user}],
            extra_headers=headers or {},
            extra_body={"temperature": 0, **({"metadata": metadata} if metadata else {})},
        )

    ask("claude code turn", {"X-Claude-Code-Session-Id": "cc-1", "x-session-id": "xs-1"})
    ask("x-session-id turn", {"x-session-id": "xs-2"}, {"user_id": "meta-2"})
    ask("metadata turn", metadata={"user_id": "meta-3"})
    ask("anonymous conversation")
    # The next turn of the same conversation keeps the first user message: the same id.
    claude.messages.create(
        model="demo-llama",
        max_tokens=2,
        system="Ids test. " * 10,
        messages=[
            {"role": "user", "content": "anonymous conversation"},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "second turn"},
        ],
        extra_body={"temperature": 0},
    )
    chat(s, "openai user field", headers={"x-session-id": ""}, session=None)
    _client(s).chat.completions.create(
        model="demo-llama",
        messages=[{"role": "user", "content": "openai user turn"}],
        max_tokens=2,
        user="openai-user",
    )
    listed = sessions(s)
    anonymous = [i for i in listed if i.startswith("h-")]
    assert {"cc-1", "xs-2", "meta-3", "openai-user"} <= set(listed)
    assert not {"xs-1", "meta-2"} & set(listed), "a header wins over the body"
    assert len(anonymous) == 2, anonymous  # the two-turn conversation is one session
    assert all(re.fullmatch(r"h-[0-9a-f]{16}", i) for i in anonymous)


# ---- listing and deleting ----------------------------------------------------------------


@pytest.mark.parametrize("model", ["demo-llama", "demo-hybrid"])
def test_deleting_one_of_two_sessions_sharing_a_prompt_keeps_the_others_hit(main_server, model):
    s = main_server
    a, b = f"alpha-{model}", f"beta-{model}"
    system = f"Delete test on {model}. " + SYSTEM  # a prefix no other test stored
    a1 = chat(
        s, "Tell me about apples and their orchards. " * 4, session=a, model=model, system=system
    )
    b_user = "Tell me about pears, please, in some detail. " * 4
    b1 = chat(s, b_user, session=b, model=model, system=system)
    # (Other tests' prompts share at most a few template tokens with this one.)
    assert a1[1] < BS and b1[1] > BS, "B's first turn hits the system prompt A stored"
    shared_hit = b1[1]
    wait_ssd_idle(s)
    before = sessions(s)
    ra, rb = before[a], before[b]
    for r in (ra, rb):
        assert r["tenant"] == "local" and r["model"] == model and not r["pinned"]
        assert r["tokens"] > 0 and r["tokens"] % BS == 0
        assert r["ram_bytes"] > 0 and r["ssd_bytes"] > 0
    # The same entries are shared from either side; the system prompt is most of it.
    assert ra["shared_bytes"] == rb["shared_bytes"] > 0
    assert rb["tokens"] >= shared_hit // BS * BS
    print(f"\n{model}: A {ra}\n{model}: B {rb}")

    r = httpx.delete(sid_url(s, a))
    assert r.status_code == 200, r.text
    assert r.json() == {"id": a, "deleted": True, "freed_bytes": ra["ram_bytes"] + ra["ssd_bytes"]}
    after = sessions(s)
    assert a not in after
    assert after[b]["shared_bytes"] == 0, "nothing is shared once A is gone"
    assert after[b]["ram_bytes"] + after[b]["ssd_bytes"] >= rb["ram_bytes"] + rb["ssd_bytes"]

    # B's next turn still resumes past the shared prefix, with the uncached answer.
    history = [{"role": "user", "content": b_user}, {"role": "assistant", "content": b1[0]}]
    b2 = chat(s, "And plums?", session=b, model=model, history=history, system=system)
    assert b2[1] > shared_hit and b2[2] == "ram"
    assert (
        b2[0] == chat(s, "And plums?", model=model, history=history, bypass=True, system=system)[0]
    )
    # A starts over from the shared part only: what was its own is gone from RAM and SSD.
    a2 = chat(
        s, "Tell me about apples and their orchards. " * 4, session=a, model=model, system=system
    )
    assert a2[1] == shared_hit
    assert a2[0] == a1[0]


def test_a_delete_during_a_stream_waits_for_the_stream_to_end(main_server):
    s = main_server
    sid = "streaming-session"
    chat(s, "Warm this session up first. " * 3, session=sid)
    events: list[str] = []
    times: dict[str, float] = {}
    deleted: dict = {}

    def delete() -> None:
        r = httpx.delete(sid_url(s, sid), timeout=60)
        times["deleted"] = time.monotonic()
        deleted.update(status=r.status_code, body=r.json())

    stream = _client(s).chat.completions.create(
        model="demo-llama",
        messages=[
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Warm this session up first. " * 3},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "Now write at length."},
        ],
        max_tokens=300,
        temperature=0,
        stream=True,
        extra_headers={"x-session-id": sid},
    )
    worker = None
    finish = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            events.append(chunk.choices[0].delta.content)
            if worker is None:
                worker = threading.Thread(target=delete)
                worker.start()
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    times["stream_end"] = time.monotonic()
    worker.join(60)
    assert finish == "length", "the stream ran to its end, not cut by the delete"
    assert deleted["status"] == 200 and deleted["body"]["deleted"] is True
    assert deleted["body"]["freed_bytes"] > 0
    assert times["deleted"] >= times["stream_end"] - 0.25
    # Deleted after the end-of-generation save: that save did not bring the session back.
    assert sid not in sessions(s)


def test_unknown_ids_and_models_are_404_in_the_openai_shape(main_server):
    s = main_server
    for method, tail in (("DELETE", ""), ("POST", "/pin"), ("POST", "/unpin")):
        r = httpx.request(method, sid_url(s, "no-such-session", tail))
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert err["param"] == "id" and "no-such-session" in err["message"]
    r = httpx.delete(s.url + "/v1/cache", params={"model": "no-such-model"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_state_changing_session_routes_pass_the_browser_checks(main_server):
    s = main_server
    sid = "guarded-session"
    chat(s, "Guard this one. " * 5, session=sid)
    url = sid_url(s, sid)
    r = httpx.delete(url, headers={"Origin": "http://evil.example"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    r = httpx.delete(url, headers={"Host": "evil.example"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
    r = httpx.post(url + "/pin", content=b"x", headers={"Content-Type": "text/plain"})
    assert r.status_code == 415
    r = httpx.delete(s.url + "/v1/cache", headers={"Origin": "http://evil.example"})
    assert r.status_code == 403
    assert sid in sessions(s) and not sessions(s)[sid]["pinned"], "the refusals changed nothing"
    # A page of this server itself may.
    r = httpx.post(url + "/pin", headers={"Origin": s.url})
    assert r.status_code == 200 and r.json() == {"id": sid, "pinned": True}
    assert sessions(s)[sid]["pinned"]
    r = httpx.post(url + "/unpin")
    assert r.status_code == 200 and r.json() == {"id": sid, "pinned": False}


def test_answers_match_the_documented_schemas(main_server):
    import jsonschema_rs

    s = main_server
    doc = httpx.get(s.url + "/openapi.json").json()

    def check(path: str, method: str, status: int, body: dict) -> None:
        op = doc["paths"][path][method]
        schema = op["responses"][str(status)]["content"]["application/json"]["schema"]
        root = {**schema, "components": doc["components"]}
        jsonschema_rs.Draft202012Validator(root).validate(body)

    chat(s, "documented " * 10, session="documented")
    r = httpx.get(s.url + SESSIONS)
    check(SESSIONS, "get", 200, r.json())
    item = SESSIONS + "/{id}"
    for tail, name in (("/pin", "/pin"), ("/unpin", "/unpin")):
        r = httpx.post(sid_url(s, "documented", tail))
        check(item + name, "post", 200, r.json())
    r = httpx.post(sid_url(s, "nope", "/pin"))
    check(item + "/pin", "post", 404, r.json())
    r = httpx.delete(sid_url(s, "documented"))
    check(item, "delete", 200, r.json())
    r = httpx.delete(s.url + "/v1/cache", params={"model": "nope"})
    check("/v1/cache", "delete", 404, r.json())


HOSTILE = ["../x", "a\x00b", "é✓🙂 /x?y#z%", "x" * 10_000, "..", "a/../../b", "."]


def test_hostile_session_and_tenant_ids_stay_data(main_server):
    s = main_server
    ids = []
    for i, hostile in enumerate(HOSTILE):
        # The body's `user` field carries any string (a header could not hold a NUL).
        raw = _client(s).chat.completions.with_raw_response.create(
            model="demo-llama",
            messages=[{"role": "user", "content": f"hostile id number {i} " * 12}],
            max_tokens=2,
            user=hostile,
            extra_headers={"x-tenant": "../../evil" if i % 2 else "ten/ant\\.. :x"},
        )
        assert raw.http_response.status_code == 200
        ids.append(hostile)
    listed = sessions(s)
    for hostile in ids:
        if len(hostile) <= 256 and hostile.strip("."):
            assert hostile in listed
    # Too long, or only dots (a path segment clients resolve away): kept as a hash.
    hashed = [i for i in listed if re.fullmatch(r"id-[0-9a-f]{32}", i)]
    assert len(hashed) == 3
    wait_ssd_idle(s)
    for sid in [i for i in listed if listed[i]["tenant"] != "local"]:
        tenant = listed[sid]["tenant"]
        r = httpx.post(sid_url(s, sid, "/pin"), params={"tenant": tenant})
        assert r.status_code == 200 and r.json()["id"] == sid
        r = httpx.delete(sid_url(s, sid), params={"tenant": tenant})
        assert r.status_code == 200 and r.json()["id"] == sid, r.text
    # Nothing outside the layout: tenant folders are safe names or hashes.
    root = s.cache_dir
    assert not (root.parent / "evil").exists() and not (root / "evil").exists()
    for tenant_dir in (p for m in root.iterdir() if (m / "local").is_dir() for p in m.iterdir()):
        assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", tenant_dir.name), tenant_dir
        assert tenant_dir.resolve().parent.parent == root.resolve()


# ---- clearing ----------------------------------------------------------------------------


def test_clear_by_model_then_by_tenant_leaves_the_rest(main_server):
    s = main_server
    llama = ("llama clear question " * 10, "Clear test. " * 20)
    chat(s, llama[0], session="clear-l", system=llama[1])
    chat(s, "swa clear question " * 10, session="clear-w", model="demo-swa")
    chat(s, "tenant clear question " * 10, session="clear-t", headers={"x-tenant": "clearing"})
    wait_ssd_idle(s)
    r = httpx.delete(s.url + "/v1/cache", params={"model": "demo-swa"})
    assert r.status_code == 200 and r.json()["deleted_entries"] > 0
    listed = sessions(s)
    assert "clear-w" not in listed and {"clear-l", "clear-t"} <= set(listed)
    assert chat(s, "swa clear question " * 10, model="demo-swa")[1] < BS
    r = httpx.delete(s.url + "/v1/cache", params={"tenant": "clearing"})
    assert r.status_code == 200 and r.json()["deleted_entries"] > 0
    assert "clear-t" not in sessions(s)
    assert chat(s, "tenant clear question " * 10, headers={"x-tenant": "clearing"})[1] < BS
    again = chat(s, llama[0], session="clear-l", system=llama[1])
    assert again[2] == "ram" and again[1] > BS, "another model and tenant: untouched"
