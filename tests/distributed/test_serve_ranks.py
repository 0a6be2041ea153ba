"""`mlx-prompt-cache serve --ranks 2`, as a user runs it (issue 34): the front starts two
ring ranks through mlx.launch, rank 0 serves every route behind it, and the prompt cache
is split with the model (each rank its slice, in its own RAM and SSD tiers).

With the official SDKs through the front: greedy answers with the cache equal the same
server's with `x-prompt-cache: bypass`, on a hybrid model (Qwen3.5's layer kinds) and a
plain one, batched, and with prompt-lookup speculation drafting; a second turn resumes from
RAM; a restart of every rank resumes from SSD; a rank killed mid-stream ends the stream
with a 503 naming it within the deadline, the front starts the ranks again, and the next
request is served (from SSD, nothing lost). Sharded against single-process answers:
test_lockstep.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.conftest import REPO, free_ports, fresh_cache_dir, start_server

SYSTEM = "You are a terse assistant who answers in one line. " * 8
FILE = "".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(8))
COPIED = FILE[: len(FILE) // 2]
QUESTIONS = ["Name three rivers.", "What is a prompt cache?", "Count to five.", "Say hi."]
DEADLINE_S = 6.0


def _start(cache_dir: Path, forced: Path, ports: int):
    return start_server(
        cache_dir,
        "--upstream",
        "http://127.0.0.1:9",
        "--ranks",
        "2",
        "--model",
        "demo-hybrid",
        "--model",
        "demo-llama",
        env={
            "MLX_PROMPT_CACHE_DISTRIBUTED_PORT": str(ports),
            "MLX_PROMPT_CACHE_DISTRIBUTED_DEADLINE": f"{DEADLINE_S:g}s",
            "MLX_PROMPT_CACHE_FORCE_OUTPUT": str(forced),
            "MLX_PROMPT_CACHE_ENGINE_SPECULATIVE": "prompt-lookup",
            # Checkpoints go to SSD at once (not held back for a deeper one): a killed rank
            # then has on disk what the test waited to see written.
            "MLX_PROMPT_CACHE_CACHE_SSD_CHECKPOINT_WRITE_DELAY": "0",
        },
    )


@pytest.fixture(scope="module")
def world(demo_root, tmp_path_factory):
    root = tmp_path_factory.mktemp("ranks")
    forced = root / "forced.json"  # the model copies the file back: lookup drafts it
    forced.write_text(json.dumps({"outputs": [{"match": "Here is a file", "text": COPIED}]}))
    state = {
        "cache": fresh_cache_dir(demo_root, root / "cache"),
        "forced": forced,
        "ports": free_ports(2),  # apart from another world running at once
    }
    state["server"] = _start(state["cache"], forced, state["ports"])
    yield state
    state["server"].stop(timeout=60)


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="t", max_retries=0, timeout=120)


def _ask(client, model, question, bypass=False, n=24, history=()):
    messages = [{"role": "system", "content": SYSTEM}, *history,
                {"role": "user", "content": question}]  # fmt: skip
    r = client.chat.completions.with_raw_response.create(
        model=model,
        messages=messages,
        max_tokens=n,
        temperature=0,
        extra_headers={"x-prompt-cache": "bypass"} if bypass else {},
    )
    message = r.parse().choices[0].message
    text = (getattr(message, "reasoning_content", None) or "") + "|" + (message.content or "")
    return text, r.headers.get("x-prompt-cache-source"), int(r.headers["x-prompt-cache-hit-tokens"])


def _stats(server) -> dict:
    return httpx.get(server.url + "/v1/cache/stats", timeout=30).json()


def test_the_front_reports_both_ranks(world):
    health = httpx.get(world["server"].url + "/health", timeout=30).json()
    assert health["status"] == "ok"
    ranks = health["ranks"]
    assert (ranks["size"], ranks["mode"], ranks["backend"], ranks["state"]) == (
        2,
        "tensor",
        "ring",
        "up",
    )


@pytest.mark.parametrize("model", ["demo-hybrid", "demo-llama"])
def test_cached_answers_equal_bypass_batched(world, model):
    client = _client(world["server"])
    with ThreadPoolExecutor(3) as pool:  # three at once: one batch on both ranks
        cold = list(pool.map(lambda q: _ask(client, model, q), QUESTIONS[:3]))
    warm = [_ask(client, model, q) for q in QUESTIONS[:3]]
    with ThreadPoolExecutor(3) as pool:
        bypass = list(pool.map(lambda q: _ask(client, model, q, bypass=True), QUESTIONS[:3]))
    assert [c[0] for c in cold] == [w[0] for w in warm] == [b[0] for b in bypass]
    assert all(w[1] == "ram" and w[2] > 0 for w in warm), warm
    assert all(b[2] == 0 for b in bypass)
    assert _stats(world["server"])["scheduler"]["largest_batch"] >= 2


def test_a_second_turn_resumes_and_equals_bypass(world):
    client = _client(world["server"])
    first, _, _ = _ask(client, "demo-hybrid", QUESTIONS[3])
    history = [{"role": "user", "content": QUESTIONS[3]},
               {"role": "assistant", "content": first.split("|", 1)[1] or "Hi."}]  # fmt: skip
    cached = _ask(client, "demo-hybrid", "And again?", history=history)
    bypass = _ask(client, "demo-hybrid", "And again?", history=history, bypass=True)
    assert cached[0] == bypass[0]
    assert cached[1] == "ram" and cached[2] > 0


def test_speculation_drafts_on_the_split_model(world):
    client = _client(world["server"])
    prompt = f"Here is a file:\n{FILE}\nWrite its first half back."
    before = _stats(world["server"])["scheduler"]["spec_accepted"]
    spec = _ask(client, "demo-llama", prompt, n=200)
    plain = _ask(client, "demo-llama", prompt, n=200, bypass=True)
    assert spec[0] == plain[0] and COPIED.strip()[:40] in spec[0]
    assert _stats(world["server"])["scheduler"]["spec_accepted"] > before
    # And the Anthropic dialect through the front.
    a = anthropic.Anthropic(base_url=world["server"].url, api_key="t", max_retries=0)
    msg = a.messages.create(model="demo-llama", max_tokens=200,
                            messages=[{"role": "user", "content": prompt}])  # fmt: skip
    assert COPIED.strip()[:40] in "".join(b.text for b in msg.content if b.type == "text")


def test_stats_metrics_and_doctor_show_what_each_rank_holds(world, tmp_path):
    server = world["server"]
    _ask(_client(server), "demo-hybrid", QUESTIONS[0])
    ranks = _stats(server)["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert [r["layout"] for r in ranks] == ["tensor 0/2", "tensor 1/2"]
    # The same turns, each rank its slice: as many entries, and bytes of the same order.
    assert ranks[0]["ram_blocks"] == ranks[1]["ram_blocks"] > 0
    assert 0.5 < ranks[1]["ram_bytes"] / ranks[0]["ram_bytes"] < 2
    assert ranks[1]["ssd_root"].endswith("rank1")
    assert ranks[0]["kv_bytes"] == ranks[1]["kv_bytes"] == 0  # nothing running
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    assert 'mlx_prompt_cache_rank_cache_bytes{rank="1",tier="ram"}' in metrics
    env = {**os.environ, "MLX_PROMPT_CACHE_SERVER_PORT": str(server.port)}
    doctor = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "doctor"], env=env, capture_output=True,
        text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert doctor.returncode == 0, doctor.stderr
    assert "split across 2 ranks (tensor over ring): up" in doctor.stdout
    assert "rank 1 (tensor 1/2): RAM" in doctor.stdout


def test_a_clear_empties_every_rank(world):
    server = world["server"]
    assert httpx.delete(server.url + "/v1/cache", timeout=60).status_code == 200
    ranks = _stats(server)["ranks"]
    assert [r["ram_blocks"] for r in ranks] == [0, 0], ranks
    deadline = time.monotonic() + 20  # each rank reads its SSD's counts every second
    while any(r["ssd_entries"] for r in ranks):
        assert time.monotonic() < deadline, ranks
        time.sleep(0.5)
        ranks = _stats(server)["ranks"]
    client = _client(server)
    cold = _ask(client, "demo-hybrid", QUESTIONS[2])
    assert cold[1] == "none" and cold[2] == 0
    assert _ask(client, "demo-hybrid", QUESTIONS[2], bypass=True)[0] == cold[0]


def test_a_restart_of_every_rank_resumes_from_ssd(world):
    client = _client(world["server"])
    before = _ask(client, "demo-hybrid", QUESTIONS[0])
    assert world["server"].stop(timeout=60) == 0
    assert not _rank_pids(world["server"].port), "a rank outlived the front"
    world["server"] = _start(world["cache"], world["forced"], world["ports"])
    after = _ask(_client(world["server"]), "demo-hybrid", QUESTIONS[0])
    assert after[0] == before[0]
    assert after[1] == "ssd" and after[2] > 0
    assert (world["cache"] / "rank1" / "index.sqlite3").exists()  # rank 1's slices


def test_a_killed_rank_fails_the_stream_with_a_503_and_the_ranks_come_back(world):
    server = world["server"]
    client = _client(server)
    warm = _ask(client, "demo-hybrid", QUESTIONS[1])
    # Written: each rank's SSD holds the same entries (what it queued may yet be lost).
    deadline = time.monotonic() + 30
    while len({r["ssd_entries"] for r in _stats(server)["ranks"]}) != 1:
        assert time.monotonic() < deadline
        time.sleep(0.5)
    rank1 = _rank_pids(server.port).get(1)
    assert rank1 is not None
    stream = client.chat.completions.create(
        model="demo-hybrid",
        messages=[{"role": "user", "content": "Write a long story."}],
        max_tokens=2000,
        temperature=0,
        stream=True,
    )
    killed = None
    with pytest.raises(openai.APIError) as caught:
        for i, _ in enumerate(stream):
            if i == 3:
                os.kill(rank1, signal.SIGKILL)
                killed = time.monotonic()
    assert killed is not None and time.monotonic() - killed < DEADLINE_S
    assert "rank 1" in str(caught.value)
    # Until the ranks are back, a request gets a 503 naming what happened; then it is
    # served again, from what both ranks wrote to SSD before rank 1 died.
    deadline = time.monotonic() + 120
    while True:
        health = httpx.get(server.url + "/health", timeout=30)
        if health.status_code == 200 and health.json()["ranks"]["restarts"] >= 1:
            break
        assert time.monotonic() < deadline, health.text
        if health.status_code == 503:
            assert health.json()["status"] in ("down", "starting")
        time.sleep(0.5)
    assert "rank 1" in health.json()["ranks"]["last_failure"]
    again = _ask(client, "demo-hybrid", QUESTIONS[1])
    assert again[0] == warm[0]
    assert again[1] == "ssd" and again[2] > 0


def _rank_pids(port: int) -> dict[int, int]:
    """The rank processes of the server on `port`, by rank."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            cmd = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        rank = next((e[9:] for e in env if e.startswith(b"MLX_RANK=")), None)
        if rank is not None and b"proxy.cli" in cmd and str(port).encode() in cmd:
            found[int(rank)] = int(entry.name)
    return found


