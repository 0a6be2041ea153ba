"""Client sessions over their life, each test on a server of its own config: a pinned
session kept in RAM through a squeeze under its cap, idle ones expired from both tiers,
tenants kept apart by their API keys, and the registry kept across a restart.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from tests.conftest import fresh_cache_dir, start_server
from tests.sessions.test_cache_sessions import (
    BS,
    SESSIONS,
    chat,
    sessions,
    sid_url,
    stats,
    wait_ssd_idle,
)


def write_config(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# ---- pinning -----------------------------------------------------------------------------


def test_a_pinned_session_stays_in_ram_through_a_squeeze_and_the_cap_holds(demo_root, tmp_path):
    # ~12 blocks of RAM; a session here is ~5 blocks; pinned sessions may hold 250 KB.
    config = write_config(tmp_path / "c.toml", '[cache]\npin_max = "250KB"\n')
    cache = fresh_cache_dir(demo_root, tmp_path / "c")
    s = start_server(
        cache, "--upstream", "http://127.0.0.1:9", "--ram-budget", "400KB", "--config", str(config)
    )
    try:
        pinned_user, control_user = "pinned conversation " * 10, "control conversation " * 10
        p1 = chat(s, pinned_user, session="pinned", system="Pinned system. " * 30)
        r = httpx.post(sid_url(s, "pinned", "/pin"))
        assert r.status_code == 200 and r.json() == {"id": "pinned", "pinned": True}
        c1 = chat(s, control_user, session="control", system="Control system. " * 30)
        r = httpx.post(sid_url(s, "control", "/pin"))
        assert r.status_code == 409, r.text
        message = r.json()["error"]["message"]
        assert "pin_max" in message and "250000" in message
        assert not sessions(s)["control"]["pinned"]
        for i in range(4):  # fill RAM several times over with other sessions
            chat(s, f"filler {i} " * 40, session=f"filler-{i}", system=f"Filler {i}. " * 30)
        st = stats(s)["ram"]
        assert st["evicted_blocks"] > 0 and st["pinned_bytes"] > 0
        assert st["bytes"] <= st["budget_bytes"]
        p2 = chat(s, pinned_user, session="pinned", system="Pinned system. " * 30)
        c2 = chat(s, control_user, session="control", system="Control system. " * 30)
        assert p2[2] == "ram" and p2[1] > 0, "the pinned session was not evicted"
        assert c2[2] == "ssd", "the unpinned one was, and came back from SSD"
        assert (p2[0], c2[0]) == (p1[0], c1[0])
        r = httpx.post(sid_url(s, "pinned", "/unpin"))
        assert r.json() == {"id": "pinned", "pinned": False}
        assert stats(s)["ram"]["pinned_bytes"] == 0
    finally:
        s.stop()


# ---- idle expiry -------------------------------------------------------------------------


def test_idle_sessions_expire_from_both_tiers_and_pinned_ones_stay(demo_root, tmp_path):
    config = write_config(tmp_path / "c.toml", '[cache]\nsession_ttl = "1s"\n')
    cache = fresh_cache_dir(demo_root, tmp_path / "c")
    s = start_server(cache, "--upstream", "http://127.0.0.1:9", "--config", str(config))
    try:
        chat(s, "keep me " * 10, session="keep", system="Keep system. " * 20)
        assert httpx.post(sid_url(s, "keep", "/pin")).status_code == 200
        chat(s, "expire me " * 10, session="idle", system="Idle system. " * 20)
        wait_ssd_idle(s)
        kept_entries = None
        deadline = time.monotonic() + 10
        while "idle" in sessions(s) and time.monotonic() < deadline:
            time.sleep(0.2)
        listed = sessions(s)
        assert "idle" not in listed and "keep" in listed
        kept_entries = stats(s)["ssd"]["entries"]
        assert kept_entries > 0, "the pinned session's entries are still on disk"
        assert listed["keep"]["ssd_bytes"] > 0
        again = chat(s, "expire me " * 10, session="idle2", system="Idle system. " * 20)
        # Gone from RAM and SSD: at most the first few template tokens match inside the
        # pinned session's first block.
        assert again[1] < BS and again[2] != "ssd", again
    finally:
        s.stop()


# ---- tenants -----------------------------------------------------------------------------


def test_a_tenant_sees_and_deletes_only_its_own_sessions(demo_root, tmp_path):
    config = write_config(
        tmp_path / "c.toml", '[tenants]\napi_keys = { "key-a" = "alpha", "key-b" = "beta" }\n'
    )
    cache = fresh_cache_dir(demo_root, tmp_path / "c")
    s = start_server(cache, "--upstream", "http://127.0.0.1:9", "--config", str(config))
    a, b = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}
    try:
        a1 = chat(s, "alpha asks " * 10, session="same-id", key="key-a")
        chat(s, "beta asks " * 10, session="same-id", key="key-b")
        chat(s, "alpha only " * 10, session="alpha-only", key="key-a")
        seen_a = httpx.get(s.url + SESSIONS, headers=a).json()["sessions"]
        seen_b = httpx.get(s.url + SESSIONS, headers=b).json()["sessions"]
        assert {(x["id"], x["tenant"]) for x in seen_a} == {
            ("same-id", "alpha"),
            ("alpha-only", "alpha"),
        }
        assert {(x["id"], x["tenant"]) for x in seen_b} == {("same-id", "beta")}
        for method, tail in (("DELETE", ""), ("POST", "/pin"), ("POST", "/unpin")):
            r = httpx.request(method, sid_url(s, "alpha-only", tail), headers=b)
            assert r.status_code == 404, r.text
        r = httpx.get(s.url + SESSIONS, params={"tenant": "alpha"}, headers=b)
        assert r.status_code == 403
        r = httpx.delete(s.url + "/v1/cache", params={"tenant": "alpha"}, headers=b)
        assert r.status_code == 403
        # B deletes its own "same-id": alpha's session of the same id is untouched.
        r = httpx.delete(sid_url(s, "same-id"), headers=b)
        assert r.status_code == 200
        assert httpx.get(s.url + SESSIONS, headers=b).json()["sessions"] == []
        r = httpx.delete(s.url + "/v1/cache", headers=b)
        assert r.status_code == 200
        assert len(httpx.get(s.url + SESSIONS, headers=a).json()["sessions"]) == 2
        again = chat(s, "alpha asks " * 10, session="same-id", key="key-a")
        assert again[2] == "ram" and again[1] > 0 and again[0] == a1[0]
    finally:
        s.stop()


# ---- restarts ----------------------------------------------------------------------------


def test_after_a_restart_a_delete_keeps_what_another_shares_and_a_clear_empties_all(
    demo_root, tmp_path
):
    cache = fresh_cache_dir(demo_root, tmp_path / "c")
    s = start_server(cache, "--upstream", "http://127.0.0.1:9")
    a_user, b_user = "restart apples " * 10, "restart pears " * 10
    try:
        a1 = chat(s, a_user, session="a")
        b1 = chat(s, b_user, session="b")
        shared_hit = b1[1]
        assert shared_hit > 0
    finally:
        s.stop()  # a clean stop drains the SSD queue and saves the registry
    s = start_server(cache, "--upstream", "http://127.0.0.1:9")
    try:
        listed = sessions(s)
        assert set(listed) == {"a", "b"}, "the registry came back from disk"
        assert listed["a"]["ram_bytes"] == 0 and listed["a"]["ssd_bytes"] > 0
        assert listed["a"]["shared_bytes"] > 0
        assert httpx.delete(sid_url(s, "a")).status_code == 200
        b2 = chat(s, b_user, session="b")
        assert b2[2] == "ssd" and b2[1] > shared_hit, "B's whole prompt, shared part included"
        assert b2[0] == b1[0]
        a2 = chat(s, a_user, session="a")
        assert a2[1] == shared_hit and a2[0] == a1[0]
        wait_ssd_idle(s)
        r = httpx.delete(s.url + "/v1/cache")
        body = r.json()
        assert r.status_code == 200 and body["deleted_entries"] > 0 and body["freed_bytes"] > 0
        st = stats(s)
        assert st["ram"]["blocks"] == st["ram"]["checkpoints"] == 0
        assert st["ssd"]["entries"] == 0 and sessions(s) == {}
    finally:
        s.stop()
