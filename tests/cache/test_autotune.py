"""Tuning by load: the RAM tier's frequency protection and ghost lists (the real
CacheManager), the autotuner's moves on them (the real Autotune and MemoryGuard), and a
real server whose budget grows while evicted entries come back, answering as bypass."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import httpx

from engine_bridge.cache.kinds import EntryKind
from engine_bridge.cache.ram import manager
from engine_bridge.cache.ram.ghosts import Ghosts
from engine_bridge.cache.ssd.wear import WearMeter
from engine_bridge.cache.write_policy import WritePolicy
from engine_bridge.engine_settings import AutotuneSettings, CachePolicy, EngineSettings
from engine_bridge.ops import autotune as tuning
from engine_bridge.ops.autotune import Autotune
from engine_bridge.ops.diagnosis import Diagnosis, Evidence, Loss, Ranked
from engine_bridge.ops.fixes import Context, fix
from engine_bridge.ops.memory import MemoryGuard
from tests.cache.test_cache_http import long_system
from tests.cache.test_cache_manager import cache, chain, store
from tests.cache.test_cache_requests import FOLLOW_UP, LLAMA, QUESTION, ask, oai
from tests.conftest import fresh_cache_dir, start_server

SYSTEM = list(range(1000, 1016))  # four blocks every request shares
GB = 10**9


def read(m, tokens) -> None:
    """A lookup that restores `tokens`' blocks, as a request does: pinned, then let go."""
    match = m.match(chain(tokens + [1]), needs_checkpoint=False, pin=True)
    m.release(match)


def burst(m, n: int, start: int = 5000) -> None:
    """`n` one-off prompts of four blocks each, never read again."""
    for i in range(n):
        store(m, list(range(start + 16 * i, start + 16 * i + 16)))


def test_entries_read_twice_outlive_a_burst_only_when_protected():
    for protect, kept in ((0.0, False), (0.5, True)):
        m = cache(budget=120, protect_frequent=protect)  # twelve 10-byte blocks
        store(m, SYSTEM)
        read(m, SYSTEM)
        read(m, SYSTEM)
        burst(m, 4)  # sixteen blocks: LRU alone evicts the shared prefix
        held = m.match(chain(SYSTEM + [1]), needs_checkpoint=False).length
        assert (held == 16) is kept, (protect, held)


def test_protection_ages_so_an_entry_no_longer_read_goes():
    m = cache(budget=120, protect_frequent=0.5)
    store(m, SYSTEM)
    read(m, SYSTEM)
    read(m, SYSTEM)
    burst(m, 12)  # many passes at the head with no read between: its count halves away
    assert m.match(chain(SYSTEM + [1]), needs_checkpoint=False).length == 0


def test_ghosts_count_what_came_back_by_whether_it_had_been_read():
    m = cache(budget=40)  # four blocks
    store(m, SYSTEM)
    read(m, SYSTEM)  # read once: its ghosts are "frequent"
    burst(m, 1)  # evicts SYSTEM
    burst(m, 1, start=9000)  # evicts the first burst, never read: "recent" ghosts
    store(m, SYSTEM)
    store(m, list(range(5000, 5016)))
    hits = m.ghost_hits()
    assert (hits.frequent, hits.recent) == (4, 4)
    assert hits.bytes == 80
    assert m.ghost_hits().bytes == 0, "taken once"


def test_a_ghosts_depth_is_the_bytes_evicted_after_it_went_its_own_included():
    ghosts = Ghosts()
    ghosts.add(SimpleNamespace(key=bytes([k]) * 8, reads=0, nbytes=10 * k) for k in (1, 2, 3))
    assert ghosts.came_back(bytes([2]) * 8) and ghosts.came_back(bytes([3]) * 8)
    hits = ghosts.take()
    assert (hits.bytes, hits.depth) == (50, 50)  # key 2: itself (20) and key 3 (30)
    ghosts.add([SimpleNamespace(key=bytes([4]) * 8, reads=1, nbytes=5)])
    assert ghosts.came_back(bytes([1]) * 8)  # 10 + 20 + 30 + 5 went since it did
    assert ghosts.take().depth == 65


