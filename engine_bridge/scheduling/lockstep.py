"""The scheduler's steps, the same on every rank of a split model (docs/distributed.md).

A split layer's `all_sum` waits for every rank, so every rank must step the same runners
over the same sequences. Rank 0 decides what enters each step: at its top, it shares the
step's operations (a model loaded, a runner added or removed, a request submitted, a
request stopped), then every rank applies them in that order and steps. Nothing else
changes what a step computes: the queue, admission and decoding follow from these.

A request's stop travels this way too: a client leaves on rank 0's event loop at any
moment, but the runner reads `Job.halt`, which is set only here, on every rank at once.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any
from weakref import WeakValueDictionary

from ..distributed.world import RankLost, link_failed, peers
from .jobs import Failed, Job, Pending

if TYPE_CHECKING:
    from ..distributed.world import World

log = logging.getLogger(__name__)

Op = tuple[Any, ...]
# While the server shuts down, the longest a step may wait on the other ranks: a lost rank
# must not hold rank 0's shutdown (and the SSD writes it drains) for the whole deadline.
STOP_DEADLINE_S = 5.0


def _discard(event: object) -> None:
    """A follower's events: rank 0 answers the client."""


class Lockstep:
    """Rank 0's side builds each step's operations; every side applies them."""

    def __init__(self, world: World, deadline_s: float = 60.0):
        self.world = world
        # Rank 0 gives up on a step the other ranks leave unanswered this long (a rank
        # that hangs rather than dies: a dead one breaks the link at once).
        self.deadline_s = deadline_s
        # When this rank entered the step it is in (None between steps, and while a model
        # loads, which takes as long as its weights take to read).
        self.busy_since: float | None = None
        # Run on every rank for a shared call ("load" a model): the lifecycle sets them.
        self.handlers: dict[str, Callable[..., Any]] = {}
        # Runners a follower made for a loaded model, until rank 0 adds its own.
        self.made: dict[str, Any] = {}
        self._next_key = 0
        # Live jobs by key, to stop them (followers) or to see a client left (rank 0).
        self._jobs: WeakValueDictionary[int, Job] = WeakValueDictionary()

    # -- rank 0 -----------------------------------------------------------------------

    def number(self, job: Job) -> None:
        """Give a submitted job its key, and a halt only a shared step sets."""
        self._next_key += 1
        job.key = self._next_key
        job.halt = threading.Event()
        self._jobs[job.key] = job
        sampling = job.request.sampling
        if sampling.temperature > 0 and sampling.seed is None:
            # Every rank must draw the same tokens (each feeds its own back in): a request
            # without a seed gets one here, shared with the request, so each rank draws
            # from the same key stream rather than from its own global generator.
            seed = secrets.randbits(62)
            job.request = replace(job.request, sampling=replace(sampling, seed=seed))

    def stops(self) -> list[Op]:
        """A `halt` for every job whose client left since the last step."""
        return [
            ("halt", k)
            for k, j in list(self._jobs.items())
            if j.cancel.is_set() and not j.halt.is_set()
        ]

    def step(self, adds, removes, shared, inbox, done: bool) -> tuple[list[Op], list[dict]]:
        """This step's operations, in the order every rank applies them, and rank 0's
        own object for each (the runner it adds, the future of a call, the request)."""
        ops: list[Op] = []
        local: list[dict] = []
        for r in adds:
            ops.append(("add", r.model_id))
            local.append({"runner": r})
        for r in removes:
            ops.append(("remove", r.model_id))
            local.append({})
        for name, args, future in shared:
            ops.append(("call", name, args))
            local.append({"future": future})
        for runner, pending in inbox:
            job = pending.job
            ops.append(("submit", runner.model_id, job.key, job.request, job.prompt,
                        job.max_tokens, job.rule))  # fmt: skip
            local.append({"pending": pending})
        stops = self.stops()
        ops += stops
        local += [{} for _ in stops]
        if done:
            ops.append(("stop",))
            local.append({})
        return ops, local

    def share(self, ops: list[Op] | None) -> list[Op]:
        return self.world.share(ops) or []

    # -- a world that fell apart -----------------------------------------------------

    def lost(self, error: Exception) -> Exception:
        """`error`, or the `RankLost` it means when it is a broken link."""
        if not link_failed(error):
            return error
        return RankLost(f"{self._who()} of the split model was lost ({error}); the ranks "
                        "are being started again")  # fmt: skip

    def fell_apart(self, error: Exception) -> RankLost:
        """A failure outside any one request's handling: the ranks may no longer run the
        same steps, so none can go on."""
        lost = self.lost(error)
        if isinstance(lost, RankLost):
            return lost
        log.error("the ranks fell out of step", exc_info=error)
        return RankLost(f"the ranks fell out of step ({type(error).__name__}: {error}); the "
                        "ranks are being started again")  # fmt: skip

    def overdue(self, stopping: bool = False) -> RankLost | None:
        """A `RankLost` when this step has waited past the deadline (rank 0's watchdog);
        `stopping` (the server shuts down) gives a step at most STOP_DEADLINE_S."""
        since = self.busy_since
        deadline = min(self.deadline_s, STOP_DEADLINE_S) if stopping else self.deadline_s
        if since is None or time.monotonic() - since < deadline:
            return None
        return RankLost(f"{self._who()} of the split model stopped answering: a step waited "
                        f"{self.deadline_s:.0f}s; the ranks are being started again")  # fmt: skip

    def _who(self) -> str:
        return peers(self.world) if self.world.leader else "rank 0"

    # -- every rank -------------------------------------------------------------------

    def apply(self, op: Op, runners: list[Any], local: dict[str, Any]) -> None:
        """Apply one shared operation on this rank. `local`: rank 0's own objects for it
        (the runner it adds or removes, the pending request it queues); followers make
        theirs from the operation."""
        kind = op[0]
        if kind == "add":
            runner = local.get("runner") or self.made.pop(op[1])
            runners.append(runner)
        elif kind == "remove":
            for r in [r for r in runners if r.model_id == op[1]]:
                runners.remove(r)
                r.cancel_all()
        elif kind == "call":
            result = self.handlers[op[1]](*op[2])
            local["result"] = result
        elif kind == "submit":
            _, model_id, key, request, prompt, max_tokens, rule = op
            pending = local.get("pending")
            if pending is None:
                job = Job(request, prompt, max_tokens, rule=rule, halt=threading.Event(), key=key)
                self._jobs[key] = job
                pending = Pending(job, _discard)
            runner = next(r for r in runners if r.model_id == model_id)
            runner.enqueue(pending)
        elif kind == "halt":
            job = self._jobs.get(op[1])
            if job is not None:
                job.halt.set()
        else:
            raise ValueError(f"unknown step operation {kind!r}")


