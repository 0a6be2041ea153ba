"""The miss reasons that need the SSD tier or session expiry, end to end: `evicted_ssd` (the
SSD budget deleted what RAM had spilled) and `expired` ([cache] session_ttl dropped an
idle session from both tiers), as GET /v1/cache/requests lists them, on real servers
through the OpenAI SDK."""

from __future__ import annotations

import time

import httpx

from tests.cache.test_cache_http import long_system
from tests.cache.test_cache_requests import FOLLOW_UP, LLAMA, QUESTION, ask, oai, recent
from tests.conftest import fresh_cache_dir, start_server

# Polls for a state the server reaches on its own (an eviction, an expiry), not timing.
_WAIT_S = 120.0


def _wait_for(what: str, check) -> None:
    deadline = time.monotonic() + _WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"{what} did not happen in {_WAIT_S:.0f} s"
        time.sleep(0.2)


def _stats(server) -> dict:
    return httpx.get(server.url + "/v1/cache/stats", timeout=30).json()


def _turns(client, salt: str, other_salt: str) -> tuple[list[dict], list[dict]]:
    """Session a's first turn, then session b's, which pushes a's blocks out of RAM; returns
    a's first and second turns."""
    turn1 = [{"role": "system", "content": long_system(8, salt=salt)}, QUESTION]
    answer = ask(client, turn1, session="a", rid="a-1")[0].choices[0].message.content
    other = [{"role": "system", "content": long_system(20, salt=other_salt)}, QUESTION]
    ask(client, other, session="b", rid="b-1")
    return turn1, [*turn1, {"role": "assistant", "content": answer}, FOLLOW_UP]


def test_a_turn_whose_blocks_the_ssd_budget_evicted_is_evicted_ssd(demo_root, tmp_path):
    # demo-llama blocks are 16 KB in RAM and about 25 KB as files: RAM holds 6 and the SSD
    # about 8, so session b's blocks push a's out of RAM (spilled) and then off the disk.
    s = start_server(
        fresh_cache_dir(demo_root, tmp_path / "c"), "--model", LLAMA, "--ram-budget", "100000",
        "--upstream", "http://127.0.0.1:9",
        env={"MLX_PROMPT_CACHE_CACHE_SSD_MAX_SIZE": "200000"},
    )  # fmt: skip
    try:
        client = oai(s, "t")
        turn1, turn2 = _turns(client, "Session A. ", "Session B. ")
        _wait_for("an SSD eviction", lambda: _stats(s)["ssd"]["evictions"] > 0)
        ask(client, turn2, session="a", rid="a-2")
        records = {r["id"]: r for r in recent(s, "t")["requests"]}
        assert records["a-2"]["reason"] == "evicted_ssd", records["a-2"]
        assert records["a-2"]["hit_tokens"] < records["a-1"]["prompt_tokens"] - 64
        assert _stats(s)["ram"]["evicted_blocks"] > 0
    finally:
        s.stop()


def test_a_session_idle_past_session_ttl_comes_back_expired(demo_root, tmp_path):
    s = start_server(
        fresh_cache_dir(demo_root, tmp_path / "c"), "--model", LLAMA,
        "--upstream", "http://127.0.0.1:9",
        env={"MLX_PROMPT_CACHE_CACHE_SESSION_TTL": "2s"},
    )  # fmt: skip
    try:
        client = oai(s, "t")
        turn1 = [{"role": "system", "content": long_system(8, salt="Session C. ")}, QUESTION]
        answer = ask(client, turn1, session="c", rid="c-1")[0].choices[0].message.content
        turn2 = [*turn1, {"role": "assistant", "content": answer}, FOLLOW_UP]

        def listed() -> set[str]:
            r = httpx.get(s.url + "/v1/cache/sessions", headers={"x-tenant": "t"}, timeout=30)
            return {row["id"] for row in r.json()["sessions"]}

        assert "c" in listed()
        _wait_for("the session's expiry", lambda: "c" not in listed())
        ask(client, turn2, session="c", rid="c-2")
        records = {r["id"]: r for r in recent(s, "t")["requests"]}
        assert records["c-2"]["reason"] == "expired", records["c-2"]
        assert records["c-2"]["hit_tokens"] < records["c-1"]["prompt_tokens"] - 64
    finally:
        s.stop()