def test_an_entry_back_from_its_ghost_counts_as_seen_twice_as_in_arc():
    m = cache(budget=40)
    store(m, SYSTEM)
    burst(m, 1)  # SYSTEM evicted, never read: a recent ghost
    store(m, SYSTEM)  # back: seen twice now
    first = m.entry(EntryKind.BLOCK, chain(SYSTEM).hashes[0])
    assert first is not None and first.reads == manager.SEEN_AGAIN
    assert m.ghost_hits().recent == 4


def tuner(m, budget: int, *, floor: int | None = None, ram_max: int | None = None,
          diagnosis: Diagnosis | None = None, policy: CachePolicy | None = None) -> Autotune:  # fmt: skip
    settings = EngineSettings(Path("/nonexistent"), ram_budget_bytes=budget,
                              ram_min_available_bytes=floor)  # fmt: skip
    tiers = _Tiers(m)
    guard = MemoryGuard(tiers, settings)
    return Autotune(AutotuneSettings(True, ram_max), tiers, guard, diagnosis, policy)


class _Tiers:
    """The tiers an autotuner reads, without an SSD (its wear rule has its own test)."""

    def __init__(self, ram, ssd=None, writes=None):
        self.ram, self.ssd, self.writes = ram, ssd, writes


def test_the_budget_grows_while_ghosts_come_back_within_its_bounds_and_free_memory():
    m = cache(budget=400)
    t = tuner(m, 400, floor=1 * GB, ram_max=700)
    store(m, SYSTEM)
    m.set_budget(0)  # everything evicted
    m.set_budget(400)
    store(m, SYSTEM)  # came back: 40 bytes of ghosts, 10% of the budget
    changes = t.tick(available=64 * GB, total=128 * GB)
    assert [(c.setting, c.before, c.after) for c in changes] == [("cache.ram.budget", 400, 500)]
    assert "came back" in changes[0].reason and m.budget_bytes == 500
    # Ghosts again at the next looks: twice the last growth (a slow start); ram_max caps it.
    for expected in (700, 700, 700):
        m.set_budget(0), m.set_budget(t.guard.target_bytes), store(m, SYSTEM)
        t.tick(available=64 * GB, total=128 * GB)
        assert t.guard.target_bytes == expected
    # Free memory near twice the guard's floor: no step would keep it above, no growth.
    t2 = tuner(cache(budget=400), 400, floor=1 * GB)
    m2 = t2.ram
    store(m2, SYSTEM), m2.set_budget(0), m2.set_budget(400), store(m2, SYSTEM)
    assert t2.tick(available=2 * GB, total=128 * GB) == []
    assert m2.budget_bytes == 400


def test_one_look_grows_the_budget_to_what_would_have_kept_every_ghost_that_came_back():
    """A ghost's depth (the bytes evicted after it went, its own included) is how much more
    budget would have kept it: the first look its ghosts come back in sizes the budget to
    the working set, where growing by what came back would take several."""
    m = cache(budget=400)  # forty 10-byte blocks
    t = tuner(m, 400, floor=1 * GB, ram_max=1000)
    prompts = [list(range(2000 + 16 * i, 2016 + 16 * i)) for i in range(15)]  # 600 bytes
    for p in prompts:
        store(m, p)  # the first five prompts (200 bytes) evicted, in order
    store(m, prompts[0])  # 40 bytes come back; its first block went 200 bytes ago
    (change,) = t.tick(available=64 * GB, total=128 * GB)
    # Grown by the depth (200), not by what came back (40) nor by a step (100).
    assert (change.setting, change.before, change.after) == ("cache.ram.budget", 400, 600)
    assert "the deepest after" in change.reason
    # At 600 bytes the whole working set stays: a pass over it evicts nothing more.
    evicted = m.stats().evicted_bytes
    for p in prompts:
        store(m, p)
    assert m.stats().evicted_bytes == evicted


