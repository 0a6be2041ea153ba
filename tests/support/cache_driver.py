"""Drive an in-process Engine for cache tests, and predict the hit the RAM tier must give.

`HitModel` restates the lookup contract (DESIGN.md, "The state layer") from the outside: a
paged-only model resumes at the longest common prefix with anything a request stored; a
model with snapshot layers resumes only at a position where a checkpoint was taken.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mlx_lm.models.cache import make_prompt_cache

from engine_bridge import kv
from engine_bridge.cache.write_policy import SPARSE_PERIODIC_EVERY
from engine_bridge.engine import Engine, EngineSettings
from engine_bridge.scheduling.jobs import Job
from engine_bridge.types import GenerationRequest, GenerationResult, Message, Sampling
from engine_bridge.warm_ahead import WarmAheadSettings

MAX_TOKENS = 16


@dataclass(slots=True)
class Outcome:
    """One greedy request: its prompt tokens, what the cache gave, what it generated."""

    tokens: list[int]
    prompt_text: str
    message_starts: list[int]
    cached: int
    source: str
    out: list[int]
    text: str
    result: GenerationResult
    reached: int = 0  # where a cancelled request's prefill stopped
    reply_opens_at: int | None = None  # where the generation prompt opens <think>
    resume_points: list[int] = field(default_factory=list)  # checkpointed as prefill passes


class Driver:
    """One Engine on one event loop, called synchronously from tests."""

    def __init__(
        self,
        cache_dir: Path,
        models: list[str],
        ram_budget_bytes: int = 1 << 30,
        ssd_enabled: bool = True,
        warm_ahead: bool = False,
    ):
        self.loop = asyncio.Runner()
        self.engine = Engine(
            EngineSettings(
                cache_dir=cache_dir,
                model_specs=list(models),
                ram_budget_bytes=ram_budget_bytes,
                ssd_enabled=ssd_enabled,
                # Off, so each request's hit is what the test predicts (tests/conftest.py).
                warm_ahead=WarmAheadSettings(enabled=warm_ahead),
            )
        )
        self._bypass: dict[str, Outcome] = {}
        # id(request) -> its job, and what its cache session was handed
        self._spies: dict[int, _Spy] = {}

    def close(self) -> None:
        self.loop.run(self.engine.close())
        self.loop.close()

    def generate(
        self,
        model: str,
        messages: list[dict[str, Any]] | None = None,
        *,
        prompt: str | None = None,
        tokens: list[int] | None = None,
        use_cache: bool = True,
        tenant: str = "local",
        max_tokens: int = MAX_TOKENS,
        cancel_at: int | None = None,
    ) -> Outcome:
        """Run one greedy request for chat `messages`, a raw `prompt` or raw `tokens`.

        `cancel_at` cancels it at the first prefill save there or later, as a client that
        disconnects mid-prefill would.
        """
        req = GenerationRequest(
            model=model,
            messages=None if messages is None else [Message.from_template(m) for m in messages],
            prompt=prompt,
            max_tokens=max_tokens,
            sampling=Sampling(temperature=0.0),
            tenant=tenant,
            use_cache=use_cache,
        )
        return self.loop.run(self._run(req, tokens, cancel_at))

    def bypass(self, model: str, messages=None, *, prompt=None, tokens=None) -> Outcome:
        """The uncached answer; greedy decoding is a pure function of the prompt, so memoized."""
        key = json.dumps([model, messages, prompt, tokens], sort_keys=True)
        if key not in self._bypass:
            self._bypass[key] = self.generate(
                model, messages, prompt=prompt, tokens=tokens, use_cache=False
            )
        return self._bypass[key]

    async def _run(
        self, req: GenerationRequest, tokens: list[int] | None, cancel_at: int | None
    ) -> Outcome:
        if tokens is not None:  # token ids no text re-encodes to, e.g. a prompt plus output
            req = replace(req, prompt_tokens=list(tokens))
        _spy_on_saves(await self.engine.models.runner(req.model), self._spies)
        spy = self._spies[id(req)] = _Spy(cancel_at)
        try:
            stream = await self.engine.start(req)
            async for _ in stream:
                pass
        finally:
            del self._spies[id(req)]
        info, result, job = stream.info, stream.result, spy.job
        assert result is not None and job is not None
        if cancel_at is None:
            # Demo models never emit EOS: every request runs to max_tokens.
            assert result.completion_tokens == req.max_tokens, result
        else:
            assert (result.finish_reason, result.completion_tokens) == ("cancelled", 0), result
        assert (result.cached_tokens, result.source) == (info.cached_tokens, info.source)
        return Outcome(
            list(job.prompt.tokens),
            job.prompt.text,
            list(job.prompt.message_starts),
            info.cached_tokens,
            info.source,
            spy.out,
            result.text,
            result,
            spy.reached,
            job.prompt.reply_opens_at,
            job.prompt.resume_points,
        )

    def has_snapshots(self, model: str) -> bool:
        loaded = self.loop.run(self.engine.models.runner(model)).loaded
        return kv.layout(make_prompt_cache(loaded.model)).has_snapshots

    def flush_ssd(self) -> None:
        """Wait until the SSD tier has written everything queued so far."""
        if self.engine.tiers.ssd is not None:
            assert self.engine.tiers.ssd.flush(30.0)


@dataclass(slots=True)
class _Spy:
    cancel_at: int | None
    job: Job | None = None  # what the engine made of the request
    out: list[int] = field(default_factory=list)
    reached: int = 0


def _spy_on_saves(runner: Any, spies: dict[int, _Spy]) -> None:
    """See each request's job (its rendered prompt), and what it hands its cache session:
    events carry text, not token ids."""
    if not getattr(runner.run, "spied", False):
        run = runner.run

        def running(job: Any) -> Any:
            spies[id(job.request)].job = job
            return run(job)  # the runner's own generator: closing it runs its cleanup

        running.spied = True
        runner.run = running
    factory = runner._session_factory
    if factory is None or getattr(factory, "spied", False):
        return

    def spied(job: Any) -> Any:
        session = factory(job)
        if session is None:
            return None
        save = session.save
        spy = spies[id(job.request)]

        def record(cache, tokens, position, reason):
            save(cache, tokens, position, reason)
            if reason == "prefill":
                spy.reached = position
                if spy.cancel_at is not None and position >= spy.cancel_at:
                    job.cancel.set()
            elif reason == "generation_end":
                spy.out = list(tokens)[len(job.prompt.tokens) :]

        session.save = record
        return session

    spied.spied = True
    runner._session_factory = spied


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


@dataclass(slots=True)
class _Stored:
    seq: list[int]  # prompt + generated tokens
    end: int  # the cache holds the state after seq[:end]
    checkpoints: dict[int, str] = field(default_factory=dict)  # position -> reason
    thinned: dict[int, str] = field(default_factory=dict)  # gone from RAM, kept on SSD


class HitModel:
    """What an unbounded cache holds after the cached requests it was told about.

    RAM thins periodic checkpoints; an SSD tier written through keeps every
    `SPARSE_PERIODIC_EVERY`-th of them (once flushed; the others were superseded before
    they were written), and a request that needs one promotes it back to RAM.
    """

    def __init__(self, snapshots: bool, ssd: bool, checkpoint_interval: int = 1024):
        self.snapshots = snapshots
        self.ssd = ssd
        self.interval = checkpoint_interval
        self._stored: list[_Stored] = []

    def expected(self, tokens: list[int]) -> int:
        return self._deepest(tokens, thinned=self.ssd)

    def expected_source(self, tokens: list[int]) -> str:
        hit = self.expected(tokens)
        return "none" if hit == 0 else "ram" if hit == self._deepest(tokens, False) else "ssd"

    def _deepest(self, tokens: list[int], thinned: bool) -> int:
        limit = len(tokens) - 1  # at least one token is always prefilled
        best = 0
        for s in self._stored:
            if self.snapshots:
                for p in [*s.checkpoints, *(s.thinned if thinned else ())]:
                    if best < p <= limit and s.seq[:p] == tokens[:p]:
                        best = p
            else:
                best = max(best, min(common_prefix(s.seq[: s.end], tokens), limit))
        return best

    def record(self, o: Outcome) -> None:
        """Prefill pauses at message starts and every `interval` tokens past the restored
        position; those pauses, the prompt's end and the generation's end are checkpoints."""
        n = len(o.tokens)
        seq = o.tokens + o.out
        if o.source == "ssd":
            for s in self._stored:
                if o.cached in s.thinned and s.seq[: o.cached] == seq[: o.cached]:
                    s.checkpoints[o.cached] = s.thinned.pop(o.cached)
        if o.result.finish_reason == "cancelled":
            end, last = o.reached, []
        else:
            assert len(o.out) == o.result.completion_tokens > 0, "record cached requests only"
            end = n + len(o.out) - 1
            last = [(n - 1, "prompt_end"), (end, "generation_end")]
            if o.reply_opens_at is not None and self.snapshots:
                last = last[1:]  # the checkpoint where the reply opened <think> stands for it
        starts = o.resume_points
        pauses = [(p, "boundary") for p in starts if o.cached < p <= end and p < n - 1]
        periodic = range(self.interval, min(end + 1, n - 1), self.interval)
        pauses += [(p, "periodic") for p in periodic if p > o.cached]
        stored = _Stored(seq, end)
        self._stored.append(stored)
        for p, reason in sorted(pauses, key=lambda x: (x[0], x[1] == "periodic")) + last:
            self._insert(stored, p, reason)

    def _insert(self, stored: _Stored, q: int, reason: str) -> None:
        # An existing checkpoint on the path wins; a boundary upgrades a periodic one.
        # Inserting one drops the periodic checkpoints before it on its path (thinning).
        for s in self._stored:
            for p, r in list(s.checkpoints.items()):
                if s.seq[:p] != stored.seq[:p]:
                    continue
                if p < q and r == "periodic":
                    s.checkpoints.pop(p)
                    if p % (self.interval * SPARSE_PERIODIC_EVERY) == 0:
                        s.thinned[p] = r
                elif p == q and r == "periodic" and reason != "periodic":
                    s.checkpoints[p] = reason
        if not any(q in s.checkpoints and s.seq[:q] == stored.seq[:q] for s in self._stored):
            stored.checkpoints[q] = reason
