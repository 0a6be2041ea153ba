"""One request for one model: lookup → restore → prefill → decode → store.

All MLX work runs on one worker thread that the engine shares between its models, so
requests queue fairly (FIFO) and run one at a time: Metal does not take command buffers
from two threads at once, and one GPU runs one prefill at a time anyway. The event loop
only ever waits on an asyncio queue fed from that thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from .cache.kinds import SavePoint
from .logctx import request_id
from .models import LoadedModel
from .prompt import RenderedPrompt
from .types import (
    CacheSource,
    GenerationRequest,
    GenerationResult,
    PromptInfo,
    TokenEvent,
)

log = logging.getLogger("engine_bridge.runner")

# Prefill chunks end on multiples of this (absolute positions), so chunking and thus the
# numerics of a prefill do not depend on where a cache hit happened to start it.
PREFILL_CHUNK = 512


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


class Runner:
    def __init__(
        self,
        loaded: LoadedModel,
        session_factory: Callable[[Job], CacheSession | None] | None = None,
        on_result: Callable[[GenerationResult], None] | None = None,
        executor: ThreadPoolExecutor | None = None,
    ):
        self.loaded = loaded
        self._session_factory = session_factory
        self._on_result = on_result
        self._executor = executor or ThreadPoolExecutor(1, thread_name_prefix="mlx")
        self.queued = 0
        self.last_used = time.monotonic()

    async def run(self, job: Job) -> AsyncIterator[Event]:
        """Queue the job on the MLX thread and yield its events as they come."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event | _Failed | None] = asyncio.Queue()

        def emit(event: Event | _Failed | None) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, event)

        self.queued += 1
        future = loop.run_in_executor(self._executor, self._work, job, emit)
        try:
            while True:
                event = await queue.get()
                if event is None:
                    break
                if isinstance(event, _Failed):
                    raise event.error
                yield event
        finally:
            # A consumer that stops early (client gone) cancels within one decode step.
            job.cancel.set()
            self.queued -= 1
            self.last_used = time.monotonic()
            await asyncio.shield(future)

    def _work(self, job: Job, emit: Callable[[Any], None]) -> None:
        request_id.set(job.request.request_id or "-")
        try:
            if job.cancel.is_set():
                return
            for event in self._generate(job):
                if isinstance(event, GenerationResult) and self._on_result is not None:
                    # Recorded here, not by the consumer, which may have gone away.
                    self._on_result(event)
                emit(event)
        except BaseException as e:  # surfaced on the event loop, not lost in the thread
            log.exception("[%s] generation failed", job.request.request_id)
            emit(_Failed(e))
        finally:
            emit(None)

    def _generate(self, job: Job):
        model = self.loaded.model
        tokens = job.prompt.tokens
        req = job.request
        start = time.perf_counter()

        session = self._session_factory(job) if self._session_factory and req.use_cache else None
        if session is not None:
            cache, position, source = session.restore()
        else:
            cache, position, source = make_prompt_cache(model), 0, "none"
        # `position` advances through the prefill; the hit is where it started.
        cached = position
        yield PromptInfo(len(tokens), cached, source)

        # Prefill all but the last prompt token; the last one yields the first logits.
        stops = _prefill_stops(position, len(tokens) - 1, session)
        for end in stops:
            if job.cancel.is_set():
                break
            model(mx.array(tokens[position:end])[None], cache=cache)
            mx.eval([c.state for c in cache])
            position = end
            if session is not None:
                session.save(cache, tokens, position, SavePoint.PREFILL)
        if job.cancel.is_set():
            yield self._result(job, tokens, [], cached, source, "cancelled", start, None, "")
            return
        if session is not None:
            session.save(cache, tokens, position, SavePoint.PROMPT_END)

        yield from self._decode(job, cache, session, cached, source, start)

    def _decode(self, job, cache, session, cached, source, start):
        model = self.loaded.model
        tokenizer = self.loaded.tokenizer
        req = job.request
        s = req.sampling
        prompt = job.prompt.tokens
        if s.seed is not None:
            mx.random.seed(s.seed)
        sampler = make_sampler(temp=s.temperature, top_p=s.top_p, min_p=s.min_p, top_k=s.top_k)
        processors = (
            make_logits_processors(repetition_penalty=s.repetition_penalty)
            if s.repetition_penalty and s.repetition_penalty != 1.0
            else []
        )
        eos = set(tokenizer.eos_token_ids)
        detok = tokenizer.detokenizer
        detok.reset()
        stopper = _StopMatcher(req.stop)
        history = mx.array(prompt)
        out: list[int] = []
        y = mx.array(prompt[-1:])
        ttft: float | None = None
        finish = "length"
        while len(out) < job.max_tokens:
            if job.cancel.is_set():
                finish = "cancelled"
                break
            logits = model(y[None], cache=cache)[:, -1, :]
            for p in processors:
                logits = p(history, logits)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            token = sampler(logprobs)
            tok = int(token.item())
            if ttft is None:
                ttft = time.perf_counter() - start
            if tok in eos:
                finish = "stop"
                out.append(tok)
                break
            out.append(tok)
            history = mx.concatenate([history, token.reshape(1)])
            y = token.reshape(1)
            detok.add_token(tok)
            text, hit = stopper.feed(detok.last_segment)
            if text:
                yield TokenEvent(text, tok)
            if hit:
                finish = "stop_string"
                break
        if finish not in ("stop_string",):
            detok.finalize()
            tail, _ = stopper.feed(detok.last_segment, final=True)
            if tail:
                yield TokenEvent(tail, out[-1] if out else -1)
        if session is not None and out:
            # The cache holds the prompt plus every generated token but the last, which
            # was sampled and never fed back.
            session.save(cache, prompt + out, len(prompt) + len(out) - 1, SavePoint.GENERATION_END)
        result = self._result(job, prompt, out, cached, source, finish, start, ttft, stopper.text)
        result.stop_string = stopper.matched
        yield result

    def _result(self, job, prompt, out, cached, source, finish, start, ttft, text):
        now = time.perf_counter()
        return GenerationResult(
            prompt_tokens=len(prompt),
            completion_tokens=len(out),
            cached_tokens=cached,
            source=source,
            finish_reason=finish,
            text=text,
            ttft_s=ttft if ttft is not None else now - start,
            generation_s=now - start,
            used_cache=job.request.use_cache and self._session_factory is not None,
        )


def _prefill_stops(start: int, end: int, session: CacheSession | None) -> list[int]:
    """Chunk ends for prefilling [start, end): chunk multiples plus the cache's save points."""
    stops = set(range((start // PREFILL_CHUNK + 1) * PREFILL_CHUNK, end, PREFILL_CHUNK))
    if session is not None:
        stops.update(p for p in session.stop_points() if start < p < end)
    if end > start:
        stops.add(end)
    return sorted(stops)


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