def test_looks_in_a_row_with_ghosts_double_the_growth_and_a_quiet_one_ends_it():
    m = cache(budget=400)
    t = tuner(m, 400, floor=1 * GB, ram_max=4000)
    store(m, SYSTEM)
    grown = []
    for look in range(4):
        if look != 2:  # the third look sees no ghost
            m.set_budget(0), m.set_budget(t.guard.target_bytes), store(m, SYSTEM)
        t.tick(available=64 * GB, total=128 * GB)
        grown.append(t.guard.target_bytes)
    # +100 (a step), +200 (twice that), nothing, then a step again: the doubling restarts.
    assert grown == [500, 700, 700, 800]


def test_a_look_is_due_at_the_interval_or_as_soon_as_ghosts_come_back():
    m = cache(budget=400)
    t = tuner(m, 400, floor=1 * GB)
    interval = t.settings.interval_s
    assert not t.due(interval / 2) and t.due(interval)
    store(m, SYSTEM), m.set_budget(0), m.set_budget(400)
    assert not t.due(interval / 2), "nothing came back yet"
    store(m, SYSTEM)  # 40 bytes came back, 10% of the budget
    assert t.due(t.EARLY_S) and not t.due(0.0)
    t.tick(available=64 * GB, total=128 * GB)  # the look takes them
    assert not t.due(t.EARLY_S)


def test_memory_goes_back_after_quiet_looks_never_below_the_configured_budget():
    m = cache(budget=400)
    t = tuner(m, 400)
    store(m, SYSTEM), m.set_budget(0), m.set_budget(400), store(m, SYSTEM)
    t.tick(available=64 * GB, total=128 * GB)
    assert t.guard.target_bytes == 500
    made = []
    for _ in range(2 * tuning.QUIET_TICKS):
        made += t.tick(available=64 * GB, total=128 * GB)
    assert [(c.before, c.after) for c in made] == [(500, 400)]
    assert "memory given back" in made[0].reason and m.budget_bytes == 400


def test_the_policy_leans_to_frequency_or_recency_by_what_came_back():
    m = cache(budget=40)
    t = tuner(m, 40, ram_max=40)
    store(m, SYSTEM)
    read(m, SYSTEM)
    m.set_budget(0), m.set_budget(40), store(m, SYSTEM)  # read entries came back
    (change,) = [c for c in t.tick(64 * GB, 128 * GB) if c.setting.endswith("frequent")]
    assert (change.before, change.after) == (0.0, tuning.POLICY_STEP)
    assert m.protect_frequent == tuning.POLICY_STEP
    burst(m, 1)  # SYSTEM out, and this burst's blocks are never read
    m.set_budget(0), m.set_budget(40), store(m, list(range(5000, 5016)))
    t.tick(64 * GB, 128 * GB)
    assert m.protect_frequent == 0.0
    stats = t.stats()
    assert stats["enabled"] and [c["setting"] for c in stats["changes"]][-1].endswith("frequent")
    assert stats["bounds"] == {"ram_min_bytes": 40, "ram_max_bytes": 40,
                               "protect_frequent_max": tuning.POLICY_MAX,
                               "checkpoint_interval_min": None}  # fmt: skip


def test_the_guard_under_pressure_holds_the_budget_whatever_comes_back():
    m = cache(budget=400)
    t = tuner(m, 400)
    t.guard.pressure.active = True
    store(m, SYSTEM), m.set_budget(0), m.set_budget(400), store(m, SYSTEM)
    assert not [c for c in t.tick(64 * GB, 128 * GB) if c.setting == "cache.ram.budget"]


