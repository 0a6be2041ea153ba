"""The scheduler: every request of every model, on one MLX thread, in a step loop.

Metal takes command buffers from one thread, so all MLX work (loading, prefill, decode)
runs on the scheduler's thread. Each step, for each model with work:

1. **Admit** waiting requests while the model's batch has room and the live K/V fits the
   memory budget, taking sessions in turn (round-robin), so one client's flood does not
   starve another. Admission looks the prompt up in the prefix cache and restores it.
2. **Prefill** up to `prefill_chunk` prompt tokens: prompts that finish within a chunk
   first, so a short request that arrives during a long cold prefill starts decoding within
   about one chunk; longer ones in the order they were admitted, so none starves. A
   sequence prefills alone in an ordinary cache list, in chunks that end on a fixed grid
   and on the cache's save points, and saves exactly as a lone request would.
3. **Decode** one token for every running sequence as one batched forward pass
   (`kv.Batch`); each row samples with its own parameters (`sampling.RowSampler`). A
   finished or cancelled sequence is extracted for its end-of-generation save and leaves
   the batch in the same step.

The event loop only waits on an asyncio queue per request, fed from this thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from . import kv
from .cache.kinds import SavePoint
from .fair_queue import FairQueue
from .logctx import request_id
from .models import LoadedModel
from .prompt import RenderedPrompt
from .sampling import RowSampler, sample_rows
from .types import (
    CacheSource,
    EngineError,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    PromptInfo,
    TokenEvent,
)

log = logging.getLogger("engine_bridge.runner")

# A request waits for a sequence in prefill that will compute at least this many more
# tokens of its prompt (one cache block), rather than compute them a second time.
SHARED_PREFIX_MIN = 64


class CacheSession(Protocol):
    """What the runner needs from the prompt cache for one request."""

    def restore(self) -> tuple[list[Any], int, CacheSource]: ...

    def stop_points(self) -> list[int]: ...

    def save(
        self, cache: list[Any], tokens: list[int], position: int, point: SavePoint
    ) -> None: ...


@dataclass(slots=True)
class Job:
    request: GenerationRequest
    prompt: RenderedPrompt
    max_tokens: int
    cancel: threading.Event = field(default_factory=threading.Event)


Event = PromptInfo | TokenEvent | GenerationResult


class _Failed:
    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


Emit = Callable[[Event | _Failed | None], None]


@dataclass(slots=True)
class SchedulerSettings:
    max_batch: int = 8
    max_queue: int = 64
    prefill_chunk: int = 512
    # Live K/V bytes of admitted sequences, all models together; None: no limit.
    kv_memory_bytes: int | None = None


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
    decode_steps: int = 0
    decode_tokens: int = 0
    decode_s: float = 0.0
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    kv_bytes: int = 0  # live K/V of admitted sequences
    kv_memory_bytes: int | None = None
    admission_waits: int = 0  # steps where the memory budget held a request back

    @property
    def mean_batch(self) -> float:
        return round(self.decode_tokens / self.decode_steps, 2) if self.decode_steps else 0.0

    @property
    def decode_tok_s(self) -> float:
        return round(self.decode_tokens / self.decode_s, 1) if self.decode_s else 0.0

    @property
    def prefill_tok_s(self) -> float:
        return round(self.prefill_tokens / self.prefill_s, 1) if self.prefill_s else 0.0


_admissions = itertools.count()


# --- one request on the MLX thread ---------------------------------------------------------


class _Seq:
    """An admitted request: its cache, where its prefill stands, what it has decoded."""

    def __init__(self, pending: _Pending, session: CacheSession | None, tokenizer: Any):
        self.job = job = pending.job
        self.emit = pending.emit
        self.session = session
        self.start = pending.queued_at
        self.admitted = next(_admissions)
        self.cache: list[Any] = []
        self.position = 0
        self.cached = 0
        self.source: CacheSource = "none"
        self.stops: deque[int] = deque()
        self.sampler = RowSampler(job.request.sampling)
        self.eos = set(tokenizer.eos_token_ids)
        self.detok = tokenizer.detokenizer
        self.detok.reset()
        self.stopper = _StopMatcher(job.request.stop)
        self.out: list[int] = []
        self.history: list[int] = list(job.prompt.tokens[-64:])
        self.ttft: float | None = None
        self.finish: FinishReason | None = None

    @property
    def tokens(self) -> list[int]:
        return self.job.prompt.tokens

    @property
    def remaining(self) -> int:
        return self.stops[-1] - self.position if self.stops else 0

    @property
    def next_input(self) -> int:
        return self.out[-1] if self.out else self.tokens[-1]

    def accept(self, tok: int) -> bool:
        """Take a sampled token; True when the sequence is finished."""
        if self.ttft is None:
            self.ttft = time.perf_counter() - self.start
        self.out.append(tok)
        if tok in self.eos:
            self.finish = "stop"
            return True
        self.history.append(tok)
        self.detok.add_token(tok)
        text, hit = self.stopper.feed(self.detok.last_segment)
        if text:
            self.emit(TokenEvent(text, tok))
        if hit:
            self.finish = "stop_string"
        elif len(self.out) >= self.job.max_tokens:
            self.finish = "length"
        return self.finish is not None

    def flush_text(self) -> None:
        if self.finish != "stop_string":
            self.detok.finalize()
            tail, _ = self.stopper.feed(self.detok.last_segment, final=True)
            if tail:
                self.emit(TokenEvent(tail, self.out[-1] if self.out else -1))

    def result(self, used_cache: bool) -> GenerationResult:
        now = time.perf_counter()
        return GenerationResult(
            prompt_tokens=len(self.tokens),
            completion_tokens=len(self.out),
            cached_tokens=self.cached,
            source=self.source,
            finish_reason=self.finish or "cancelled",
            text=self.stopper.text,
            ttft_s=self.ttft if self.ttft is not None else now - self.start,
            generation_s=now - self.start,
            stop_string=self.stopper.matched,
            used_cache=used_cache,
        )


@dataclass(slots=True)
class _Pending:
    job: Job
    emit: Emit
    # TTFT counts from here: time waiting for a batch slot is time the client waits.
    queued_at: float = field(default_factory=time.perf_counter)


# --- one model ------------------------------------------------------------------------------


class Runner:
    """One model's requests: a fair wait queue, sequences in prefill, and a decode batch."""

    def __init__(
        self,
        loaded: LoadedModel,
        scheduler: Scheduler,
        session_factory: Callable[[Job], CacheSession | None] | None = None,
        on_result: Callable[[GenerationResult], None] | None = None,
    ):
        self.loaded = loaded
        self.scheduler = scheduler
        self._session_factory = session_factory
        self._on_result = on_result
        blocker = kv.batch_blocker(make_prompt_cache(loaded.model))
        if blocker is not None:
            log.warning("%s decodes one sequence at a time: %s", loaded.id, blocker)
        self.max_batch = 1 if blocker else scheduler.settings.max_batch
        self.batch = kv.Batch(batched=blocker is None)
        # Waiting requests: tenants take turns, and each tenant's sessions take turns.
        self._waiting: FairQueue[_Pending] = FairQueue()
        self.prefilling: list[_Seq] = []
        self.running: list[_Seq] = []  # row i of the batch
        self._inflight: mx.array | None = None  # the decode step computing now
        # Live K/V bytes per token, learned from finished prefills (admission estimates).
        self.bytes_per_token = 0.0
        self.last_used = time.monotonic()
        self.active_jobs = 0  # submitted and not yet finished (the idle janitor's test)

    @property
    def queued(self) -> int:
        return self.active_jobs

    # -- the event-loop side ---------------------------------------------------------------

    async def run(self, job: Job) -> AsyncIterator[Event]:
        """Queue the job and yield its events as the scheduler produces them."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event | _Failed | None] = asyncio.Queue()
        done = loop.create_future()

        def deliver(event: Event | _Failed | None) -> None:
            queue.put_nowait(event)
            if event is None and not done.done():
                done.set_result(None)

        def emit(event: Event | _Failed | None) -> None:
            self.scheduler.post(loop, deliver, event)

        self.scheduler.submit(self, _Pending(job, emit))  # may raise EngineError (429)
        self.active_jobs += 1
        try:
            while True:
                event = await queue.get()
                if event is None:
                    break
                if isinstance(event, _Failed):
                    raise event.error
                yield event
        finally:
            # A consumer that stops early (client gone) frees its slot within one step.
            job.cancel.set()
            self.scheduler.wake()
            try:
                await asyncio.shield(done)
            finally:
                self.active_jobs -= 1
                self.last_used = time.monotonic()

    # -- the MLX-thread side ---------------------------------------------------------------

    @property
    def n_waiting(self) -> int:
        return len(self._waiting)

    def enqueue(self, pending: _Pending) -> None:
        req = pending.job.request
        self._waiting.push(req.tenant, _lane(req), pending)

    @property
    def has_work(self) -> bool:
        return bool(self.n_waiting or self.prefilling or self.running)

    @property
    def active(self) -> int:
        return len(self.prefilling) + len(self.running)

    def live_bytes(self) -> int:
        return self.batch.nbytes + sum(kv.live_nbytes(s.cache) for s in self.prefilling)

    def step(self) -> bool:
        """One scheduling step for this model; True when it did any work."""
        flush = self.scheduler.flush
        worked = self._reap_cancelled()
        worked |= self._admit()
        flush()  # what admission learned (the cache hit) goes out before the prefill
        worked |= self._prefill(self.scheduler.settings.prefill_chunk)
        worked |= self._decode()
        flush()
        return worked

    def cancel_all(self) -> None:
        for p in self._waiting:
            p.job.cancel.set()
        for s in (*self.prefilling, *self.running):
            s.job.cancel.set()

    def _reap_cancelled(self) -> bool:
        worked = False
        for p in self._waiting.remove_if(lambda p: p.job.cancel.is_set()):
            p.emit(None)
            worked = True
        for s in [s for s in self.prefilling if s.job.cancel.is_set()]:
            self.prefilling.remove(s)
            self._close(s, save=False)
            worked = True
        if any(s.job.cancel.is_set() for s in self.running):
            self._settle()
            rows = [i for i, s in enumerate(self.running) if s.job.cancel.is_set()]
            if rows:
                self._retire(rows)
            worked = True
        return worked

    def _admit(self) -> bool:
        worked = False
        while self.n_waiting and self.active < self.max_batch:
            pending = self._waiting.pop_first(lambda p: not self._shares_inflight_prefix(p.job))
            if pending is None:
                break  # every session's next request waits for a prefix being computed
            job = pending.job
            estimate = self.bytes_per_token * (len(job.prompt.tokens) + job.max_tokens)
            if not self.scheduler.kv_room(int(estimate), idle=self.active == 0):
                self.scheduler.stats.admission_waits += 1
                self._waiting.push_front(job.request.tenant, _lane(job.request), pending)
                break
            self._start(pending)
            worked = True
        return worked

    def _shares_inflight_prefix(self, job: Job) -> bool:
        """Whether a sequence in prefill is computing a prefix of this prompt right now.

        Four agent sessions that start together share a 30k-token system prompt: admitted
        at once, each would compute it alone. Held back until the first has passed the
        shared part, the others restore it from the cache instead.
        """
        if not (job.request.use_cache and self._session_factory is not None):
            return False
        for seq in self.prefilling:
            if seq.session is None or seq.job.request.tenant != job.request.tenant:
                continue
            if common_prefix(job.prompt.tokens, seq.tokens) - seq.position >= SHARED_PREFIX_MIN:
                return True
        return False

    def _start(self, pending: _Pending) -> None:
        job = pending.job
        req = job.request
        request_id.set(req.request_id or "-")
        seq = _Seq(pending, None, self.loaded.tokenizer)
        try:
            if self._session_factory is not None and req.use_cache:
                seq.session = self._session_factory(job)
            if seq.session is not None:
                seq.cache, seq.position, seq.source = seq.session.restore()
            else:
                seq.cache = make_prompt_cache(self.loaded.model)
            seq.cached = seq.position
            seq.stops = deque(self._prefill_stops(seq))
        except BaseException as e:  # surfaced on the event loop, not lost in the thread
            log.exception("[%s] restore failed", req.request_id)
            pending.emit(_Failed(e))
            pending.emit(None)
            return
        seq.emit(PromptInfo(len(seq.tokens), seq.cached, seq.source))
        self.prefilling.append(seq)
        log.info(
            "admitted after %.2fs: %d prompt tokens, %d from %s; %d decoding, %d prefilling, "
            "%d waiting",
            time.perf_counter() - seq.start,
            len(seq.tokens),
            seq.cached,
            seq.source,
            len(self.running),
            len(self.prefilling),
            self.n_waiting,
        )
        if not seq.stops:
            self._end_prefill(seq)

    def _prefill_stops(self, seq: _Seq) -> list[int]:
        """Chunk ends for prefilling all but the last prompt token (whose logits the first
        decode step computes): multiples of the chunk size plus the cache's save points."""
        start, end = seq.position, len(seq.tokens) - 1
        chunk = self.scheduler.settings.prefill_chunk
        stops = set(range((start // chunk + 1) * chunk, end, chunk))
        if seq.session is not None:
            stops.update(p for p in seq.session.stop_points() if start < p < end)
        if end > start:
            stops.add(end)
        return sorted(stops)

    def _prefill(self, budget: int) -> bool:
        spent = 0
        model = self.loaded.model
        while self.prefilling and spent < budget:
            # A prompt that finishes within one chunk goes first (a short request starts
            # decoding at once); longer ones take chunks in the order they were admitted,
            # so a steady stream of shorter prompts cannot starve the oldest long one.
            seq = min(self.prefilling, key=lambda s: (s.remaining > budget, s.admitted))
            request_id.set(seq.job.request.request_id or "-")
            end = seq.stops.popleft()
            t0 = time.perf_counter()
            try:
                model(mx.array(seq.tokens[seq.position : end])[None], cache=seq.cache)
                mx.eval([c.state for c in seq.cache])
                self.scheduler.stats.prefill_s += time.perf_counter() - t0
                self.scheduler.stats.prefill_tokens += end - seq.position
                spent += end - seq.position
                seq.position = end
                if seq.session is not None:
                    seq.session.save(seq.cache, seq.tokens, end, SavePoint.PREFILL)
            except BaseException as e:
                self.prefilling.remove(seq)
                self._fail(seq, e)
                continue
            if not seq.stops:
                self._end_prefill(seq)
        return spent > 0

    def _end_prefill(self, seq: _Seq) -> None:
        self.prefilling.remove(seq)
        if seq.job.cancel.is_set():
            self._close(seq, save=False)
            return
        try:
            if seq.session is not None:
                seq.session.save(seq.cache, seq.tokens, seq.position, SavePoint.PROMPT_END)
            if seq.position:
                self.bytes_per_token = max(
                    self.bytes_per_token, kv.live_nbytes(seq.cache) / seq.position
                )
            self._settle()
            self.batch.join(seq.cache)
        except BaseException as e:
            self._fail(seq, e)
            return
        seq.cache = []  # the batch holds it now
        self.running.append(seq)

    def _decode(self) -> bool:
        """Take one decode step's tokens, and leave the next step computing.

        The next step is launched as soon as this one's tokens are known (`mx.async_eval`),
        so the model computes while this thread hands out events, admits and prefills.
        Anything that changes the batch first `_settle`s the step in flight.
        """
        if not self.running:
            return False
        if self._inflight is None:
            self._launch()
        self._collect()
        if self.running:
            self._launch()
        return True

    def _launch(self) -> None:
        t0 = time.perf_counter()
        try:
            inputs = mx.array([[s.next_input] for s in self.running])
            logits = self.loaded.model(inputs, cache=self.batch.cache)[:, -1, :]
            toks = sample_rows(
                logits, [s.sampler for s in self.running], [s.history for s in self.running]
            )
            mx.async_eval(toks)
        except BaseException as e:
            self._fail_running(e)
            return
        self._inflight = toks
        self.scheduler.stats.decode_s += time.perf_counter() - t0

    def _collect(self) -> None:
        """Wait for the step in flight, hand out its tokens, retire finished rows."""
        toks, self._inflight = self._inflight, None
        if toks is None:
            return
        stats = self.scheduler.stats
        t0 = time.perf_counter()
        try:
            values = toks.tolist()
        except BaseException as e:
            self._fail_running(e)
            return
        stats.decode_s += time.perf_counter() - t0
        stats.decode_steps += 1
        stats.decode_tokens += len(self.running)
        stats.largest_batch = max(stats.largest_batch, len(self.running))
        finished = []
        for row, (seq, tok) in enumerate(zip(self.running, values, strict=True)):
            request_id.set(seq.job.request.request_id or "-")
            if seq.accept(tok):
                finished.append(row)
        if finished:
            self._retire(finished)

    def _settle(self) -> None:
        """Finish the step in flight before the batch changes (a join, a cancel)."""
        if self._inflight is not None:
            self._collect()

    def _fail_running(self, error: BaseException) -> None:
        failed, self.running = self.running, []
        self._inflight = None
        self.batch = kv.Batch(batched=self.batch.batched)
        for s in failed:
            self._fail(s, error)

    def _retire(self, rows: list[int]) -> None:
        """Take the sequences in batch rows `rows` out of the batch, then save and close them."""
        leaving = [self.running[row] for row in rows]
        for row, seq in zip(rows, leaving, strict=True):
            try:
                if seq.session is not None and seq.out:
                    seq.cache = self.batch.extract(row)
            except BaseException:
                log.exception(
                    "[%s] extracting the finished cache failed", seq.job.request.request_id
                )
                seq.cache = []
        gone = set(rows)
        self.running = [s for i, s in enumerate(self.running) if i not in gone]
        self.batch.keep([i for i in range(self.batch.size) if i not in gone])
        for seq in leaving:
            request_id.set(seq.job.request.request_id or "-")
            self._close(seq, save=bool(seq.cache))

    def _close(self, seq: _Seq, save: bool) -> None:
        """Finish a sequence: text tail, the end-of-generation save, the result, the end."""
        if seq.finish is None:
            seq.finish = "cancelled"
        try:
            seq.flush_text()
            if save and seq.session is not None and seq.out:
                # The cache holds the prompt plus every generated token but the last, which
                # was sampled and never fed back.
                n = len(seq.tokens) + len(seq.out) - 1
                seq.session.save(seq.cache, seq.tokens + seq.out, n, SavePoint.GENERATION_END)
        except BaseException:
            log.exception("[%s] end-of-generation save failed", seq.job.request.request_id)
        seq.cache = []
        result = seq.result(
            used_cache=seq.job.request.use_cache and self._session_factory is not None
        )
        if self._on_result is not None:
            # Recorded here, not by the consumer, which may have gone away.
            self._on_result(result)
        seq.emit(result)
        seq.emit(None)

    def _fail(self, seq: _Seq, error: BaseException) -> None:
        log.exception("[%s] generation failed", seq.job.request.request_id, exc_info=error)
        seq.cache = []
        seq.emit(_Failed(error))
        seq.emit(None)


def _call_all(calls: list[tuple[Callable[[Any], None], Any]]) -> None:
    for fn, arg in calls:
        fn(arg)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix, comparing slices (C speed), not elements."""
    n = min(len(a), len(b))
    lo = 0
    for step in (4096, 256, 16, 1):
        while lo + step <= n and a[lo : lo + step] == b[lo : lo + step]:
            lo += step
    return lo


def _lane(req: GenerationRequest) -> str:
    """The session a request waits in line as: the client's session id when it sends one,
    else its conversation (the first user message), else the request itself."""
    if req.session:
        return "s:" + req.session
    for m in req.messages or ():
        if m.role == "user":
            return "c:" + hashlib.blake2b(m.content.encode(), digest_size=8).hexdigest()
    return "r:" + (req.request_id or str(id(req)))


# --- the loop -------------------------------------------------------------------------------


class Scheduler:
    """The MLX thread: runs submitted calls (loading, unloading) and the step loop."""

    def __init__(self, settings: SchedulerSettings | None = None):
        self.settings = settings or SchedulerSettings()
        self.stats = SchedulerStats(
            max_batch=self.settings.max_batch,
            max_queue=self.settings.max_queue,
            kv_memory_bytes=self.settings.kv_memory_bytes,
        )
        self._cond = threading.Condition()
        self._inbox: deque[tuple[Runner, _Pending]] = deque()
        self._calls: deque[tuple[Callable[..., Any], tuple, concurrent.futures.Future]] = deque()
        self._runners: list[Runner] = []
        # Events for the event loops, handed over once per phase rather than once each.
        self._outbox: dict[asyncio.AbstractEventLoop, list[tuple[Callable, Any]]] = {}
        self._turn = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="mlx", daemon=True)
        self._thread.start()

    # -- any thread ------------------------------------------------------------------------

    def submit(self, runner: Runner, pending: _Pending) -> None:
        with self._cond:
            if self._stopping:
                raise EngineError("the server is shutting down", status=503)
            # Requests beyond the free batch slots of their model wait; at most max_queue
            # of them, all models together.
            load = {r: r.n_waiting for r in self._runners}
            for r, _ in self._inbox:
                load[r] = load.get(r, 0) + 1

            def beyond(r: Runner, extra: int = 0) -> int:
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
            self._inbox.append((runner, pending))
            self._cond.notify()

    def call(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """Run `fn(*args)` on the MLX thread between steps."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._stopping and not self._thread.is_alive():
                raise RuntimeError("the scheduler has stopped")
            self._calls.append((fn, args, future))
            self._cond.notify()
        return future

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.wrap_future(self.call(fn, *args))

    def wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def add(self, runner: Runner) -> None:
        with self._cond:
            self._runners.append(runner)

    def remove(self, runner: Runner) -> None:
        with self._cond:
            if runner in self._runners:
                self._runners.remove(runner)

    def close(self, timeout: float = 30.0) -> None:
        """Cancel everything admitted or waiting, let it save, and stop the thread."""
        with self._cond:
            self._stopping = True
            for r in self._runners:
                r.cancel_all()
            for _, p in self._inbox:
                p.job.cancel.set()
            self._cond.notify()
        self._thread.join(timeout)

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

    def _retry_after(self, queued: int) -> float:
        # A rough time for the queue ahead to start: 64 decoded tokens each, at the rate
        # decode has run so far.
        rate = self.stats.decode_tok_s or 20.0
        return max(1.0, min(60.0, (queued + 1) * 64 / rate))

    # -- the MLX thread --------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            try:
                if not self._iterate():
                    self.flush()
                    return
            except BaseException:  # the thread must outlive any one bug: log and go on
                log.exception("scheduler step failed")
                time.sleep(0.05)

    def _iterate(self) -> bool:
        """One pass of the loop; False once stopping with nothing left to do."""
        if True:
            with self._cond:
                while not (self._calls or self._inbox or self._has_work() or self._stopping):
                    self._cond.wait()
                calls, self._calls = self._calls, deque()
                inbox, self._inbox = self._inbox, deque()
                runners = list(self._runners)
                if self._stopping and not calls and not inbox and not self._has_work():
                    return False
            for fn, args, future in calls:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(*args))
                    except BaseException as e:
                        future.set_exception(e)
            for runner, pending in inbox:
                if self._stopping:
                    pending.job.cancel.set()
                runner.enqueue(pending)
            self.flush()
            worked = False
            # Models take turns starting the step, so none always goes first.
            self._turn = (self._turn + 1) % max(1, len(runners))
            for runner in runners[self._turn :] + runners[: self._turn]:
                if runner.has_work:
                    worked |= runner.step()
            self._update_counts(runners)
            if not worked and any(r.has_work for r in runners):
                # Held back (memory) with nothing to do: wait for a finish or a cancel.
                with self._cond:
                    self._cond.wait(0.05)
        return True

    def _has_work(self) -> bool:
        return any(r.has_work for r in self._runners)

    def _update_counts(self, runners: list[Runner]) -> None:
        s = self.stats
        s.running = sum(len(r.running) for r in runners)
        s.prefilling = sum(len(r.prefilling) for r in runners)
        s.waiting = sum(r.n_waiting for r in runners)
        s.kv_bytes = sum(r.live_bytes() for r in runners)


class _StopMatcher:
    """Streams text while holding back anything that could be the start of a stop string."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.text = ""
        self.matched: str | None = None
        self._emitted = 0

    def feed(self, segment: str, final: bool = False) -> tuple[str, bool]:
        self.text += segment
        if self.stops:
            window_start = max(0, self._emitted - max(len(s) for s in self.stops))
            hits = [(i, s) for s in self.stops if (i := self.text.find(s, window_start)) != -1]
            if hits:
                cut, self.matched = min(hits)
                out = self.text[self._emitted : cut]
                self.text = self.text[:cut]
                self._emitted = cut
                return out, True
        hold = 0 if final else self._held_suffix()
        upto = len(self.text) - hold
        out = self.text[self._emitted : upto] if upto > self._emitted else ""
        self._emitted = max(self._emitted, upto)
        return out, False

    def _held_suffix(self) -> int:
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:k]):
                    best = max(best, k)
                    break
        return best