def test_a_rank_that_stops_answering_fails_the_request_at_the_deadline(world):
    """A hung rank (SIGSTOP) breaks no link: rank 0 gives up after the deadline, ends the
    request with a 503 naming it, and the ranks are started again."""
    server = world["server"]
    client = _client(server)
    restarts = httpx.get(server.url + "/health", timeout=30).json()["ranks"]["restarts"]
    _ask(client, "demo-llama", QUESTIONS[2])  # loaded on both ranks
    rank1 = _rank_pids(server.port)[1]
    os.kill(rank1, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as caught:
            _ask(client, "demo-llama", QUESTIONS[3])
        waited = time.monotonic() - started
    finally:
        # The front kills the stopped rank with the rest of its world; just in case:
        with contextlib.suppress(ProcessLookupError):
            os.kill(rank1, signal.SIGCONT)
    assert caught.value.status_code == 503
    assert "rank 1" in str(caught.value) and "stopped answering" in str(caught.value)
    assert DEADLINE_S - 1 <= waited < DEADLINE_S + 10
    deadline = time.monotonic() + 120
    while True:
        health = httpx.get(server.url + "/health", timeout=30)
        if health.status_code == 200 and health.json()["ranks"]["restarts"] > restarts:
            break
        assert time.monotonic() < deadline, health.text
        time.sleep(0.5)
    assert "rank 0 gave up" in health.json()["ranks"]["last_failure"]
    assert _ask(client, "demo-llama", QUESTIONS[3])[0]


def test_a_model_that_cannot_be_split_is_refused_at_start(demo_root, tmp_path):
    cache = fresh_cache_dir(demo_root, tmp_path / "cache")
    env = {**os.environ, "MLX_PROMPT_CACHE_DISTRIBUTED_PORT": str(free_ports(2))}
    argv = ["serve", "--port", str(free_ports(1)), "--cache-dir", str(cache), "--upstream",
            "http://127.0.0.1:9", "--model", "demo-llama", "--ranks", "2", "--split", "pipeline"]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "proxy.cli", *argv], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=180)  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert ("the ranks refused to start: demo-llama: llama.Model cannot be split in pipeline "
            'mode across 2 ranks: mlx-lm gives it no model.pipeline(group); try mode = "tensor"'
            ) in done.stderr  # fmt: skip