def test_checkpoints_come_closer_while_hybrids_still_resume_short_never_on_a_split_model():
    def resumed_short(d: Diagnosis, at: float, gap: int = 600) -> None:
        """Five requests of 4,000 tokens that resumed `gap` tokens before they diverged."""
        for _ in range(5):
            d.add(Loss(at, "m", "t", "s", 4000, 3000, {"checkpoint_spacing": gap,
                       "new_content": 1000 - gap}, {"checkpoint_spacing": Evidence(gap=gap)}))  # fmt: skip

    for split in (False, True):
        d, policy = Diagnosis(), CachePolicy(checkpoint_interval=1024)
        t = tuner(cache(budget=400), 400, floor=1 * GB, diagnosis=d,
                  policy=None if split else policy)  # fmt: skip
        resumed_short(d, 990.0)  # 3,000 tokens short, 60% of what was computed again
        spaced = []
        for now in (1000.0, 1001.0, 1003.0, 1005.0, 1007.0):
            if now > 1001:
                resumed_short(d, now - 1)  # requests after the last change, still short
            changes = t.tick(available=64 * GB, total=128 * GB, now=now)
            spaced += [(c.setting, c.before, c.after) for c in changes if "periodic" in
                       c.setting or "interval" in c.setting]  # fmt: skip
        # First the newest periodic checkpoint is kept; nothing at 1001 (no request since);
        # then the interval halves toward the gap (600 -> 512, then 256), never past 256.
        expected = [("cache.ram.keep_periodic", False, True)]
        if not split:
            expected += [("cache.ram.checkpoint_interval", 1024, 512),
                         ("cache.ram.checkpoint_interval", 512, 256)]  # fmt: skip
        assert spaced == expected, split
        assert policy.checkpoint_interval == (1024 if split else 256)
        assert t.stats()["checkpoint_interval"] == (None if split else 256)


def test_a_day_on_course_past_the_wear_budget_writes_only_what_is_reused(tmp_path):
    noon = 20792 * 86400.0 + 12 * 3600  # 12:00 UTC
    clock = [noon]
    meter = WearMeter(tmp_path / "wear.json", max_per_day=1000, clock=lambda: clock[0])
    writes = SimpleNamespace(policy=WritePolicy.THROUGH)
    m = cache(budget=40)
    t = Autotune(AutotuneSettings(True), _Tiers(m, SimpleNamespace(wear=meter), writes),
                 MemoryGuard(_Tiers(m), EngineSettings(Path("/x"), ram_budget_bytes=40)))  # fmt: skip
    meter.record(400)  # on course for 800 a day: under the budget
    assert t.tick(64 * GB, 128 * GB, now=noon) == []
    meter.record(200)  # 600 by noon: on course for 1,200
    (change,) = t.tick(64 * GB, 128 * GB, now=noon)
    assert (change.setting, change.before, change.after) == (
        "cache.ssd.write_policy", "through", "second-use")  # fmt: skip
    assert "max_write_per_day" in change.reason and writes.policy is WritePolicy.SECOND_USE
    clock[0] = noon + 86400  # the next day: nothing written yet
    (back,) = t.tick(64 * GB, 128 * GB, now=clock[0])
    assert back.after == "through" and writes.policy is WritePolicy.THROUGH
    # A second-use the user chose stays theirs.
    writes.policy = WritePolicy.SECOND_USE
    assert t.tick(64 * GB, 128 * GB, now=clock[0]) == []


# --- a real server -------------------------------------------------------------------------

SSD_OFF = {"MLX_PROMPT_CACHE_CACHE_SSD_ENABLED": "false"}


def projects(server, rounds: int) -> list[tuple[int, int]]:
    """Two projects' conversations in turn, `rounds` turns each: 300 KB of RAM holds one
    (six to eight of demo-llama's 32 KB blocks), twice that both."""
    client = oai(server, "t")
    history = {name: [{"role": "system", "content": long_system(10, salt=f"Project {name}. ")},
                      QUESTION] for name in "ab"}  # fmt: skip
    hits = []
    for r in range(rounds):
        for name in "ab":
            reply, headers = ask(client, history[name], session=name, rid=f"{name}-{r}")
            hits.append((reply.usage.prompt_tokens, int(headers["x-prompt-cache-hit-tokens"])))
            history[name] += [{"role": "assistant", "content": reply.choices[0].message.content},
                              {**FOLLOW_UP, "content": f"{FOLLOW_UP['content']} ({r})"}]  # fmt: skip
        time.sleep(0.5)  # the tuner's early look between rounds (it asks every 0.25 s)
    return hits


