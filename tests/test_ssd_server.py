"""The SSD tier end to end: real server processes restarted, killed, corrupted and starved.

Every cached answer here is compared with a `x-prompt-cache: bypass` answer to the same
prompt: a restart, a crash or a damaged file may cost hits, never correctness. Disk faults
reach the server process through tests/ssd_faults/sitecustomize.py (loaded via PYTHONPATH),
since tests run as root and a chmod would not stop a write.

`pytest tests/test_ssd_server.py -s` prints the measured hit ratios and reload latencies.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from conftest import REPO, Server, fresh_cache_dir, start_server

from engine_bridge.cache.index import Index
from engine_bridge.cache.ssd_format import verify_file

LLAMA, HYBRID, SWA = "demo-llama", "demo-hybrid", "demo-swa"
MAX_TOKENS = 16
FAULTS = Path(__file__).resolve().parent / "ssd_faults"
NO_UPSTREAM = ("--upstream", "http://127.0.0.1:9")

_SENTENCES = (
    "The {0} service keeps every order in one ledger and writes it to disk each night.",
    "A request for the {0} report must name the region, the month and the currency.",
    "When the {0} queue is longer than forty jobs, new jobs wait and the caller is told.",
    "Never delete a {0} record; mark it closed and keep the history for seven years.",
    "Times in the {0} logs are UTC, and every line starts with the id of its request.",
    "If a {0} customer asks for a refund, check the ledger before you promise anything.",
)
_TOPICS = ("billing", "shipping", "inventory", "payroll", "support", "search", "audit")
_QUESTIONS = (
    "Which region does the billing report need first?",
    "How long do we keep closed payroll records, and why?",
    "What happens when the shipping queue is too long?",
    "Summarise the rules for refunds in one line.",
    "Who reads the audit logs, and in which time zone?",
)


def system_prompt(salt: str = "", sentences: int = 20) -> str:
    """Plain, varied prose of about 20 tokens a sentence (20 sentences ≈ 400 tokens)."""
    lines = [
        _SENTENCES[i % len(_SENTENCES)].format(_TOPICS[(i * 5 + i // 6) % len(_TOPICS)])
        for i in range(sentences)
    ]
    return f"{salt} " + " ".join(lines) if salt else " ".join(lines)


@dataclass(slots=True)
class Reply:
    text: str
    prompt_tokens: int
    completion_tokens: int
    cached: int
    source: str


def chat(
    url: str, model: str, messages: list[dict], *, bypass: bool = False, client=httpx
) -> Reply:
    headers = {"x-prompt-cache": "bypass"} if bypass else {}
    body = {"model": model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    r = client.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert int(r.headers["x-prompt-cache-hit-tokens"]) == cached
    return Reply(
        r.json()["choices"][0]["message"]["content"],
        usage["prompt_tokens"],
        usage["completion_tokens"],
        cached,
        r.headers["x-prompt-cache-source"],
    )


@dataclass(slots=True)
class Conversation:
    """A chat whose assistant turns are the model's own greedy replies."""

    model: str
    system: str
    messages: list[dict] = field(default_factory=list)

    def ask(self, url: str, question: str) -> Reply:
        self.messages.append({"role": "user", "content": question})
        reply = chat(url, self.model, self.prompt())
        self.messages.append({"role": "assistant", "content": reply.text})
        return reply

    def prompt(self) -> list[dict]:
        return [{"role": "system", "content": self.system}, *self.messages]


def scripted(system: str, turns: int) -> list[dict]:
    """A fixed conversation (assistant turns written here), so its prompt never varies."""
    messages = [{"role": "system", "content": system}]
    for i in range(turns):
        messages.append({"role": "user", "content": _QUESTIONS[i % len(_QUESTIONS)]})
        if i < turns - 1:
            messages.append({"role": "assistant", "content": f"Answer {i}: see the ledger."})
    return messages


# -- server and cache-dir helpers ----------------------------------------------------------


