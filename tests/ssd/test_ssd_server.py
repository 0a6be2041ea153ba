"""The SSD tier end to end: real server processes restarted, killed, spilling and draining.

Every cached answer here is compared with a `x-prompt-cache: bypass` answer to the same
prompt: a restart or a crash may cost hits, never correctness. A slow disk reaches the
server process through tests/ssd_faults/sitecustomize.py (loaded via PYTHONPATH). Damaged
files and failing disks are test_ssd_damage.py's.

`pytest tests/ssd/test_ssd_server.py -s` prints the measured hit ratios and reload latencies.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest

from tests.conftest import QWEN36, fresh_cache_dir, start_server
from tests.support.ssd_server_helpers import (
    HYBRID,
    LLAMA,
    MAX_TOKENS,
    NO_UPSTREAM,
    QUESTIONS,
    SWA,
    Conversation,
    assert_every_entry_file_is_whole,
    assert_index_matches_files,
    chat,
    cli,
    cli_json,
    drained,
    entry_files,
    fault_env,
    index_sizes,
    model_dir_listing,
    reconcile_reports,
    scripted,
    stats,
    system_prompt,
)

# -- 1. warm restart -------------------------------------------------------------------------

# Every cache kind, and our user's model shape: its DeltaNet checkpoints, experts and 248k
# vocabulary come back from SSD alike.
RESTARTED = (LLAMA, HYBRID, SWA, QWEN36)


@pytest.fixture(scope="module")
def restarted(demo_root, tmp_path_factory):
    """Three turns per demo model on one server, SIGTERM, a new server on the same dir."""
    cache_dir = fresh_cache_dir(demo_root, tmp_path_factory.mktemp("ssd-restart"))
    served = [arg for model in RESTARTED for arg in ("--model", model)]
    first = start_server(cache_dir, *NO_UPSTREAM, *served)
    conversations = {}
    try:
        for model in RESTARTED:
            conv = Conversation(model, system_prompt())
            for turn in range(3):
                reply = conv.ask(first.url, QUESTIONS[turn])
                assert reply.source == ("none" if turn == 0 else "ram"), (model, turn, reply)
            conversations[model] = conv
        written = stats(first)["ssd"]
    finally:
        first.stop(signal.SIGTERM)
    second = start_server(cache_dir, *NO_UPSTREAM, *served)
    try:
        yield second, conversations, written
    finally:
        second.stop()


@pytest.mark.parametrize("model", RESTARTED)
def test_restart_answers_turn_4_from_ssd_like_bypass(restarted, model):
    server, conversations, _ = restarted
    conv = conversations[model]
    conv.messages.append({"role": "user", "content": QUESTIONS[3]})
    cached = chat(server.url, model, conv.prompt())
    cold = chat(server.url, model, conv.prompt(), bypass=True)
    ratio = cached.cached / cached.prompt_tokens
    ssd = stats(server)["ssd"]
    print(
        f"\n[restart] {model}: {cached.cached}/{cached.prompt_tokens} tokens from "
        f"{cached.source} ({ratio:.1%}); reload mean {ssd['reload_ms_mean']:.2f} ms, "
        f"p95 {ssd['reload_ms_p95']:.2f} ms over {ssd['hits']} reads"
    )
    assert cached.source == "ssd"
    assert ratio >= 0.9, cached
    assert cached.completion_tokens == cold.completion_tokens == MAX_TOKENS
    assert cached.text == cold.text
    assert ssd["hits"] > 0 and ssd["reload_ms_mean"] > 0 and ssd["reload_ms_p95"] > 0
    assert (ssd["quarantined"], ssd["read_errors"], ssd["promotion_failures"]) == (0, 0, 0)


def test_restart_after_sigkill_still_hits_ssd_like_bypass(demo_root, tmp_path):
    cache_dir = fresh_cache_dir(demo_root, tmp_path / "cache")
    slow_disk = tmp_path / "fault"
    first = start_server(cache_dir, *NO_UPSTREAM, env=fault_env(cache_dir, slow_disk))
    conversations = [Conversation(model, system_prompt("crash")) for model in (LLAMA, HYBRID)]
    for turn in range(2):
        for conv in conversations:
            conv.ask(first.url, QUESTIONS[turn])
    drained(first)  # turns 1-2 are on disk; turn 3's writes are still queued at the kill
    slow_disk.write_text("slow:0.2")
    for conv in conversations:
        conv.ask(first.url, QUESTIONS[2])
    queued = stats(first)["ssd"]["queued"]
    assert queued > 0
    first.stop(signal.SIGKILL)
    assert first.proc.returncode == -signal.SIGKILL
    assert_every_entry_file_is_whole(cache_dir)
    second = start_server(cache_dir, *NO_UPSTREAM)
    try:
        for conv in conversations:
            conv.messages.append({"role": "user", "content": QUESTIONS[3]})
            cached = chat(second.url, conv.model, conv.prompt())
            cold = chat(second.url, conv.model, conv.prompt(), bypass=True)
            print(
                f"\n[sigkill] {conv.model}: {cached.cached}/{cached.prompt_tokens} from "
                f"{cached.source} ({queued} writes queued at the kill)"
            )
            assert cached.source == "ssd" and cached.cached > 0, cached
            assert cached.text == cold.text
    finally:
        second.stop()


# -- 2. crash rounds ---------------------------------------------------------------------------

CRASH_ROUNDS = 5
CRASH_SEED = 4
# Several conversations per model, each a prefix of the next: shared blocks, spills under a
# tiny RAM budget, and SSD hits on every restart.
CRASH_PROMPTS = [
    (model, scripted(system_prompt(f"s{salt}", 16), turns))
    for model in (LLAMA, HYBRID)
    for salt in range(2)
    for turns in (1, 3)
]
PROBES = [i for i, (_, messages) in enumerate(CRASH_PROMPTS) if messages[0]["content"][:3] == "s0 "]


@dataclass(slots=True)
class Traffic:
    """Requests from a background thread until the server dies under it."""

    url: str
    expected: dict[int, str]
    rng: random.Random
    answered: int = 0
    wrong: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        with httpx.Client() as client:
            while not self.stop.is_set():
                i = self.rng.randrange(len(CRASH_PROMPTS))
                model, messages = CRASH_PROMPTS[i]
                try:
                    reply = chat(self.url, model, messages, client=client)
                except httpx.HTTPError:
                    return  # killed mid-request
                self.answered += 1
                if reply.text != self.expected[i]:
                    self.wrong.append(f"prompt {i} ({reply.source}): {reply.text!r}")


def test_sigkill_rounds_never_serve_a_torn_block(demo_root, tmp_path):
    cache_dir = fresh_cache_dir(demo_root, tmp_path)
    rng = random.Random(CRASH_SEED)
    server = start_server(cache_dir, *NO_UPSTREAM)
    expected = {
        i: chat(server.url, model, messages, bypass=True).text
        for i, (model, messages) in enumerate(CRASH_PROMPTS)
    }
    totals = {"spills": 0, "write_throughs": 0, "ssd_probe_hits": 0, "answered": 0}
    for round_ in range(CRASH_ROUNDS):
        traffic = Traffic(server.url, expected, random.Random(rng.random()))
        thread = threading.Thread(target=traffic.run)
        thread.start()
        time.sleep(rng.uniform(0.4, 1.2))
        before = stats(server)["ssd"]
        server.stop(signal.SIGKILL)
        traffic.stop.set()
        thread.join(30)
        assert traffic.wrong == [], f"round {round_}: answers differ from bypass"
        totals["answered"] += traffic.answered
        totals["spills"] += before["spills"]
        totals["write_throughs"] += before["write_throughs"]

        # Offline, with nothing running: no torn file under an entry name, CLI works.
        files = assert_every_entry_file_is_whole(cache_dir)
        offline = cli_json(cache_dir, "stats")[0]
        assert offline["entries"] == len(index_sizes(cache_dir)) <= files
        assert offline["quarantined_files"] == 0

        # Alternate spill-only rounds (write-through off) and write-through rounds.
        write_through = "true" if round_ % 2 else "false"
        env = {
            "MLX_PROMPT_CACHE_CACHE_RAM_BUDGET": "250KB",
            "MLX_PROMPT_CACHE_CACHE_SSD_WRITE_THROUGH": write_through,
        }
        server = start_server(cache_dir, *NO_UPSTREAM, env=env)
        (report,) = reconcile_reports(server)
        assert report["quarantined"] == 0, report
        indexed = offline["entries"] - report["rows_dropped"] + report["adopted"]
        assert assert_index_matches_files(cache_dir) == indexed, report
        for i in PROBES:
            model, messages = CRASH_PROMPTS[i]
            reply = chat(server.url, model, messages)
            assert reply.text == expected[i], (round_, i, reply)
            totals["ssd_probe_hits"] += reply.source == "ssd"
        ssd = stats(server)["ssd"]
        assert (ssd["disabled"], ssd["quarantined"], ssd["read_errors"]) == (False, 0, 0), ssd
    server.stop()
    print(f"\n[crash rounds] {CRASH_ROUNDS} rounds: {totals}")
    assert totals["spills"] > 0 and totals["write_throughs"] > 0, totals
    assert totals["ssd_probe_hits"] > 0, totals


# -- 3. offline CLI ------------------------------------------------------------------------------


def test_offline_cli_reports_what_the_server_wrote_and_clear_keeps_models(demo_root, tmp_path):
    cache_dir = fresh_cache_dir(demo_root, tmp_path)
    # No checkpoint held back: what the server reports written is all the close leaves.
    env = {"MLX_PROMPT_CACHE_CACHE_SSD_CHECKPOINT_WRITE_DELAY": "0"}
    server = start_server(cache_dir, *NO_UPSTREAM, env=env)
    try:
        for model in (LLAMA, HYBRID):
            Conversation(model, system_prompt("cli")).ask(server.url, QUESTIONS[0])
        written = drained(server)
    finally:
        server.stop()
    fingerprints = {p.relative_to(cache_dir).parts[0] for p in entry_files(cache_dir)}
    models_before = model_dir_listing(cache_dir)

    (offline,) = cli_json(cache_dir, "stats")
    assert (offline["entries"], offline["bytes"]) == (written["entries"], written["bytes"])
    assert (offline["models"], offline["tenants"], offline["quarantined_files"]) == (2, 2, 0)
    assert offline["entries"] == written["writes"] == len(entry_files(cache_dir))
    groups = cli_json(cache_dir, "ls")
    assert {g["model"] for g in groups} == fingerprints
    assert sum(g["entries"] for g in groups) == written["entries"]
    assert all(g["blocks"] + g["checkpoints"] == g["entries"] > 0 for g in groups), groups
    assert "entries" in cli(cache_dir, "stats").stdout
    assert all(f[:12] in cli(cache_dir, "ls").stdout for f in fingerprints)

    assert cli_json(cache_dir, "clear") == [{"removed": written["entries"]}]
    (cleared,) = cli_json(cache_dir, "stats")
    assert (cleared["entries"], cleared["bytes"]) == (0, 0)
    assert entry_files(cache_dir) == [] and cli_json(cache_dir, "ls") == []
    assert model_dir_listing(cache_dir) == models_before

    server = start_server(cache_dir, *NO_UPSTREAM)
    try:
        messages = scripted(system_prompt("cli"), 1)
        reply = chat(server.url, LLAMA, messages)
        assert (
            reply.source == "none"
            and reply.text == chat(server.url, LLAMA, messages, bypass=True).text
        )
        assert drained(server)["entries"] > 0
    finally:
        server.stop()


# -- 4. spill without write-through ------------------------------------------------------------


def test_evicted_blocks_spill_and_come_back_from_ssd_behind_a_hot_prefix(demo_root, tmp_path):
    """Conversations share a system prompt whose blocks stay hot in RAM; each one's own
    tail is evicted and spilled. The next turn must find that tail on SSD behind the
    RAM-resident prefix (which was never evicted, so never spilled)."""
    cache_dir = fresh_cache_dir(demo_root, tmp_path)
    env = {
        "MLX_PROMPT_CACHE_CACHE_SSD_WRITE_THROUGH": "false",
        "MLX_PROMPT_CACHE_CACHE_RAM_BUDGET": "300KB",
    }
    system = system_prompt(sentences=10)

    def conversation(model: str, i: int) -> Conversation:
        conv = Conversation(model, system)
        conv.ask(server.url, system_prompt(f"Question {i}:", sentences=14))  # ~300 tokens
        return conv

    server = start_server(cache_dir, *NO_UPSTREAM, env=env)
    try:
        for model in (LLAMA, HYBRID):
            first = conversation(model, 0)
            for i in range(1, 5):  # each pushes older tails out of the 300 KB of RAM
                conversation(model, i)
            spilled = drained(server)
            assert spilled["spills"] > 0 and spilled["write_throughs"] == 0, spilled
            reply = first.ask(server.url, QUESTIONS[1])
            cold = chat(server.url, model, first.prompt()[:-1], bypass=True)
            print(f"\n[spill] {model}: {reply.cached}/{reply.prompt_tokens} from {reply.source}")
            assert reply.source == "ssd", reply
            assert reply.cached / reply.prompt_tokens >= 0.9, reply
            assert reply.text == cold.text
    finally:
        server.stop()


# -- 5. clean shutdown ---------------------------------------------------------------------------


def test_sigterm_drains_the_write_queue_in_bounded_time(demo_root, tmp_path):
    cache_dir = fresh_cache_dir(demo_root, tmp_path / "cache")
    trigger = tmp_path / "fault"
    trigger.write_text("slow:0.1")  # every entry write takes 100 ms longer: a queue builds up
    server = start_server(cache_dir, *NO_UPSTREAM, env=fault_env(cache_dir, trigger))
    for model in (LLAMA, HYBRID, SWA):
        Conversation(model, system_prompt("drain")).ask(server.url, QUESTIONS[0])
    before = stats(server)["ssd"]  # entries are read before the queue length
    assert before["queued"] > 0, before
    start = time.monotonic()
    server.stop(signal.SIGTERM, timeout=30)
    took = time.monotonic() - start
    print(f"\n[drain] {before['queued']} queued at SIGTERM, exited in {took:.1f}s")
    assert took < 15, took
    assert "writer still busy" not in server.log()
    (offline,) = cli_json(cache_dir, "stats")
    assert offline["entries"] >= before["entries"] + before["queued"], (offline, before)
    assert assert_index_matches_files(cache_dir) == offline["entries"]
    assert assert_every_entry_file_is_whole(cache_dir) == offline["entries"]


def test_sigterm_exit_status_is_0(demo_root, tmp_path):
    # The abort this guards against hit about 1 shutdown in 5: several rounds catch it.
    cache_dir = fresh_cache_dir(demo_root, tmp_path)
    for round_ in range(4):
        server = start_server(cache_dir, *NO_UPSTREAM)
        for model in (HYBRID, SWA):  # both run mx.compile'd functions on their threads
            Conversation(model, system_prompt(f"exit {round_}")).ask(server.url, QUESTIONS[0])
        assert server.stop(signal.SIGTERM) == 0, server.log()[-2000:]
