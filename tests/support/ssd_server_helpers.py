"""Driving a real server's SSD tier from tests: prompts and conversations, the stats and
the offline CLI, and what is on disk (entry files, index rows, quarantine, reconcile reports).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from engine_bridge.cache.ssd.format import verify_file
from engine_bridge.cache.ssd.index import Index
from tests.conftest import REPO, Server
from tests.support.prose import prose

LLAMA, HYBRID, SWA = "demo-llama", "demo-hybrid", "demo-swa"
MAX_TOKENS = 16
FAULTS = Path(__file__).resolve().parent / "ssd_faults"
NO_UPSTREAM = ("--upstream", "http://127.0.0.1:9")

QUESTIONS = (
    "Which region does the billing report need first?",
    "How long do we keep closed payroll records, and why?",
    "What happens when the shipping queue is too long?",
    "Summarise the rules for refunds in one line.",
    "Who reads the audit logs, and in which time zone?",
)


def system_prompt(salt: str = "", sentences: int = 20) -> str:
    """Plain, varied prose of about 20 tokens a sentence (20 sentences ≈ 400 tokens)."""
    return f"{salt} " + prose(sentences) if salt else prose(sentences)


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
        messages.append({"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]})
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
