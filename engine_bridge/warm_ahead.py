"""Warm the next question while the person reads the answer.

A template that drops earlier reasoning without a flag to keep it re-renders the whole
last task once a new question comes, and the prompt leaves the cache at the task's first
assistant turn. When a turn ends with an answer (no call), the engine offers here how to
render the prefix the next question will have (`prompting/next_turn.py`). Once the machine
has had no request for a second, the newest offer is rendered, then prefilled and stored
like a warm-up (`prefill_only`); any request that starts preempts it at the next scheduler
step, and what it had stored stays. Bounded by sessions waiting, prefilled tokens per
minute and RAM.

The render waits for the idle second too: it renders the whole conversation on the
engine's one tokenize thread, and an agent's next request, which comes at once, would wait
behind it for its own render (tens of milliseconds on a long session, on every turn).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

from .engine_settings import WarmAheadSettings
from .types import EngineError, GenerationRequest, ProbeResult

if TYPE_CHECKING:
    from .prompting.render import RenderedPrompt
    from .stream import GenerationStream

log = logging.getLogger("engine_bridge.warm_ahead")

# How often a waiting offer looks for an idle machine.
IDLE_POLL_S = 0.05


@dataclass(slots=True)
class WarmAheadStats:
    offered: int = 0  # turns that ended with an answer: a prefix to warm
    warmed: int = 0  # warm-ups that stored their whole prefix
    tokens: int = 0  # tokens prefilled ahead (preempted ones included)
    already_cached: int = 0  # offers the cache held already (append-only history)
    preempted: int = 0  # warm-ups a request interrupted
    dropped: int = 0  # offers pushed out by newer sessions' or given up after retries
    over_budget: int = 0  # offers skipped for the token rate or RAM
    failed: int = 0
    prefill_s: float = 0.0  # spent prefilling ahead


@dataclass(slots=True)
class WarmOffer:
    model: str
    tenant: str
    session: str
    # Renders the next question's prefix (None: it starts inside a token, nothing to warm),
    # called once the warm-up is due; `prompt` keeps it for a retry after a preemption.
    render: Callable[[], Awaitable[RenderedPrompt | None]]
    # What tells the session's offers apart: its id, else its conversation.
    lane: str = ""
    tries: int = 0
    prompt: RenderedPrompt | None = None

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.tenant, self.model, self.lane or self.session)


class Engine(Protocol):
    """What warming ahead asks of the engine (engine.py's Engine)."""

    def idle_s(self) -> float: ...

    def warm_room_tokens(self, model: str, share: float) -> int | None: ...

    async def probe_prompt(self, req: GenerationRequest, prompt: RenderedPrompt) -> ProbeResult: ...

    async def start_prompt(
        self, req: GenerationRequest, prompt: RenderedPrompt
    ) -> GenerationStream: ...


class WarmAhead:
    """Offers by session, newest first; one warm-up at a time, on the event loop."""

    def __init__(self, engine: Engine, settings: WarmAheadSettings):
        self.engine = engine
        self.settings = settings
        self._stats = WarmAheadStats()
        self._offers: OrderedDict[tuple[str, str, str], WarmOffer] = OrderedDict()
        self._wake = asyncio.Event()
        self._current: asyncio.Task | None = None
        self._worker: asyncio.Task | None = None
        self._bucket = float(settings.tokens_per_minute)
        self._bucket_at = time.monotonic()
        self._seq = 0
        self.closed = False

    # -- event-loop side -------------------------------------------------------------------

    def offer(self, offer: WarmOffer) -> None:
        """A session's next-question prefix; replaces that session's earlier offer."""
        if not self.settings.enabled or self.closed:
            return
        key = offer.key
        self._stats.offered += 1
        self._offers.pop(key, None)
        self._offers[key] = offer
        while len(self._offers) > self.settings.max_sessions:
            self._offers.popitem(last=False)
            self._stats.dropped += 1
        self._ensure_worker()
        self._wake.set()

    def preempt(self) -> None:
        """A request starts: the warm-up in progress stops at the next scheduler step."""
        task = self._current
        if task is not None and not task.done():
            task.cancel()

    async def stop_current(self) -> None:
        """Preempt, and wait until the warm-up let go of its model (before an unload)."""
        task = self._current
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task})

    @property
    def running(self) -> bool:
        return self._current is not None and not self._current.done()

    @property
    def pending(self) -> int:
        return len(self._offers) + self.running

    def stats(self) -> dict[str, Any]:
        return asdict(self._stats) | {
            "enabled": self.settings.enabled,
            "pending": self.pending,
            "running": self.running,
            "max_sessions": self.settings.max_sessions,
            "max_tokens_per_minute": self.settings.tokens_per_minute,
        }

    async def close(self) -> None:
        self.closed = True
        self._offers.clear()
        for task in (self._current, self._worker):
            if task is not None:
                task.cancel()
        for task in (self._current, self._worker):
            if task is not None:
                try:
                    await task
                except BaseException:  # cancelled, or already failed and logged
                    pass

    def _ensure_worker(self) -> None:
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(self._run(), name="warm-ahead")

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._offers:
                if self.engine.idle_s() < self.settings.after_idle_s:
                    await asyncio.sleep(IDLE_POLL_S)
                    continue
                _, offer = self._offers.popitem(last=True)
                task = asyncio.get_running_loop().create_task(self._warm(offer))
                self._current = task
                try:
                    # Waits without taking the task's cancellation (a preemption) as its own.
                    await asyncio.wait({task})
                finally:
                    self._current = None
                if task.cancelled():
                    self._requeue(offer)
                elif task.exception() is not None:
                    self._stats.failed += 1
                    log.error(
                        "warming ahead for session %r failed",
                        offer.session,
                        exc_info=task.exception(),
                    )

    def _requeue(self, offer: WarmOffer) -> None:
        self._stats.preempted += 1
        offer.tries += 1
        if offer.tries > self.settings.retries:
            self._stats.dropped += 1
            return
        key = offer.key
        self._offers.setdefault(key, offer)  # a newer offer of the session wins
        self._offers.move_to_end(key, last=False)  # behind offers not yet tried

    async def _warm(self, offer: WarmOffer) -> None:
        if offer.prompt is None:
            offer.prompt = await offer.render()
        if offer.prompt is None:
            log.debug("the next question of session %r starts inside a token: nothing to warm",
                      offer.session)  # fmt: skip
            self._stats.dropped += 1
            return
        self._seq += 1
        req = GenerationRequest(
            model=offer.model,
            prompt_tokens=offer.prompt.tokens,
            max_tokens=1,
            tenant=offer.tenant,
            session=offer.session,
            request_id=f"warm-ahead-{self._seq}",
            prefill_only=True,
            speculative=False,
        )
        try:
            probe = await self.engine.probe_prompt(req, offer.prompt)
        except EngineError as e:  # the model was unloaded since: never load one for this
            log.info("not warming ahead for session %r: %s", offer.session, e.message)
            self._stats.dropped += 1
            return
        new = probe.recompute_tokens - 1  # the last token is the question's to prefill
        if new < self.settings.min_tokens:
            self._stats.already_cached += 1
            return
        room = self.engine.warm_room_tokens(offer.model, self.settings.max_ram_share)
        # The RAM share first: a warm-up it refuses must not spend the token budget.
        over = "RAM share" if room is not None and new > room else None
        if over is None and not self._take_budget(new):
            over = "tokens-per-minute budget"
        if over is not None:
            self._stats.over_budget += 1
            log.info("not warming ahead %d tokens for session %r: over the %s",
                     new, offer.session, over)  # fmt: skip
            return
        t0 = time.perf_counter()
        stream = await self.engine.start_prompt(req, offer.prompt)
        try:
            async for _ in stream:
                pass
        finally:
            await stream.aclose()
            done = stream.result
            prefilled = done.prefilled_tokens if done is not None else 0
            self._stats.tokens += prefilled
            self._stats.prefill_s += time.perf_counter() - t0
        self._stats.warmed += 1
        log.info(
            "warmed ahead %d tokens of %s for session %r in %.2fs: the next question's prefix "
            "(%d tokens) is cached",
            prefilled,
            offer.model,
            offer.session,
            time.perf_counter() - t0,
            len(offer.prompt.tokens) - 1,
        )

    def _take_budget(self, tokens: int) -> bool:
        rate = self.settings.tokens_per_minute
        now = time.monotonic()
        self._bucket = min(float(rate), self._bucket + (now - self._bucket_at) * rate / 60.0)
        self._bucket_at = now
        if tokens > self._bucket:
            return False
        self._bucket -= tokens
        return True