def stats(server: Server) -> dict:
    r = httpx.get(server.url + "/v1/cache/stats", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def drained(server: Server, timeout: float = 20.0) -> dict:
    """The SSD stats once the writer's queue is empty."""
    deadline = time.monotonic() + timeout
    while True:
        ssd = stats(server)["ssd"]
        if ssd["queued"] == 0:
            return ssd
        assert time.monotonic() < deadline, f"SSD queue never drained: {ssd}"
        time.sleep(0.05)


def cli(cache_dir: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "proxy.cli", "cache", *args, "--cache-dir", str(cache_dir)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done


def cli_json(cache_dir: Path, *args: str):
    lines = cli(cache_dir, *args, "--json").stdout.splitlines()
    return [json.loads(line) for line in lines]


def entry_files(cache_dir: Path, kind: str = "*") -> list[Path]:
    """Entry files under <dir>/<fingerprint>/<tenant>/<kind>/<shard>/ (never models/)."""
    return sorted(
        p
        for p in cache_dir.glob(f"*/*/{kind}/*/*.safetensors")
        if p.relative_to(cache_dir).parts[0] not in ("models", "quarantine")
    )


def temp_files(cache_dir: Path) -> list[Path]:
    return [p for p in cache_dir.glob("*/*/*/*/.*.tmp") if "models" not in p.parts]


def quarantined(cache_dir: Path) -> list[Path]:
    q = cache_dir / "quarantine"
    return sorted(q.iterdir()) if q.is_dir() else []


def index_sizes(cache_dir: Path) -> dict[Path, int]:
    """Every index row as the file it names and the size it records."""
    index = Index.open_readonly(cache_dir)
    if index is None:
        return {}
    try:
        return {
            cache_dir / r.scope.model / r.scope.tenant / r.kind / r.key.hex()[:2] /
            f"{r.key.hex()}.safetensors": r.size
            for r in index.rows()
        }  # fmt: skip
    finally:
        index.close()


def assert_whole(path: Path) -> None:
    """The file passes full validation (header, sizes, checksum) as the entry it is named."""
    fd = os.open(path, os.O_RDONLY)
    try:
        header = verify_file(fd, os.fstat(fd).st_size, bytes.fromhex(path.stem))
    finally:
        os.close(fd)
    assert header.key.hex() == path.stem


def assert_every_entry_file_is_whole(cache_dir: Path) -> int:
    files = entry_files(cache_dir)
    for path in files:
        assert_whole(path)
    return len(files)


def assert_index_matches_files(cache_dir: Path) -> int:
    rows = index_sizes(cache_dir)
    on_disk = {p: p.stat().st_size for p in entry_files(cache_dir)}
    assert rows.keys() - on_disk.keys() == set(), "index rows without files"
    assert on_disk.keys() - rows.keys() == set(), "files the index does not know"
    assert rows == on_disk, "index sizes differ from the files"
    assert temp_files(cache_dir) == []
    return len(rows)


_REPORT = re.compile(r"SSD cache: reconciled .*?: ReconcileReport\((.*?)\)")


def reconcile_reports(server: Server, timeout: float = 15.0) -> list[dict[str, float]]:
    """The startup reconcile reports in the server's log, waiting for the first one."""
    deadline = time.monotonic() + timeout
    while not (found := _REPORT.findall(server.log())):
        assert time.monotonic() < deadline, f"no reconcile report in the log:\n{server.log()}"
        time.sleep(0.05)
    return [{k: float(v) for k, v in (kv.split("=") for kv in r.split(", "))} for r in found]


def fault_env(cache_dir: Path, trigger: Path) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(FAULTS), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, "MPC_FAULT_ROOT": str(cache_dir), "MPC_FAULT_TRIGGER": str(trigger)}


def model_dir_listing(cache_dir: Path) -> dict[str, int]:
    root = cache_dir / "models"
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


# -- 1. warm restart -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def restarted(demo_root, tmp_path_factory):
    """Three turns per demo model on one server, SIGTERM, a new server on the same dir."""
    cache_dir = fresh_cache_dir(demo_root, tmp_path_factory.mktemp("ssd-restart"))
    first = start_server(cache_dir, *NO_UPSTREAM)
    conversations = {}
    try:
        for model in (LLAMA, HYBRID, SWA):
            conv = Conversation(model, system_prompt())
            for turn in range(3):
                reply = conv.ask(first.url, _QUESTIONS[turn])
                assert reply.source == ("none" if turn == 0 else "ram"), (model, turn, reply)
            conversations[model] = conv
        written = stats(first)["ssd"]
    finally:
        first.stop(signal.SIGTERM)
    second = start_server(cache_dir, *NO_UPSTREAM)
    try:
        yield second, conversations, written
    finally:
        second.stop()


@pytest.mark.parametrize("model", [LLAMA, HYBRID, SWA])
def test_restart_answers_turn_4_from_ssd_like_bypass(restarted, model):
    server, conversations, _ = restarted
    conv = conversations[model]
    conv.messages.append({"role": "user", "content": _QUESTIONS[3]})
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
            conv.ask(first.url, _QUESTIONS[turn])
    drained(first)  # turns 1-2 are on disk; turn 3's writes are still queued at the kill
    slow_disk.write_text("slow:0.2")
    for conv in conversations:
        conv.ask(first.url, _QUESTIONS[2])
    queued = stats(first)["ssd"]["queued"]
    assert queued > 0
    first.stop(signal.SIGKILL)
    assert first.proc.returncode == -signal.SIGKILL
    assert_every_entry_file_is_whole(cache_dir)
    second = start_server(cache_dir, *NO_UPSTREAM)
    try:
        for conv in conversations:
            conv.messages.append({"role": "user", "content": _QUESTIONS[3]})
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


# -- 3. corruption -----------------------------------------------------------------------------


def _flip_data_bytes(path: Path) -> None:
    """Invert 16 bytes in the middle of the tensor data (past the safetensors header)."""
    raw = bytearray(path.read_bytes())
    data_start = 8 + int.from_bytes(raw[:8], "little")
    mid = (data_start + len(raw)) // 2
    raw[mid : mid + 16] = bytes(b ^ 0xFF for b in raw[mid : mid + 16])
    path.write_bytes(raw)


def test_flipped_truncated_and_deleted_files_are_quarantined_or_ignored(demo_root, tmp_path):
    cache_dir = fresh_cache_dir(demo_root, tmp_path)
    # Checkpoints written as they are made, so the ones damaged below are the ones read.
    env = {"MLX_PROMPT_CACHE_CACHE_SSD_CHECKPOINT_WRITE_DELAY": "0"}
    server = start_server(cache_dir, *NO_UPSTREAM, env=env)
    # One conversation per kind of damage, so each damaged file is on some request's path.
    prompts = {
        "flip": (LLAMA, scripted(system_prompt("flip"), 2)),
        "truncate": (LLAMA, scripted(system_prompt("truncate"), 2)),
        "delete": (LLAMA, scripted(system_prompt("delete"), 2)),
        "checkpoints": (HYBRID, scripted(system_prompt("checkpoints"), 2)),
    }
    new_files: dict[str, list[Path]] = {}
    for name, (model, messages) in prompts.items():
        before = set(entry_files(cache_dir))
        chat(server.url, model, messages)
        drained(server)
        kind = "checkpoints" if name == "checkpoints" else "blocks"
        new_files[name] = sorted(set(entry_files(cache_dir, kind)) - before)
        assert new_files[name], name
    expected = {
        name: chat(server.url, m, msgs, bypass=True).text for name, (m, msgs) in prompts.items()
    }
    server.stop()

    flipped = new_files["flip"][len(new_files["flip"]) // 2]
    truncated = new_files["truncate"][len(new_files["truncate"]) // 2]
    deleted = new_files["delete"][len(new_files["delete"]) // 2]
    _flip_data_bytes(flipped)
    os.truncate(truncated, truncated.stat().st_size // 2)
    deleted.unlink()
    for path in new_files["checkpoints"]:
        _flip_data_bytes(path)

    server = start_server(cache_dir, *NO_UPSTREAM, env=env)
    try:
        (report,) = reconcile_reports(server)
        assert report["rows_dropped"] == 1, report  # the deleted file's row
        replies = {name: chat(server.url, m, msgs) for name, (m, msgs) in prompts.items()}
        for name, reply in replies.items():
            assert reply.text == expected[name], (name, reply)
        ssd = stats(server)["ssd"]
    finally:
        server.stop()
    moved = quarantined(cache_dir)
    print(
        f"\n[corruption] quarantined {ssd['quarantined']}: {[r.source for r in replies.values()]}"
    )
    assert ssd["quarantined"] == len(moved) >= 3, (ssd, moved)
    assert any(flipped.name in p.name for p in moved) and any(
        truncated.name in p.name for p in moved
    )
    assert any(".checkpoints." in p.name for p in moved), moved
    # Blocks in front of the damage still come from the SSD; those behind it are recomputed.
    assert replies["delete"].source == "ssd" or deleted == new_files["delete"][0]
    # The recomputed blocks were written again, whole, under the same names.
    for path in (flipped, truncated, deleted):
        assert_whole(path)


def test_corrupt_deepest_checkpoint_falls_back_to_a_shallower_one(demo_root, tmp_path):
    """A hybrid model needs a checkpoint: losing the deepest one must cost one step, not all."""
    from safetensors import safe_open

    cache_dir = fresh_cache_dir(demo_root, tmp_path)
    server = start_server(cache_dir, *NO_UPSTREAM)
    convo = Conversation(HYBRID, system_prompt("fallback"))
    for q in _QUESTIONS[:3]:
        convo.ask(server.url, q)
    convo.messages.append({"role": "user", "content": _QUESTIONS[3]})
    expected = chat(server.url, HYBRID, convo.prompt(), bypass=True).text
    drained(server)
    server.stop()
    # A copy to learn which checkpoint the next turn resumes from, untouched.
    probe_dir = tmp_path / "probe"
    shutil.copytree(cache_dir, probe_dir)
    probe = start_server(probe_dir, *NO_UPSTREAM)
    try:
        used = chat(probe.url, HYBRID, convo.prompt())
    finally:
        probe.stop()
    assert used.source == "ssd" and used.cached > 0, used

    def position(path: Path) -> int:
        with safe_open(str(path), "np") as f:
            return int(f.metadata()["mpc.tokens"])

    (resumed_from,) = [
        p for p in entry_files(cache_dir, "checkpoints") if position(p) == used.cached
    ]
    _flip_data_bytes(resumed_from)

    server = start_server(cache_dir, *NO_UPSTREAM)
    try:
        reply = chat(server.url, HYBRID, convo.prompt())
        ssd = stats(server)["ssd"]
    finally:
        server.stop()
    assert reply.text == expected == used.text
    assert reply.source == "ssd"
    assert 0 < reply.cached < used.cached
    assert ssd["quarantined"] == 1, ssd


# -- 4. full disk and read-only folder ---------------------------------------------------------


@pytest.mark.parametrize(
    ("fault", "errno_text"), [("enospc", "No space left on device"), ("erofs", "Read-only")]
)
def test_disk_fault_falls_back_to_ram_only_with_one_warning(demo_root, tmp_path, fault, errno_text):
    cache_dir = fresh_cache_dir(demo_root, tmp_path / "cache")
    trigger = tmp_path / "fault"
    server = start_server(cache_dir, *NO_UPSTREAM, env=fault_env(cache_dir, trigger))
    try:
        before = Conversation(LLAMA, system_prompt("before"))
        before.ask(server.url, _QUESTIONS[0])
        written = drained(server)
        assert written["entries"] > 0 and not written["disabled"], written

        trigger.write_text(fault)
        conversations = [
            before,
            Conversation(LLAMA, system_prompt("after")),
            Conversation(HYBRID, system_prompt("after")),
        ]
        for turn in range(1, 3):
            for conv in conversations:
                reply = conv.ask(server.url, _QUESTIONS[turn])
                cold = chat(server.url, conv.model, conv.prompt()[:-1], bypass=True)
                assert reply.text == cold.text, (conv.model, turn)
        ssd = drained(server)
        log = server.log()
    finally:
        server.stop()
    assert ssd["disabled"] is True and errno_text in ssd["disabled_reason"], ssd
    assert ssd["entries"] == written["entries"], "entries written before the fault stay"
    warnings = [line for line in log.splitlines() if "SSD cache disabled" in line]
    assert len(warnings) == 1, warnings
    assert ("(disk full)" in warnings[0]) == (fault == "enospc")
    assert temp_files(cache_dir) == []
    assert "Traceback" not in log


# -- 5. offline CLI ------------------------------------------------------------------------------


def test_offline_cli_reports_what_the_server_wrote_and_clear_keeps_models(demo_root, tmp_path):
    cache_dir = fresh_cache_dir(demo_root, tmp_path)
    # No checkpoint held back: what the server reports written is all the close leaves.
    env = {"MLX_PROMPT_CACHE_CACHE_SSD_CHECKPOINT_WRITE_DELAY": "0"}
    server = start_server(cache_dir, *NO_UPSTREAM, env=env)
    try:
        for model in (LLAMA, HYBRID):
            Conversation(model, system_prompt("cli")).ask(server.url, _QUESTIONS[0])
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


# -- 6. spill without write-through ------------------------------------------------------------


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
            reply = first.ask(server.url, _QUESTIONS[1])
            cold = chat(server.url, model, first.prompt()[:-1], bypass=True)
            print(f"\n[spill] {model}: {reply.cached}/{reply.prompt_tokens} from {reply.source}")
            assert reply.source == "ssd", reply
            assert reply.cached / reply.prompt_tokens >= 0.9, reply
            assert reply.text == cold.text
    finally:
        server.stop()


# -- 7. clean shutdown ---------------------------------------------------------------------------


def test_sigterm_drains_the_write_queue_in_bounded_time(demo_root, tmp_path):
    cache_dir = fresh_cache_dir(demo_root, tmp_path / "cache")
    trigger = tmp_path / "fault"
    trigger.write_text("slow:0.1")  # every entry write takes 100 ms longer: a queue builds up
    server = start_server(cache_dir, *NO_UPSTREAM, env=fault_env(cache_dir, trigger))
    for model in (LLAMA, HYBRID, SWA):
        Conversation(model, system_prompt("drain")).ask(server.url, _QUESTIONS[0])
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
            Conversation(model, system_prompt(f"exit {round_}")).ask(server.url, _QUESTIONS[0])
        assert server.stop(signal.SIGTERM) == 0, server.log()[-2000:]
