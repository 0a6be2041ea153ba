"""The MLX thread: runs submitted calls (loading, unloading) and the step loop over every
model's `ModelQueue`, admits requests to a bounded queue, and hands events to event loops."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..distributed.world import RankLost
from ..types import EngineError, EngineHalted
from .jobs import Failed, Pending
from .lockstep import Lockstep, LockstepLoop
from .speculation.control import SpeculativeSettings

if TYPE_CHECKING:
    from ..distributed.world import World


class ModelQueue(Protocol):
    """What the step loop asks of one model's work (runner.py's `Runner` is the one)."""

    max_batch: int
    running: list[Any]  # decoding now
    prefilling: list[Any]

    @property
    def model_id(self) -> str: ...
    @property
    def n_waiting(self) -> int: ...
    @property
    def active(self) -> int: ...
    @property
    def has_work(self) -> bool: ...
    def live_bytes(self) -> int: ...
    def enqueue(self, pending: Pending) -> None: ...
    def step(self) -> bool: ...
    def fail_all(self, error: BaseException) -> int: ...


log = logging.getLogger("engine_bridge.scheduling.scheduler")

# After a failure of the loop itself, the pause before it tries again; it doubles while the
# failure repeats, up to the second figure.
RETRY_S, RETRY_MAX_S = 0.05, 2.0


@dataclass(slots=True)
class SchedulerSettings:
    max_batch: int = 8
    max_queue: int = 64
    prefill_chunk: int = 512
    # Live K/V bytes of admitted sequences, all models together; None: no limit.
    kv_memory_bytes: int | None = None
    speculation: SpeculativeSettings = field(default_factory=SpeculativeSettings)


@dataclass(slots=True)
class SchedulerStats:
    """What /v1/cache/stats shows under "scheduler"."""

    running: int = 0  # sequences decoding now, all models
    prefilling: int = 0
    waiting: int = 0  # the queue depth
    max_batch: int = 0
    max_queue: int = 0
    rejected: int = 0  # answered 429
    largest_batch: int = 0
    decode_steps: int = 0  # model steps: one token per row, or one verify pass
    decode_tokens: int = 0
    decode_rows: int = 0  # sequences per step, summed (mean_batch)
    decode_s: float = 0.0
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    kv_bytes: int = 0  # live K/V of admitted sequences
    kv_memory_bytes: int | None = None
    admission_waits: int = 0  # steps where the memory budget held a request back
    # Speculative decoding (decoding.py `_verify`): verify passes, the draft tokens they
    # checked and how many the model kept, passes whose rejection replayed a recurrent
    # state (kv/rollback.py), and batched steps in which speculation paused.
    spec_rounds: int = 0
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_replays: int = 0
    spec_paused_steps: int = 0

    def count_step(self, rows: int, tokens: int) -> None:
        """One decode model step (plain or a verify pass) over `rows` sequences that took
        `tokens` tokens in all."""
        self.decode_steps += 1
        self.decode_rows += rows
        self.decode_tokens += tokens
        self.largest_batch = max(self.largest_batch, rows)

    @property
    def mean_batch(self) -> float:
        return round(self.decode_rows / self.decode_steps, 2) if self.decode_steps else 0.0

    @property
    def tokens_per_step(self) -> float:
        return round(self.decode_tokens / self.decode_steps, 3) if self.decode_steps else 0.0

    @property
    def spec_acceptance(self) -> float:
        return round(self.spec_accepted / self.spec_drafted, 3) if self.spec_drafted else 0.0

    @property
    def decode_tok_s(self) -> float:
        return round(self.decode_tokens / self.decode_s, 1) if self.decode_s else 0.0

    @property
    def prefill_tok_s(self) -> float:
        return round(self.prefill_tokens / self.prefill_s, 1) if self.prefill_s else 0.0

    def to_json(self) -> dict:
        """The counters and the figures derived from them."""
        return asdict(self) | {
            "mean_batch": self.mean_batch,
            "tokens_per_step": self.tokens_per_step,
            "spec_acceptance": self.spec_acceptance,
            "decode_tok_s": self.decode_tok_s,
            "prefill_tok_s": self.prefill_tok_s,
        }


class Scheduler(LockstepLoop):
    """The MLX thread: runs submitted calls (loading, unloading) and the step loop."""

    def __init__(
        self,
        settings: SchedulerSettings | None = None,
        world: World | None = None,
        deadline_s: float = 60.0,
    ):
        self.settings = settings or SchedulerSettings()
        # Across ranks, every step's operations are shared by rank 0 (lockstep.py), and
        # rank 0 gives up on a step the others have not answered in `deadline_s`.
        self.lockstep = (
            Lockstep(world, deadline_s) if world is not None and not world.alone else None
        )
        # What `run_shared` runs, by name: the model lifecycle sets them.
        self.handlers: dict[str, Callable[..., Any]] = {}
        if self.lockstep is not None:
            self.lockstep.handlers = self.handlers
        self._adds: deque[ModelQueue] = deque()
        self._removes: deque[ModelQueue] = deque()
        self._shared: deque[tuple[str, tuple, concurrent.futures.Future]] = deque()
        # Rank 0's own objects (futures, pending requests) of the step being shared: out of
        # the queues and not yet applied, so a halt meanwhile ends them too.
        self._taken: list[dict] = []
        self.stats = SchedulerStats(
            max_batch=self.settings.max_batch,
            max_queue=self.settings.max_queue,
            kv_memory_bytes=self.settings.kv_memory_bytes,
        )
        self._cond = threading.Condition()
        self._inbox: deque[tuple[ModelQueue, Pending]] = deque()
        self._calls: deque[tuple[Callable[..., Any], tuple, concurrent.futures.Future]] = deque()
        self._runners: list[ModelQueue] = []
        # Events for the event loops, handed over once per phase rather than once each.
        self._outbox: dict[asyncio.AbstractEventLoop, list[tuple[Callable, Any]]] = {}
        self._turn = 0
        self._stopping = False
        # What stopped the loop on its own (SystemExit, KeyboardInterrupt, CancelledError on
        # the MLX thread); None while it runs, or stops because it was closed.
        self._halt_cause: BaseException | None = None
        self._halted: str | None = None  # then, why new work is refused
        self._thread = threading.Thread(target=self._loop, name="mlx", daemon=True)
        self._thread.start()
        if self.lockstep is not None and self.lockstep.world.leader:
            threading.Thread(target=self._watch, name="rank-watchdog", daemon=True).start()

    # -- any thread ------------------------------------------------------------------------

    def submit(self, runner: ModelQueue, pending: Pending) -> None:
        with self._cond:
            if self._stopping:
                raise EngineError(self._halted or "the server is shutting down", status=503)
            if runner not in self._runners and runner not in self._adds:
                # Unloaded since the caller found it: queued there, the job would never run.
                raise EngineError(f"{runner.model_id} was unloaded; retry", status=503)
            # Requests beyond the free batch slots of their model wait; at most max_queue
            # of them, all models together.
            load = {r: r.n_waiting for r in self._runners}
            for r, _ in self._inbox:
                load[r] = load.get(r, 0) + 1

            def beyond(r: ModelQueue, extra: int = 0) -> int:
                return max(0, load.get(r, 0) + extra - max(0, r.max_batch - r.active))

            queued = sum(beyond(r) for r in load)
            if beyond(runner, 1) and queued >= self.settings.max_queue:
                self.stats.rejected += 1
                raise EngineError(
                    f"the server is busy: {queued} requests are waiting for a batch slot "
                    f"(max_queue {self.settings.max_queue}); retry shortly",
                    status=429,
                    retry_after_s=self._retry_after(queued),
                )
            if self.lockstep is not None:
                self.lockstep.number(pending.job)
            self._inbox.append((runner, pending))
            self._cond.notify()

    def call(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """Run `fn(*args)` on the MLX thread between steps."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            # Once halted, also while the thread is still ending what was queued.
            if self._halted is not None or (self._stopping and not self._thread.is_alive()):
                raise EngineHalted(self._halted or "the scheduler has stopped")
            self._calls.append((fn, args, future))
            self._cond.notify()
        return future

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.wrap_future(self.call(fn, *args))

    def wake(self) -> None:
        with self._cond:
            self._cond.notify()

    async def run_shared(self, name: str, *args: Any) -> Any:
        """Run `handlers[name](*args)` on every rank at the same step (a model's load),
        between steps; alone, on this one. Returns this rank's result."""
        if self.lockstep is None:
            return await self.run(self.handlers[name], *args)
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._halted is not None or self._stopping:
                raise EngineHalted(self._halted or "the scheduler has stopped")
            self._shared.append((name, args, future))
            self._cond.notify()
        return await asyncio.wrap_future(future)

    def add(self, runner: ModelQueue) -> None:
        with self._cond:
            if self.lockstep is not None:
                self._adds.append(runner)  # at the next step, on every rank
                self._cond.notify()
            else:
                self._runners.append(runner)

    def remove(self, runner: ModelQueue) -> None:
        with self._cond:
            if self.lockstep is not None:
                if runner in self._adds:
                    self._adds.remove(runner)
                elif runner in self._runners:
                    self._removes.append(runner)
                    self._cond.notify()
            elif runner in self._runners:
                self._runners.remove(runner)

    def join(self) -> None:
        """Wait until the loop ends (a follower rank: until rank 0 closes)."""
        self._thread.join()

    def close(self, timeout: float = 30.0) -> None:
        """Cancel everything admitted or waiting, let it save, and stop the thread."""
        with self._cond:
            self._stopping = True
            for r in self._runners:
                r.cancel_all()
            for _, p in self._inbox:
                p.job.cancel.set()
            self._cond.notify()
        # Halted on a lost rank, the thread may be stuck in a step the others never answer.
        self._thread.join(min(timeout, 2.0) if self._halted else timeout)

    def post(self, loop: asyncio.AbstractEventLoop, fn: Callable[[Any], None], arg: Any) -> None:
        """Queue `fn(arg)` to run on `loop` at the next `flush` (MLX thread only)."""
        self._outbox.setdefault(loop, []).append((fn, arg))

    def flush(self) -> None:
        """Hand queued events to their loops: one wake-up per loop, not one per event."""
        outbox, self._outbox = self._outbox, {}
        for loop, calls in outbox.items():
            try:
                loop.call_soon_threadsafe(_call_all, calls)
            except RuntimeError:  # that loop is closed: nobody is listening any more
                log.debug("dropped %d events for a closed event loop", len(calls))

    def kv_room(self, estimate: int, idle: bool) -> bool:
        """Whether `estimate` more bytes of live K/V fit the budget (always, for a model
        with nothing admitted: one sequence at a time must always run)."""
        limit = self.settings.kv_memory_bytes
        if limit is None or idle:
            return True
        return self.stats.kv_bytes + estimate <= limit

    def agree(self, ok: bool) -> bool:
        """Across ranks, whether every rank says `ok` (a rank that holds more layers holds
        more K/V); alone, `ok`. Every rank must ask at the same point of its step."""
        return ok if self.lockstep is None else self.lockstep.world.all_ok(ok)

    def _retry_after(self, queued: int) -> float:
        # A rough time for the queue ahead to start: 64 decoded tokens each, at the rate
        # decode has run so far.
        rate = self.stats.decode_tok_s or 20.0
        return max(1.0, min(60.0, (queued + 1) * 64 / rate))

    # -- the MLX thread --------------------------------------------------------------------

    def _loop(self) -> None:
        failures = 0
        while True:
            try:
                if not self._iterate():
                    self.flush()
                    return
                failures = 0
            except Exception as e:
                if self.lockstep is not None:
                    # The ranks may have left step: none can go on (lockstep.py).
                    self._halt_cause = self._halt_cause or self.lockstep.fell_apart(e)
                    self._halt(self._halt_cause)
                    return
                # A bug outside the handlers of a call, a queued request and a step (each
                # ends what it ran): the thread must outlive it, but while it repeats, log
                # the 1st, 2nd, 4th, 8th... time, and back off rather than spin.
                failures += 1
                if failures & (failures - 1) == 0:
                    log.exception("scheduler loop failed (%d times in a row)", failures)
                time.sleep(min(RETRY_MAX_S, RETRY_S * 2 ** min(failures - 1, 16)))
            except BaseException as e:
                self._halt_cause = self._halt_cause or e
            if self._halt_cause is not None:
                self._halt(self._halt_cause)
                return

    def _ending(self, error: BaseException) -> BaseException:
        """What ends the call or request that raised `error`. A stop (SystemExit,
        KeyboardInterrupt, CancelledError) is an order, not a bug to retry: the loop halts
        after this pass, and the client gets a 503 rather than the stop re-raised on its
        event loop, where it would stop the server too."""
        if self.lockstep is not None and isinstance(error, Exception):
            error = self.lockstep.lost(error)  # a broken link: the world must stop
        if isinstance(error, Exception) and not isinstance(error, RankLost):
            return error
        self._halt_cause = self._halt_cause or error
        return EngineError(_halted_message(error), status=503)

    def ending(self, error: BaseException) -> BaseException:
        """What a request that failed with `error` ends with (the runner's failures)."""
        return self._ending(error)

    @property
    def halted(self) -> str | None:
        """Why the loop stopped on its own, for good (new work answers 503); None while it
        runs or after a plain close."""
        return self._halted

    def _halt(self, cause: BaseException) -> None:
        """Stop for good after `cause`: end everything left with a 503, refuse new work.
        Once only: across ranks, rank 0's watchdog may halt while the thread is stuck."""
        with self._cond:
            if self._halted is not None:
                return
            self._halted = _halted_message(cause)
        log.error("scheduler stopped by %r; ending its requests", cause)
        with self._cond:
            self._stopping = True
            calls, self._calls = self._calls, deque()
            calls += self._shared  # (name, args, future): only the future is read here
            inbox, self._inbox = self._inbox, deque()
            self._shared, self._adds = deque(), deque()
            runners = list(self._runners)
            taken, self._taken = self._taken, []  # a lockstep pass stuck in its share
        failed = EngineError(self._halted, status=503)
        calls += [(None, (), t["future"]) for t in taken if "future" in t]
        inbox += [(None, t["pending"]) for t in taken if "pending" in t]
        for _, _, future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(failed)
        for _, pending in inbox:
            pending.emit(Failed(failed))
            pending.emit(None)
        for runner in runners:
            try:
                runner.fail_all(failed)
            except Exception:
                log.exception("%s: ending its requests failed", runner.model_id)
        self.flush()

    def _iterate(self) -> bool:
        """One pass of the loop; False once stopping with nothing left to do."""
        if self.lockstep is not None:
            return self._iterate_lockstep()
        with self._cond:
            while not (self._calls or self._inbox or self._has_work() or self._stopping):
                self._cond.wait()
            calls, self._calls = self._calls, deque()
            inbox, self._inbox = self._inbox, deque()
            runners = list(self._runners)
            if self._stopping and not calls and not inbox and not self._has_work():
                return False
        self._run_calls(calls)
        for runner, pending in inbox:
            if self._stopping:
                pending.job.cancel.set()
            try:
                runner.enqueue(pending)
            except BaseException as e:  # lost here, its client would wait forever
                log.exception("queueing a request failed")
                pending.emit(Failed(self._ending(e)))
                pending.emit(None)
        self.flush()
        return self._step_all(runners)

    def _step_all(self, runners: list[ModelQueue]) -> bool:
        worked = False
        # Models take turns starting the step, so none always goes first.
        self._turn = (self._turn + 1) % max(1, len(runners))
        for runner in runners[self._turn :] + runners[: self._turn]:
            if runner.has_work:
                worked |= self._step(runner)
        self._update_counts(runners)
        if not worked and any(r.has_work for r in runners):
            # Held back (memory) with nothing to do: wait for a finish or a cancel.
            with self._cond:
                self._cond.wait(0.05)
        return True

    def _run_calls(self, calls: deque) -> None:
        """Run the queued `call`s, each future given its result or its error."""
        for fn, args, future in calls:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:
                    future.set_exception(self._ending(e))

    def _step(self, runner: ModelQueue) -> bool:
        """One step of `runner`. A step that raises past the runner's own handlers (which
        fail one sequence) would raise again on every retry while its requests hang, so
        that model's requests end with the error, and other models' go on."""
        try:
            return runner.step()
        except BaseException as e:
            n = runner.fail_all(self._ending(e))
            log.exception("%s: scheduler step failed; ended its %d requests", runner.model_id, n)
            self.flush()
            return True

    def _has_work(self) -> bool:
        return any(r.has_work for r in self._runners)

    def _update_counts(self, runners: list[ModelQueue]) -> None:
        s = self.stats
        s.running = sum(len(r.running) for r in runners)
        s.prefilling = sum(len(r.prefilling) for r in runners)
        s.waiting = sum(r.n_waiting for r in runners)
        s.kv_bytes = sum(r.live_bytes() for r in runners)


def _halted_message(cause: BaseException) -> str:
    if isinstance(cause, RankLost):
        return str(cause)
    return f"the engine stopped: {type(cause).__name__} on the MLX thread"


def _call_all(calls: list[tuple[Callable[[Any], None], Any]]) -> None:
    for fn, arg in calls:
        fn(arg)
