"""One model's requests under the scheduler (`scheduler.py` runs the step loop).

Metal takes command buffers from one thread, so all MLX work (loading, prefill, decode)
runs on the scheduler's thread. Each step, for each model with work, its `Runner`:

1. **Admit** waiting requests while the model's batch has room and the live K/V fits the
   memory budget, taking sessions in turn (round-robin), so one client's flood does not
   starve another. Admission looks the prompt up in the prefix cache and restores it:
   what it needs below RAM (SSD, shared store) was read before the request was queued,
   on the tiers' I/O threads while the request waited in its coroutine (`run`), so a slow
   tier costs only that request, never a step of the others.
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
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import mlx.core as mx

from .. import kv
from ..cache.hashing import common_prefix
from ..cache.kinds import SavePoint
from ..logctx import request_id
from ..models.loading import LoadedModel
from ..types import GenerationRequest, GenerationResult, PromptInfo, conversation_id
from .decoding import Decoding
from .fair_queue import FairQueue
from .jobs import CacheSession, Event, Failed, Job, Pending
from .sampling import sample_rows
from .sequence import Seq
from .speculation.control import Mode, Speculation, new_drafter
from .speculation.mtp import MTPDrafter

if TYPE_CHECKING:
    from .scheduler import Scheduler

log = logging.getLogger("engine_bridge.scheduling.runner")

# A request waits for a sequence in prefill that will compute at least this many more
# tokens of its prompt (one cache block), rather than compute them a second time.
SHARED_PREFIX_MIN = 64

__all__ = ["CacheSession", "Event", "Job", "Runner"]


# --- one model ------------------------------------------------------------------------------


class Runner(Decoding):
    """One model's requests: a fair wait queue, sequences in prefill, and a decode batch."""

    def __init__(
        self,
        loaded: LoadedModel,
        scheduler: Scheduler,
        session_factory: Callable[[Job], CacheSession | None] | None = None,
        on_result: Callable[[GenerationRequest, GenerationResult], None] | None = None,
        on_done: Callable[[Seq, GenerationResult], None] | None = None,
    ):
        self.loaded = loaded
        self.scheduler = scheduler
        self._session_factory = session_factory
        self._on_result = on_result
        # Told every finished sequence (the request log: why a request missed).
        self._on_done = on_done
        blocker = kv.batch_blocker(kv.make_prompt_cache(loaded.model))
        if blocker is not None:
            log.warning("%s decodes one sequence at a time: %s", loaded.id, blocker)
        self.max_batch = 1 if blocker else scheduler.settings.max_batch
        if scheduler.settings.speculation.mode == Mode.MTP and loaded.mtp is None:
            log.warning("%s has no MTP head (no mtp.* weights beside it): [engine] "
                        "speculative = 'mtp' decodes it plainly; the README's recipe puts "
                        "Qwen3.6's head back", loaded.id)  # fmt: skip
        self.batch = kv.Batch(batched=blocker is None)
        # Waiting requests: tenants take turns, and each tenant's sessions take turns.
        self._waiting: FairQueue[Pending] = FairQueue()
        self.prefilling: list[Seq] = []
        self.running: list[Seq] = []  # row i of the batch
        self._inflight: mx.array | None = None  # the decode step computing now
        # Live K/V bytes per token, learned from finished prefills (admission estimates).
        self.bytes_per_token = 0.0
        self.last_used = time.monotonic()
        self.active_jobs = 0  # submitted and not yet finished (the idle janitor's test)
        # Those jobs by id: a session delete waits for its session's to end.
        self.live_jobs: dict[int, Job] = {}
        # Cache sessions made, and read ahead, on the event loop, until admission takes
        # them (by id(job)).
        self._sessions: dict[int, CacheSession] = {}

    # -- the event-loop side ---------------------------------------------------------------

    async def run(self, job: Job) -> AsyncIterator[Event]:
        """Read ahead what the job's cache lookup needs below RAM, queue the job, and yield
        its events as the scheduler produces them."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event | Failed | None] = asyncio.Queue()
        done = loop.create_future()

        def deliver(event: Event | Failed | None) -> None:
            queue.put_nowait(event)
            if event is None and not done.done():
                done.set_result(None)

        def emit(event: Event | Failed | None) -> None:
            self.scheduler.post(loop, deliver, event)

        pending = Pending(job, emit)  # TTFT counts from here: reading ahead is waiting too
        self.active_jobs += 1
        self.live_jobs[id(job)] = job
        queued = False
        try:
            await self._read_ahead(job)
            self.scheduler.submit(self, pending)  # may raise EngineError (429)
            queued = True
            while True:
                event = await queue.get()
                if event is None:
                    break
                if isinstance(event, Failed):
                    raise event.error
                yield event
        finally:
            # A consumer that stops early (client gone) frees its slot within one step.
            job.cancel.set()
            try:
                if queued:
                    self.scheduler.wake()
                    await asyncio.shield(done)
            finally:
                session = self._sessions.pop(id(job), None)  # never admitted
                if session is not None:
                    getattr(session, "discard", lambda: None)()
                self.active_jobs -= 1
                self.live_jobs.pop(id(job), None)
                self.last_used = time.monotonic()

    async def _read_ahead(self, job: Job) -> None:
        """Make the job's cache session, and have it read what its lookup needs below RAM
        on the tiers' I/O threads (cache/tier_reads.py), each tier under a deadline."""
        if self._session_factory is None or not job.request.use_cache:
            return
        session = self._session_factory(job)
        if session is None:
            return
        self._sessions[id(job)] = session
        read_ahead = getattr(session, "read_ahead", None)  # prompt_cache.CacheSession's
        if read_ahead is not None:
            await read_ahead()

    # -- the MLX-thread side ---------------------------------------------------------------

    @property
    def model_id(self) -> str:
        return self.loaded.id

    @property
    def n_waiting(self) -> int:
        return len(self._waiting)

    def enqueue(self, pending: Pending) -> None:
        req = pending.job.request
        self._waiting.push(req.tenant, lane(req), pending)

    @property
    def has_work(self) -> bool:
        return bool(self.n_waiting or self.prefilling or self.running)

    @property
    def active(self) -> int:
        return len(self.prefilling) + len(self.running)

    def live_bytes(self) -> int:
        heads = sum(s.mtp.nbytes for s in (*self.prefilling, *self.running) if s.mtp is not None)
        return self.batch.nbytes + sum(kv.live_nbytes(s.cache) for s in self.prefilling) + heads

    def step(self) -> bool:
        """One scheduling step for this model; True when it did any work."""
        flush = self.scheduler.flush
        worked = self._reap_cancelled()
        worked |= self._admit()
        flush()  # what admission learned (the cache hit) goes out before the prefill
        worked |= self._prefill(self.scheduler.settings.prefill_chunk)
        flush()  # a first token the last chunk sampled goes out before the next step
        worked |= self._decode()
        flush()
        return worked

    def cancel_all(self) -> None:
        for p in self._waiting:
            p.job.cancel.set()
        for s in (*self.prefilling, *self.running):
            s.job.cancel.set()

    def fail_all(self, error: BaseException) -> int:
        """End every request of this model, waiting or admitted, with `error` (the
        scheduler's answer to a step that raised); returns how many."""
        waiting = self._waiting.remove_if(lambda p: True)
        admitted, self.prefilling = [*self.prefilling, *self.running], []
        self.running, self._inflight = [], None
        self.batch = kv.Batch(batched=self.batch.batched)
        for p in waiting:
            p.emit(Failed(error))
            p.emit(None)
        for seq in admitted:
            seq.cache = []
            seq.emit(Failed(error))
            seq.emit(None)
        return len(waiting) + len(admitted)

    def _reap_cancelled(self) -> bool:
        worked = False
        for p in self._waiting.remove_if(lambda p: p.job.halt.is_set()):
            p.emit(None)
            worked = True
        for s in [s for s in self.prefilling if s.job.halt.is_set()]:
            self.prefilling.remove(s)
            self._close(s, save=False)
            worked = True
        if any(s.job.halt.is_set() for s in self.running):
            self._settle()
            rows = [i for i, s in enumerate(self.running) if s.job.halt.is_set()]
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
            room = self.scheduler.kv_room(int(estimate), idle=self.active == 0)
            if not self.scheduler.agree(room):
                self.scheduler.stats.admission_waits += 1
                self._waiting.push_front(job.request.tenant, lane(job.request), pending)
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

    def _start(self, pending: Pending) -> None:
        job = pending.job
        req = job.request
        request_id.set(req.request_id or "-")
        seq = Seq(pending, None, self.loaded.tokenizer)
        try:
            seq.session = self._sessions.pop(id(job), None)  # made by `run`, read ahead
            if seq.session is None and self._session_factory is not None and req.use_cache:
                seq.session = self._session_factory(job)  # queued without `run`
            if seq.session is not None:
                t0 = time.perf_counter()
                seq.cache, seq.position, seq.source = seq.session.restore()
                seq.restore_s = time.perf_counter() - t0
            else:
                seq.cache = kv.make_prompt_cache(self.loaded.model)
            seq.cached = seq.position
            seq.spec = self._speculation(job) if kv.can_rewind(seq.cache) else None
            drafter = seq.spec.drafter if seq.spec is not None else None
            seq.mtp = drafter if isinstance(drafter, MTPDrafter) else None
            # The last chunk samples the first token, but where an MTP head is primed
            # along the prompt or image features are fed (their own passes), and for a
            # warm-up, which generates nothing.
            plain = seq.mtp is None and job.prompt.vision is None and not req.prefill_only
            points = seq.session.stop_points() if seq.session is not None else ()
            seq.plan_prefill(self.scheduler.settings.prefill_chunk, points, sample=plain)
        except BaseException as e:  # surfaced on the event loop, not lost in the thread
            log.exception("[%s] restore failed", req.request_id)
            pending.emit(Failed(e))
            pending.emit(None)
            return
        report = getattr(seq.session, "lookup", None)  # a LookupReport, when cached
        diverged = report.diverged_at if report is not None else None
        seq.emit(PromptInfo(len(seq.tokens), seq.cached, seq.source, diverged))
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

    def _speculation(self, job: Job) -> Speculation | None:
        """The sequence's drafter, when it speculates: a text model, not turned off."""
        settings = self.scheduler.settings.speculation
        if not job.request.speculative or job.request.prefill_only or self.loaded.vision:
            return None
        drafter = new_drafter(settings, job.prompt.tokens, self.loaded)
        return Speculation(drafter, settings) if drafter is not None else None

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
            first = None
            try:
                head = seq.mtp
                if seq.job.prompt.vision is not None:
                    # The model sees real ids and image features, the cache keyed ids.
                    model.prefill(seq.job.prompt.vision, seq.position, end, seq.cache)
                elif head is None:
                    logits = model(mx.array(seq.tokens[seq.position : end])[None], cache=seq.cache)
                    if end == len(seq.tokens):  # the last chunk: the first token, no decode step
                        first = sample_rows(logits[:, -1, :], [seq.sampler], [seq.history])
                else:
                    # Prime the head along the prompt: each position's hidden state with
                    # the token after it (the chunk ends before the last prompt token);
                    # only the last chunk's draft is read.
                    hidden = head.backbone(mx.array(seq.tokens[seq.position : end])[None],
                                           seq.cache)  # fmt: skip
                    head.feed(hidden, seq.tokens[seq.position + 1 : end + 1], at=seq.position,
                              draft=not seq.stops)  # fmt: skip
                mx.eval([c.state for c in seq.cache], head.state if head is not None else [],
                        first if first is not None else [])  # fmt: skip
                dt = time.perf_counter() - t0
                self.scheduler.stats.prefill_s += dt
                self.scheduler.stats.prefill_tokens += end - seq.position
                seq.prefill_s += dt
                seq.prefilled += end - seq.position
                spent += end - seq.position
                seq.position = end
                if seq.session is not None:
                    seq.session.save(seq.cache, seq.tokens, end, SavePoint.PREFILL)
                    if end == seq.prompt_end:  # the last chunk starts here: as a prompt's end
                        seq.session.save(seq.cache, seq.tokens, end, SavePoint.PROMPT_END)
                if first is not None:
                    first = int(first.item())
            except BaseException as e:
                self.prefilling.remove(seq)
                self._fail(seq, e)
                continue
            if not seq.stops:
                self._end_prefill(seq, first)
        return spent > 0

    def _end_prefill(self, seq: Seq, first: int | None = None) -> None:
        """The prompt is in the cache: save its end, take the first token when the last
        chunk sampled it, and join the batch."""
        self.prefilling.remove(seq)
        if seq.job.halt.is_set():
            self._close(seq, save=False)
            return
        try:
            if seq.session is not None and seq.prompt_end is None:
                seq.session.save(seq.cache, seq.tokens, seq.position, SavePoint.PROMPT_END)
            if seq.job.request.prefill_only:  # a warm-up: stored, and nothing to generate
                seq.finish = "length"
                self._close(seq, save=False)
                return
            if seq.position:
                self.bytes_per_token = max(
                    self.bytes_per_token, kv.live_nbytes(seq.cache) / seq.position
                )
            if first is not None and seq.accept(first):
                self._close(seq, save=True)  # finished on its first token
                return
            self._settle()
            self.batch.join(seq.cache)
        except BaseException as e:
            self._fail(seq, e)
            return
        seq.cache = []  # the batch holds it now
        self.running.append(seq)

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

    def _close(self, seq: Seq, save: bool) -> None:
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
        if self._on_result is not None and not seq.job.request.prefill_only:
            # Recorded here, not by the consumer, which may have gone away. A warm-up is
            # not a request: it stays out of the hit ratio.
            self._on_result(seq.job.request, result)
        if self._on_done is not None:
            try:
                self._on_done(seq, result)
            except Exception:
                log.exception("[%s] recording the request failed", seq.job.request.request_id)
        seq.emit(result)
        seq.emit(None)

    def _fail(self, seq: Seq, error: BaseException) -> None:
        log.exception("[%s] generation failed", seq.job.request.request_id, exc_info=error)
        seq.cache = []
        seq.emit(Failed(self.scheduler.ending(error)))
        seq.emit(None)


def lane(req: GenerationRequest) -> str:
    """The session a request waits in line as: the client's session id when it sends one,
    else its conversation (types.conversation_id), else the request itself."""
    if req.session:
        return "s:" + req.session
    if conversation := conversation_id(req.messages):
        return "c:" + conversation
    return "r:" + (req.request_id or str(id(req)))
