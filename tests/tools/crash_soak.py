"""Crash soak: kill -9 the proxy under concurrent traffic, restart it, check what it kept.

Shared by tests/ops/test_crash_soak.py (5 seeded rounds in CI) and `scripts/soak --crash N`:

    python -m tests.tools.crash_soak --rounds N [--seed S] [--out DIR]

Each round, client threads send greedy requests (OpenAI and Anthropic SDKs, streamed and
not) for conversations that share system prompts and grow turn by turn, under a RAM budget
small enough that entries spill to SSD and are promoted back. After a seeded delay the
server is killed with SIGKILL, preferably while its SSD writer has work queued. Then:

- offline, nothing running: no file under an entry name fails validation (none is torn);
  the index and the files may disagree only as a kill leaves them (rows whose file was not
  written yet or was being evicted, files whose row was not added yet, dead temp files);
- a restart's reconcile repairs exactly that, and quarantines nothing;
- every answer, before the kill and after the restart, equals the `x-prompt-cache: bypass`
  answer to the same prompt (references computed alone, one request at a time);
- once the restarted server's writer is idle, the index and the files agree exactly and
  every file passes its checksum.

Progress goes to stderr, one line per round; the report (JSON and markdown) to --out.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from tests.tools.crash_traffic import (
    CLIENTS,
    DIALECTS,
    MAX_TOKENS,
    MODELS,
    Client,
    Pool,
    Reply,
    Traffic,
    bypass_answer,
)
from tests.tools.disk_scan import DiskScan, scan

DEFAULT_SEED = 20261111
PROBES = 6  # prompts of earlier rounds replayed after each restart
RAM_BUDGETS = ("300KB", "1MB", "4MB")
SSD_MAX_SIZE = "24MB"  # small enough that LRU eviction runs, and can be killed, too
KILL_DELAY_S = (0.5, 4.0)
AIM_S = 1.0  # after the delay, wait this long at most for the writer to have work

_REPORT = re.compile(r"SSD cache: reconciled .*?: ReconcileReport\((.*?)\)")
_TRACEBACK = re.compile(r"^Traceback \(most recent call last\):\n(?:[ \t].*\n)*(.*)$", re.M)


# -- the server --------------------------------------------------------------------------------


def write_config(path: Path, ram_budget: str, write_through: bool) -> None:
    path.write_text(
        "[upstream]\n"
        'url = "http://127.0.0.1:9"\n'
        "[models]\n"
        f"serve = {json.dumps(list(MODELS))}\n"
        "[cache.ram]\n"
        f'budget = "{ram_budget}"\n'
        'min_available = "off"\n'
        "[cache.ssd]\n"
        f'max_size = "{SSD_MAX_SIZE}"\n'
        f"write_through = {str(write_through).lower()}\n"
    )


def stats(url: str) -> dict:
    r = httpx.get(url + "/v1/cache/stats", timeout=10)
    r.raise_for_status()
    return r.json()


def reconcile_report(server, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while not (found := _REPORT.findall(server.log())):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no reconcile report in the log:\n{server.log()[-3000:]}")
        time.sleep(0.05)
    assert len(found) == 1, found
    return {k: float(v) for k, v in (kv.split("=") for kv in found[0].split(", "))}


def drained(url: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while (ssd := stats(url)["ssd"])["queued"]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"SSD queue never drained: {ssd}")
        time.sleep(0.05)
    return ssd


# -- rounds ------------------------------------------------------------------------------------


@dataclass(slots=True)
class Round:
    """One server life killed under traffic, and what the next start found."""

    round: int
    ram_budget: str
    write_through: bool
    delay_s: float
    # Traffic up to the kill.
    sent: int = 0
    answered: int = 0
    answered_from: dict[str, int] = field(default_factory=dict)
    errors: int = 0  # failures before the kill
    cut: int = 0  # requests in flight at the kill
    # The server's SSD counters in the last sample before the kill.
    queued_at_kill: int = 0
    ssd_writes: int = 0
    ssd_spills: int = 0
    ssd_hits: int = 0
    ssd_evictions: int = 0
    # Offline, right after the kill.
    temps_at_kill: int = 0  # the kill landed inside a file write
    torn: int = 0
    rows_without_files: int = 0
    files_without_rows: int = 0
    entries_on_disk: int = 0
    bytes_on_disk: int = 0
    # The restart.
    restart_s: float = 0.0
    reconcile: dict[str, float] = field(default_factory=dict)
    reconcile_as_found: bool = True  # it repaired exactly what the offline scan found
    quarantined: int = 0  # entries this server life found corrupt (reconcile, reads)
    inconsistent_after: int = 0  # index vs files once the restarted writer is idle
    compared: int = 0  # answers compared with bypass (traffic, cut streams, probes)
    mismatches: int = 0
    probes: int = 0
    probe_ssd_hits: int = 0
    tracebacks: int = 0  # in the killed server's log


@dataclass(slots=True)
class Soak:
    rounds: int
    seed: int
    out: Path
    demo_root: Path | None = None
    pool: Pool = field(init=False)
    cache_dir: Path = field(init=False)
    refs: dict[str, str] = field(default_factory=dict)
    seen: set[str] = field(default_factory=set)  # prompts answered before the last kill
    results: list[Round] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    quarantine_files: int = 0  # in <root>/quarantine at the last scan

    def __post_init__(self) -> None:
        self.pool = Pool(self.seed)
        self.cache_dir = self.out / "cache"
        (self.out / "logs").mkdir(parents=True, exist_ok=True)

    def run(self) -> None:
        from tests.conftest import fresh_cache_dir

        if self.demo_root is not None:
            fresh_cache_dir(self.demo_root, self.cache_dir)
        else:
            from engine_bridge.models.demo import ensure_demo_model

            for name in MODELS:
                ensure_demo_model(name, self.cache_dir)
        rng = random.Random(self.seed)
        prev: tuple[Round, Traffic, DiskScan, object] | None = None
        for n in range(1, self.rounds + 2):
            budget, write_through = rng.choice(RAM_BUDGETS), n % 2 == 1
            started = time.monotonic()
            server = self._start(n, budget, write_through)
            if prev is not None:
                done, traffic, at_kill, old = prev
                done.restart_s = round(time.monotonic() - started, 2)
                done.tracebacks = self._tracebacks(done.round, old)
                self._check_restart(done, traffic, at_kill, server, rng)
                self.results.append(done)
                progress(done)
            if n > self.rounds:
                last = stats(server.url)["ssd"]
                if self.results:
                    self.results[-1].quarantined += last["quarantined"] + last["read_errors"]
                server.stop()
                self._tracebacks(n, server)
                self._scan_after_stop()
                return
            current = Round(n, budget, write_through, round(rng.uniform(*KILL_DELAY_S), 2))
            traffic = Traffic(
                server.url, self.pool.fixed, self.pool.new_for_round(n), random.Random(rng.random())
            )
            self._traffic_then_kill(current, traffic, server)
            at_kill = scan(self.cache_dir)
            current.temps_at_kill, current.torn = at_kill.temps, at_kill.torn
            current.rows_without_files = at_kill.rows_without_files
            current.files_without_rows = at_kill.files_without_rows
            current.entries_on_disk, current.bytes_on_disk = at_kill.files, at_kill.bytes
            self._fail(current, at_kill.problems)
            prev = (current, traffic, at_kill, server)

    def _start(self, n: int, budget: str, write_through: bool):
        from tests.conftest import start_server

        config = self.out / "logs" / f"config-{n}.toml"
        write_config(config, budget, write_through)
        log = self.out / "logs" / f"server-{n}.log"
        return start_server(self.cache_dir, "--config", str(config), log_path=log)

    def _traffic_then_kill(self, r: Round, traffic: Traffic, server) -> None:
        for model in MODELS:  # load them first: the window before the kill is for requests
            body = {
                "model": model,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 1,
            }
            bypass = {"x-prompt-cache": "bypass"}
            httpx.post(server.url + "/v1/chat/completions", json=body, headers=bypass, timeout=120)
        traffic.start()
        last = {}
        end = time.monotonic() + r.delay_s
        while time.monotonic() < end:
            last = stats(server.url)["ssd"]
            time.sleep(0.1)
        end = time.monotonic() + AIM_S  # then kill as soon as the writer has work
        while time.monotonic() < end:
            last = stats(server.url)["ssd"]
            if last["queued"]:
                break
            time.sleep(0.02)
        traffic.killing.set()
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait()
        traffic.join()
        r.queued_at_kill = last.get("queued", 0)
        r.ssd_writes, r.ssd_spills = last.get("writes", 0), last.get("spills", 0)
        r.ssd_hits, r.ssd_evictions = last.get("hits", 0), last.get("evictions", 0)
        r.quarantined = last.get("quarantined", 0) + last.get("read_errors", 0)
        r.sent = len(traffic.replies)
        answered = [x for x in traffic.replies if x.error is None and not x.cut]
        r.answered = len(answered)
        r.answered_from = dict(Counter(x.source for x in answered))
        r.cut = sum(x.cut for x in traffic.replies)
        errors = [x for x in traffic.replies if x.error]
        r.errors = len(errors)
        self._fail(r, [f"{x.pid} ({x.dialect}) failed before the kill: {x.error}" for x in errors])

    def _check_restart(
        self, r: Round, traffic: Traffic, at_kill: DiskScan, server, rng: random.Random
    ) -> None:
        rep = reconcile_report(server)
        r.reconcile = {
            k: rep[k] for k in ("rows_dropped", "adopted", "temps_removed", "quarantined")
        }
        found = (at_kill.rows_without_files, at_kill.files_without_rows, at_kill.temps, 0)
        r.reconcile_as_found = tuple(int(v) for v in r.reconcile.values()) == found
        if not r.reconcile_as_found:
            self._fail(r, [f"reconcile {r.reconcile} after a kill that left {at_kill}"])
        # The killed server's answers, streams cut by the kill included (as prefixes).
        for x in traffic.replies:
            if x.error is None and (not x.cut or x.text):
                self._compare(r, server.url, x, prefix=x.cut)
        probes = sorted(self.seen)
        self.seen.update(x.pid for x in traffic.replies if x.error is None and not x.cut)
        client = Client(server.url)
        try:
            for i, pid in enumerate(rng.sample(probes, min(PROBES, len(probes)))):
                reply = Reply(pid, DIALECTS[i % len(DIALECTS)])
                client.ask(self.pool.by_pid[pid], reply.dialect, reply)
                r.probes += 1
                r.probe_ssd_hits += reply.source == "ssd"
                self._compare(r, server.url, reply, prefix=False)
        finally:
            client.close()
        ssd = drained(server.url)
        after = scan(self.cache_dir)
        r.inconsistent_after = after.inconsistent
        self.quarantine_files = after.quarantined
        if after.inconsistent or after.quarantined or ssd["quarantined"] or ssd["read_errors"]:
            self._fail(r, [f"after the restart: {after}, SSD stats {ssd}"])

    def _compare(self, r: Round, url: str, x: Reply, *, prefix: bool) -> None:
        if x.pid not in self.refs:
            self.refs[x.pid] = bypass_answer(url, self.pool.by_pid[x.pid])
        ref = self.refs[x.pid]
        r.compared += 1
        if ref.startswith(x.text) if prefix else ref == x.text:
            return
        r.mismatches += 1
        what = "cut stream" if prefix else "answer"
        self._fail(r, [f"{what} {x.pid} ({x.dialect}, from {x.source}): {x.text!r} != {ref!r}"])

    def _tracebacks(self, n: int, server) -> int:
        found = _TRACEBACK.findall(server.log())
        self.failures += [f"round {n}: server log: {line}" for line in found]
        return len(found)

    def _scan_after_stop(self) -> None:
        final = scan(self.cache_dir)
        self.quarantine_files = final.quarantined
        if final.inconsistent or final.quarantined:
            self.failures.append(f"after the final clean stop: {final}")

    def _fail(self, r: Round, problems: list[str]) -> None:
        self.failures += [f"round {r.round}: {p}" for p in problems]

    # -- figures ---------------------------------------------------------------------------

    def totals(self) -> dict[str, int | float]:
        keys = (
            "sent answered errors cut torn temps_at_kill rows_without_files files_without_rows "
            "quarantined inconsistent_after compared mismatches probes probe_ssd_hits "
            "tracebacks ssd_writes ssd_spills ssd_hits ssd_evictions"
        ).split()
        t: dict[str, int | float] = {k: sum(getattr(r, k) for r in self.results) for k in keys}
        t["rounds"] = len(self.results)
        t["kills_with_writes_queued"] = sum(r.queued_at_kill > 0 for r in self.results)
        t["kills_inside_a_file_write"] = sum(r.temps_at_kill > 0 for r in self.results)
        t["kills_with_requests_in_flight"] = sum(r.cut > 0 for r in self.results)
        t["reconcile_not_as_found"] = sum(not r.reconcile_as_found for r in self.results)
        for k in ("rows_dropped", "adopted", "temps_removed"):
            t[f"reconcile_{k}"] = int(sum(r.reconcile.get(k, 0) for r in self.results))
        t["answered_from_ssd"] = sum(r.answered_from.get("ssd", 0) for r in self.results)
        t["entries_on_disk_last"] = self.results[-1].entries_on_disk if self.results else 0
        t["restart_s_max"] = max((r.restart_s for r in self.results), default=0.0)
        t["quarantine_folder_files"] = self.quarantine_files
        return t

    def targets(self) -> dict[str, bool]:
        t = self.totals()
        return {
            "every round ran": t["rounds"] == self.rounds,
            "0 torn files after a kill": t["torn"] == 0,
            "0 corrupt entries found, so none to serve": t["quarantined"] == 0
            and t["quarantine_folder_files"] == 0,
            "reconcile repaired exactly what the kill left": t["reconcile_not_as_found"] == 0,
            "index consistent with the files after restart": t["inconsistent_after"] == 0,
            "answers equal bypass": t["mismatches"] == 0 and t["compared"] > 0,
            "no request failed before a kill": t["errors"] == 0,
            "no traceback in a server log": t["tracebacks"] == 0,
            "SSD hits after restarts": t["probe_ssd_hits"] > 0,
        }


def progress(r: Round) -> None:
    src = ",".join(f"{k or '?'}:{v}" for k, v in sorted(r.answered_from.items()))
    print(
        f"round {r.round:3}: sent {r.sent:3} ({src}; cut {r.cut}), queued@kill "
        f"{r.queued_at_kill}, temps {r.temps_at_kill}, torn {r.torn}, reconcile "
        f"-{int(r.reconcile['rows_dropped'])}/+{int(r.reconcile['adopted'])}"
        f"/t{int(r.reconcile['temps_removed'])}, entries {r.entries_on_disk}, inconsistent "
        f"{r.inconsistent_after}, quarantined {r.quarantined}, mismatches "
        f"{r.mismatches}/{r.compared}, probes from ssd {r.probe_ssd_hits}/{r.probes}, "
        f"restart {r.restart_s}s",
        file=sys.stderr,
        flush=True,
    )


# -- report ------------------------------------------------------------------------------------

_COLUMNS = (
    ("round", "round"), ("budget", "ram_budget"), ("wt", "write_through"),
    ("delay s", "delay_s"), ("sent", "sent"), ("cut", "cut"), ("queued@kill", "queued_at_kill"),
    ("temps", "temps_at_kill"), ("torn", "torn"), ("-rows", "rows_without_files"),
    ("+files", "files_without_rows"), ("entries", "entries_on_disk"),
    ("quarantined", "quarantined"), ("inconsistent", "inconsistent_after"),
    ("mismatches", "mismatches"), ("compared", "compared"), ("ssd probes", "probe_ssd_hits"),
)  # fmt: skip


def markdown(soak: Soak, seconds: float) -> str:
    t = soak.totals()
    lines = [
        f"# Crash soak: {t['rounds']} kill -9 rounds (seed {soak.seed})",
        "",
        f"{CLIENTS} clients on {', '.join(MODELS)}; OpenAI and Anthropic SDKs, streamed and "
        f"not, greedy, max_tokens {MAX_TOKENS}; RAM budget one of {', '.join(RAM_BUDGETS)}; "
        f"SSD max_size {SSD_MAX_SIZE}; write-through on odd rounds, spill-only on even ones. "
        f"{seconds:.0f} s in all.",
        "",
        "| target | met |",
        "|---|---|",
        *[f"| {name} | {'yes' if ok else '**NO**'} |" for name, ok in soak.targets().items()],
        "",
        "| figure | total |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in t.items()],
        "",
        "| " + " | ".join(h for h, _ in _COLUMNS) + " |",
        "|" + "---|" * len(_COLUMNS),
        *["| " + " | ".join(str(getattr(r, k)) for _, k in _COLUMNS) + " |" for r in soak.results],
    ]
    if soak.failures:
        lines += ["", "## Failures", "", *[f"- {f}" for f in soak.failures[:200]]]
    return "\n".join(lines) + "\n"


def write_report(soak: Soak, seconds: float) -> None:
    data = {
        "seed": soak.seed,
        "rounds_asked": soak.rounds,
        "seconds": round(seconds, 1),
        "targets": soak.targets(),
        "totals": soak.totals(),
        "rounds": [asdict(r) for r in soak.results],
        "failures": soak.failures,
    }
    (soak.out / "crash-soak.json").write_text(json.dumps(data, indent=1) + "\n")
    (soak.out / "crash-soak.md").write_text(markdown(soak, seconds))


def run(rounds: int, seed: int, out: Path, demo_root: Path | None = None) -> Soak:
    """Run the soak; a server that fails to start is a failure, recorded like the others."""
    soak = Soak(rounds, seed, out, demo_root)
    start = time.monotonic()
    try:
        soak.run()
    except Exception as e:  # noqa: BLE001 - reported with the figures so far
        soak.failures.append(f"soak stopped: {type(e).__name__}: {e}"[:4000])
    write_report(soak, time.monotonic() - start)
    return soak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="crash_soak", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument(
        "--out", type=Path, help="report and cache folder (default: a new temp dir)"
    )
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="mlx-crash-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    soak = run(args.rounds, args.seed, out)
    print((out / "crash-soak.md").read_text())
    print(f"report: {out / 'crash-soak.md'} and crash-soak.json")
    return 0 if all(soak.targets().values()) and not soak.failures else 1


if __name__ == "__main__":
    sys.exit(main())
