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
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from weakref import WeakValueDictionary

from .jobs import Job, Pending

if TYPE_CHECKING:
    from ..distributed.world import World

log = logging.getLogger(__name__)

Op = tuple[Any, ...]


def _discard(event: object) -> None:
    """A follower's events: rank 0 answers the client."""


class Lockstep:
    """Rank 0's side builds each step's operations; every side applies them."""

    def __init__(self, world: World):
        self.world = world
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
