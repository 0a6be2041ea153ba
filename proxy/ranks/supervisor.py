"""The ranks of a split model, started through mlx.launch and started again when lost.

`serve --ranks N` (or a hostfile) runs this in a front process that holds the port
clients use (front.py). It starts every rank with MLX's own launcher: rank 0 serves the
whole proxy on a loopback port, the others follow its steps. When a rank dies, the link
breaks and mlx.launch ends the rest; when one hangs, rank 0 gives up after the deadline
and ends itself. Either way this process sees the launcher exit, says which rank ended
and how, and starts the world again (after a pause that doubles while it keeps failing),
so the front keeps its port and rank 0's SSD cache makes the new world's first turns warm.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

log = logging.getLogger("proxy.ranks.supervisor")

# What rank 0 exits with when it gave up on the other ranks (proxy/cli.py).
RANK_LOST_EXIT = 75
# mlx.launch's report of each rank's end, on its stderr.
_ENDED = re.compile(r"Node with rank (\d+) (?:exited with code (-?\d+)|was killed)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# What a rank exits with when it refuses to start (proxy/cli.py: a config error, a model
# that cannot be split), and the line it says why on.
CONFIG_EXIT = 2
_REFUSAL = "mlx-prompt-cache: "
RESTART_S, RESTART_MAX_S = 1.0, 30.0
STOP_S = 30.0  # a clean stop: rank 0 drains its requests and SSD writes


@dataclass(slots=True)
class WorldState:
    """What /health shows of the ranks."""

    size: int
    mode: str
    backend: str
    state: str = "starting"  # starting, up, down (being started again), stopped
    attempt: int = 0  # worlds started so far
    since: float = field(default_factory=time.time)
    # Why the last world ended: "rank 1 exited with code -9", ...
    last_failure: str | None = None
    rank0_url: str | None = None

    def to_json(self) -> dict:
        return {
            "size": self.size,
            "mode": self.mode,
            "backend": self.backend,
            "state": self.state,
            "attempt": self.attempt,
            "restarts": max(0, self.attempt - 1),
            "since": round(self.since, 3),
            "last_failure": self.last_failure,
        }


class Supervisor:
    """Starts the world, watches it, starts it again; `stop` ends it cleanly."""

    def __init__(
        self,
        state: WorldState,
        command: Callable[[int], list[str]],
        ready_timeout_s: float = 600.0,
    ):
        self.state = state
        self._command = command  # rank 0's HTTP port -> the mlx.launch command line
        self._ready_timeout_s = ready_timeout_s
        self._proc: asyncio.subprocess.Process | None = None
        self._stopping = False
        self._ended: list[str] = []  # this world's ranks that ended, as mlx.launch said
        self._codes: list[int | None] = []  # and their exit codes
        self._refusal: str | None = None  # what a rank said when it refused to start
        # Set when the ranks refuse to start (a model that cannot be split, a bad config):
        # starting them again would only fail again.
        self.fatal: str | None = None
        self.changed = asyncio.Event()  # set on each change of state
        # Called when a rank of the running world ends: the front's relays in flight.
        self.on_lost: set[Callable[[], None]] = set()

    def unavailable(self) -> str:
        """Why requests cannot be served now, for a 503."""
        s = self.state
        if s.state == "starting" and s.attempt <= 1:
            return f"the {s.size} ranks of the split model are starting; retry shortly"
        cause = f": {s.last_failure}" if s.last_failure else ""
        return (f"the split model's ranks are being started again (attempt {s.attempt})"
                f"{cause}; retry shortly")  # fmt: skip

    async def lost(self, wait_s: float = 2.0) -> str:
        """Why a relayed request broke off: the world's end as mlx.launch reports it,
        waited for a moment (the link breaks before the launcher notices)."""
        deadline = time.monotonic() + wait_s
        while not self._ended and time.monotonic() < deadline:
            if self._proc is not None and self._proc.returncode is not None:
                break
            await asyncio.sleep(0.05)
        if self._ended:
            return f"{self._ended[0]}; the ranks are being started again"
        return "rank 0 of the split model stopped answering; the ranks are being started again"

    async def run(self) -> None:
        """Start worlds until `stop`."""
        pause = RESTART_S
        while not self._stopping:
            started = time.monotonic()
            await self._one_world()
            if self._stopping:
                break
            if self.state.state == "starting" and CONFIG_EXIT in self._codes:
                self.fatal = self._refusal or self.state.last_failure or "the ranks refused"
                log.error("the ranks refused to start: %s", self.fatal)
                break
            self._set("down")
            # A world that served a while was not failing to start: begin the pauses again.
            pause = RESTART_S if time.monotonic() - started > 60 else min(pause * 2, RESTART_MAX_S)
            log.warning("the ranks ended (%s); starting them again in %.0fs",
                        self.state.last_failure, pause)  # fmt: skip
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopped(), pause)
        self._set("stopped")

    async def stop(self) -> None:
        """Rank 0 drains and tells the others to end (SIGTERM to the world's processes);
        anything still running after STOP_S is killed."""
        self._stopping = True
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), STOP_S)
        except TimeoutError:
            log.warning("the ranks did not end in %.0fs; killing them", STOP_S)
            _signal_group(proc.pid, signal.SIGKILL)
            await proc.wait()

    # -- one world ---------------------------------------------------------------------

    async def _one_world(self) -> None:
        port = _free_port()
        self.state.attempt += 1
        self.state.rank0_url = f"http://127.0.0.1:{port}"
        self._ended, self._codes, self._refusal = [], [], None
        self._set("starting")
        argv = self._command(port)
        log.info("starting %d ranks (attempt %d): %s", self.state.size, self.state.attempt,
                 " ".join(argv))  # fmt: skip
        # Its own process group, so that a stop reaches every local rank; a pipe for stdin
        # that stays open (the launcher polls stdin, and /dev/null would keep it spinning).
        self._proc = proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
        output = asyncio.create_task(self._read_output(proc))
        ready = asyncio.create_task(self._wait_ready(port))
        exited = asyncio.create_task(proc.wait())
        done, _ = await asyncio.wait({ready, exited}, return_when=asyncio.FIRST_COMPLETED)
        if ready in done and ready.result():
            self._set("up")
            log.info("the %d ranks are serving (rank 0 on port %d)", self.state.size, port)
        elif ready in done:  # never answered: end this world, and start another
            self._ended.append(f"rank 0 did not answer within {self._ready_timeout_s:.0f}s")
            _signal_group(proc.pid, signal.SIGKILL)
        await exited
        ready.cancel()
        await output
        self.state.last_failure = self._failure(proc.returncode)

    async def _wait_ready(self, port: int) -> bool:
        url = f"http://127.0.0.1:{port}/health"
        deadline = time.monotonic() + self._ready_timeout_s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
            while time.monotonic() < deadline:
                try:
                    async with http.get(url) as r:
                        if r.status == 200:
                            return True
                except (aiohttp.ClientError, TimeoutError):
                    pass
                await asyncio.sleep(0.25)
        log.error("rank 0 did not answer on port %d within %.0fs", port, self._ready_timeout_s)
        return False

    async def _read_output(self, proc: asyncio.subprocess.Process) -> None:
        """Pass the ranks' output on to this process's log, noting how each rank ended."""
        assert proc.stdout is not None
        async for raw in proc.stdout:
            line = _ANSI.sub("", raw.decode(errors="replace")).rstrip()
            if line.startswith(_REFUSAL):
                self._refusal = line[len(_REFUSAL) :]
            if m := _ENDED.search(line):
                self._ended.append(_how(int(m.group(1)), m.group(2)))
                self._codes.append(int(m.group(2)) if m.group(2) is not None else None)
                if len(self._ended) == 1 and not self._stopping:
                    log.warning("%s: ending the requests in flight", self._ended[0])
                    for cut in list(self.on_lost):
                        cut()
                    # The launcher ends the other ranks with SIGTERM and waits; a rank
                    # that hangs (or is stopped) would keep it, and this world, forever.
                    asyncio.get_running_loop().call_later(
                        STOP_S, _signal_group, proc.pid, signal.SIGKILL
                    )
            print(line, flush=True)

    def _failure(self, code: int | None) -> str | None:
        if self._stopping:
            return self.state.last_failure
        if self._ended:
            return self._ended[0]
        return f"mlx.launch exited with code {code}"

    async def _stopped(self) -> None:
        while not self._stopping:
            await asyncio.sleep(0.1)

    def _set(self, state: str) -> None:
        self.state.state = state
        self.state.since = time.time()
        self.changed.set()


def _how(rank: int, code: str | None) -> str:
    if code is None:
        return f"rank {rank} was killed"
    if int(code) == RANK_LOST_EXIT and rank == 0:
        return "rank 0 gave up on the other ranks (a step went unanswered past the deadline)"
    if int(code) < 0:
        try:
            return f"rank {rank} ended on {signal.Signals(-int(code)).name}"
        except ValueError:
            pass
    return f"rank {rank} exited with code {code}"


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(os.getpgid(pid), sig)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