class LockstepLoop:
    """The scheduler's pass across ranks (mixed into `scheduler.Scheduler`, whose state it
    reads): rank 0 shares the step's operations, every rank applies them in order, then
    steps the same runners. Rank 0 watches each step against the deadline."""

    lockstep: Lockstep | None
    _cond: threading.Condition
    _taken: list[dict]  # rank 0's objects of the step being shared (scheduler.py)

    def _watch(self) -> None:
        """Rank 0: end the requests of a step the other ranks leave unanswered (their
        clients get a 503 naming the rank), rather than let every client hang with it."""
        ls = self.lockstep
        assert ls is not None
        while self._halted is None and not (self._stopping and not self._thread.is_alive()):
            time.sleep(min(1.0, ls.deadline_s / 10))
            lost = ls.overdue(self._stopping)
            if lost is not None:
                log.error("%s", lost)
                self._halt_cause = self._halt_cause or lost
                self._halt(lost)  # the MLX thread is stuck in the step: this one ends it
                return

    def _iterate_lockstep(self) -> bool:
        ls = self.lockstep
        assert ls is not None
        ops: list[Op] = []
        local: list[dict] = []
        calls: deque = deque()
        if ls.world.leader:
            with self._cond:
                while not (
                    self._calls or self._inbox or self._adds or self._removes or self._shared
                    or self._has_work() or self._stopping
                ):  # fmt: skip
                    self._cond.wait()
                calls, self._calls = self._calls, deque()
                inbox, self._inbox = self._inbox, deque()
                # Left in `_adds` until applied below: `submit` meanwhile must still see
                # the runner as on its way, not unloaded.
                adds = list(self._adds)
                removes, self._removes = self._removes, deque()
                shared, self._shared = self._shared, deque()
                done = self._stopping and not (calls or inbox or shared or self._has_work())
            # This rank's own upkeep, never a model call: before the step's collectives,
            # so that a rank that never answers them cannot hold a call's caller too.
            self._run_calls(calls)
            ls.busy_since = time.monotonic()
            ops, local = ls.step(adds, removes, shared, inbox, done)
            # Out of the queues and not yet applied: a halt meanwhile must end them too.
            self._taken = local
            ls.share(ops)
        else:
            with self._cond:
                calls, self._calls = self._calls, deque()
            self._run_calls(calls)
            ops = ls.share(None)
            local = [{} for _ in ops]
        self._taken = []
        for op, loc in zip(ops, local, strict=True):
            if op[0] == "stop":
                ls.busy_since = None
                self.flush()
                return False
            self._apply(op, loc)
        self.flush()
        worked = self._step_all(list(self._runners))
        ls.busy_since = None
        return worked

    def _apply(self, op: Op, loc: dict) -> None:
        ls = self.lockstep
        assert ls is not None
        future = loc.get("future")
        try:
            if op[0] == "call":  # a load: as long as its weights take, and outside the lock
                since, ls.busy_since = ls.busy_since, None
                ls.apply(op, self._runners, loc)
                ls.busy_since = since and time.monotonic()
            else:
                with self._cond:  # the runner list is read by `submit` on the event loop
                    ls.apply(op, self._runners, loc)
                    if op[0] == "add" and loc.get("runner") in self._adds:
                        self._adds.remove(loc["runner"])
        except BaseException as e:
            log.exception("step operation %s failed", op[0])
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(self._ending(e))
            pending = loc.get("pending")
            if pending is not None:
                pending.emit(Failed(self._ending(e)))
                pending.emit(None)
            return
        if future is not None and future.set_running_or_notify_cancel():
            future.set_result(loc.get("result"))