def test_a_server_grows_its_budget_while_evicted_blocks_come_back_and_answers_as_bypass(
    tmp_path, demo_root
):
    # Its interval outlasts the test: each look is one ghosts that came back asked for.
    config = tmp_path / "tuned.toml"
    config.write_text('[autotune]\ninterval = "1h"\n')
    s = start_server(fresh_cache_dir(demo_root, tmp_path / "c"), "--config", str(config),
                     "--model", LLAMA, "--ram-budget", "300000",
                     "--upstream", "http://127.0.0.1:9", env=SSD_OFF)  # fmt: skip
    try:
        hits = projects(s, 7)
        tuned = httpx.get(s.url + "/v1/cache/stats", timeout=30).json()
        # Tuning changes what is kept, never an answer: the last turn equals bypass.
        client = oai(s, "t")
        messages = [{"role": "system", "content": long_system(10, salt="Project a. ")}, QUESTION]
        cached = ask(client, messages, session="a", rid="check")[0].choices[0].message.content
        fresh = ask(client, messages, session="x", rid="bypass", bypass=True)[0]
        assert cached == fresh.choices[0].message.content
    finally:
        s.stop()
    auto = tuned["autotune"]
    grew = [c for c in auto["changes"] if c["setting"] == "cache.ram.budget"]
    assert grew and grew[0]["from"] == 300_000 and grew[0]["to"] > 300_000, auto
    assert "came back" in grew[0]["reason"]
    assert auto["ram_budget_bytes"] <= auto["bounds"]["ram_max_bytes"] == 600_000
    assert tuned["ram"]["budget_bytes"] == auto["ram_budget_bytes"]
    assert tuned["memory"]["shrinks"] == 0, "tuning never brings the memory guard on"
    first, last = hits[2:4], hits[-2:]  # round 2 (evicted) against the last (grown)
    assert sum(h for _, h in last) / sum(p for p, _ in last) > sum(h for _, h in first) / sum(
        p for p, _ in first
    ), hits
    assert "autotune: cache.ram.budget" in s.log_path.read_text()


def test_autotune_off_keeps_the_fixed_budget(tmp_path, demo_root):
    config = tmp_path / "fixed.toml"
    config.write_text('[autotune]\nenabled = false\ninterval = "1s"\n')
    s = start_server(fresh_cache_dir(demo_root, tmp_path / "c"), "--config", str(config),
                     "--model", LLAMA, "--ram-budget", "100000",
                     "--upstream", "http://127.0.0.1:9", env=SSD_OFF)  # fmt: skip
    try:
        projects(s, 2)
        stats = httpx.get(s.url + "/v1/cache/stats", timeout=30).json()
    finally:
        s.stop()
    assert stats["autotune"] == {"enabled": False}
    assert stats["ram"]["budget_bytes"] == 100_000


def test_the_eviction_fix_names_autotune_while_it_grows_and_its_bound_once_there():
    lost = Ranked("evicted", tokens=1000, requests=3)
    ctx = Context(ram_budget_bytes=300_000, ram_room_bytes=None, bytes_per_token=500.0,
                  ssd_enabled=True, ssd_disabled_reason=None, ssd_max_bytes=None,
                  ssd_bytes=None, session_ttl_s=None, ssd_ttl_s=None,
                  checkpoint_interval=1024, keep_periodic=False, block_size=64,
                  warm_ahead=True)  # fmt: skip
    assert fix(lost, ctx)["key"] == "cache.ram.budget"  # the fixed settings
    on = {"enabled": True, "bounds": {"ram_max_bytes": 600_000}}
    growing = fix(lost, replace(ctx, tuning=on))
    assert growing["key"] is None and "autotune is growing the budget" in growing["text"]
    at_bound = fix(lost, replace(ctx, ram_budget_bytes=600_000, tuning=on))
    assert (at_bound["key"], at_bound["value"]) == (
        "autotune.ram_max",
        "2MB",
    )  # 0.6 MB + 1.5 x 0.5 MB, rounded up
