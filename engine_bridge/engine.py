"""The engine facade proxy/ talks to: which models are local, start a generation, probe,
warm, stats. What it hands out is neutral (types.py, stream.py): no runner, no job."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any

from . import cache_probe, kv
from .cache.ram.manager import CacheManager
from .cache.ssd.store import SSDConfig, SSDStore
from .cache.tiers import TieredCache
from .cache.write_policy import SPARSE_PERIODIC_EVERY
from .engine_settings import EngineSettings  # callers import it with Engine, from here
from .models import discovery
from .models import loading as models
from .models.demo import DEMO_MODEL_IDS
from .models.preflight import Preflight
from .ops import heap
from .ops.memory import HEAP_TRIM_S, MemoryGuard, default_kv_memory, mlx_memory, release_memory
from .ops.request_log import RequestLog
from .ops.request_stats import RequestStats
from .prompt_cache import ModelCache
from .prompting import template_flags
from .prompting.render import RenderedPrompt, render_chat, render_completion
from .scheduling.forced_output import ForcedOutputs
from .scheduling.output_rules import output_rule
from .scheduling.runner import Job, Runner
from .scheduling.scheduler import Scheduler, SchedulerSettings
from .served import ServedModels
from .sessions.admin import SessionAdmin
from .sessions.catalog import ClientSessions
from .stream import GenerationStream
from .turns import Turns, rendered_tools
from .types import (
    EngineError,
    GenerationFailed,
    GenerationRequest,
    GenerationResult,
    ModelInfo,
    ProbeResult,
    PromptInfo,
    WarmResult,
)
from .vision import prompt as vision_prompt
from .warm_ahead import WarmAhead

log = logging.getLogger("engine_bridge.engine")


def _vocab_size(config: dict) -> int | None:
    """The embedding's row count, from the model's config (nested for vision models)."""
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return int(size) if isinstance(size, int) else None


class Engine:
    def __init__(self, settings: EngineSettings):
        self.settings = settings
        heap.tune()  # glibc: MLX's buffers in mmapped chunks, not fragmenting the heap
        self._served = ServedModels()  # the models served here, loaded or not
        # Every tokenizer call runs on this one thread. Hugging Face tokenizers keep a BPE
        # word cache per thread, so on the shared pool each of its threads filled its own:
        # the load soak's RSS crept ~5 MB a minute until all of them were full.
        self._tokenize_pool = concurrent.futures.ThreadPoolExecutor(1, "tokenize")
        self.requests = RequestStats()
        # The last requests with why each missed, and the hit-ratio alert.
        self.request_log = RequestLog(settings.alert_hit_ratio)
        self._forced = ForcedOutputs.from_env()  # tests only
        self._caches: dict[str, ModelCache] = {}  # each loaded model's prompt cache
        # Template defaults and dropped reasoning before a render; after a turn, its
        # reasoning kept and the next question's prefix warmed while idle.
        self.warm_ahead = WarmAhead(self, settings.warm_ahead)
        self.turns = Turns(settings, self.warm_ahead, self._tokenize_pool)
        # Awaited before a model loads in-process, with what is about to load: the proxy
        # asks LM Studio to let go of its own copy of the same weights (proxy/upstream/lmstudio_rest.py).
        self.before_load: Callable[[models.ModelRef], Awaitable[None]] | None = None
        # Called with every finished request (on the MLX thread): metrics, request logs.
        self.result_listeners: list[Callable[[GenerationRequest, GenerationResult], None]] = []
        # The one thread that runs MLX work (loading, prefill, decode) for every model.
        self.scheduler = Scheduler(
            SchedulerSettings(
                max_batch=settings.max_batch,
                max_queue=settings.max_queue,
                prefill_chunk=settings.prefill_chunk,
                kv_memory_bytes=settings.kv_memory_bytes or default_kv_memory(settings),
                speculation=settings.speculation,
            )
        )
        ssd = None
        if settings.cache_enabled and settings.ssd_enabled:
            ssd = SSDStore(
                SSDConfig(
                    root=settings.cache_dir,
                    max_bytes=settings.ssd_max_bytes,
                    ttl_s=settings.ssd_ttl_s,
                    queue_size=settings.ssd_queue_size,
                    max_write_per_day=settings.ssd_max_write_per_day,
                )
            )
        shared = None
        if settings.cache_enabled and settings.shared is not None:
            # Imports redis (the shared extra): only when [cache.shared] url is set.
            from .cache.shared.store import SharedStore
            from .cache.shared.tier import SharedTier

            shared = SharedTier(SharedStore(settings.shared))
        # One set of tiers for every model: the budget is the machine's, not a model's.
        self.tiers = TieredCache(
            CacheManager(settings.ram_budget_bytes, block_size=settings.cache_policy.block_size),
            ssd,
            kv.HostCodec(),
            write_through=settings.ssd_write_through,
            policy=settings.ssd_write_policy,
            checkpoint_delay_s=settings.ssd_checkpoint_delay_s,
            periodic_write_every=settings.cache_policy.checkpoint_interval * SPARSE_PERIODIC_EVERY,
            shared=shared,
        )
        # Held-back checkpoint writes that come due between requests go out on the MLX thread.
        self.tiers.call_on_mlx = self.scheduler.call
        self.memory = MemoryGuard(self.tiers, settings)
        self.preflight = Preflight(settings, self.scheduler, self.tiers)
        self.sessions = ClientSessions(
            self.tiers,
            pin_max_bytes=settings.pin_max_bytes or settings.ram_budget_bytes // 4,
            ttl_s=settings.session_ttl_s,
            # Kept across restarts with the SSD tier it describes.
            store_dir=settings.cache_dir if ssd is not None else None,
        )
        self.session_admin = SessionAdmin(self.sessions, self._on_mlx, self._served)
        specs = list(settings.model_specs)
        if settings.serve_all_mlx:
            specs += [
                str(m.path) for m in discovery.scan(settings.lmstudio_dirs) if m.format == "mlx"
            ]
        for spec in specs or DEMO_MODEL_IDS:
            ref = models.resolve(spec, settings.cache_dir, settings.lmstudio_dirs)
            self._served.add(ref)

    @property
    def model_ids(self) -> list[str]:
        return self._served.ids()

    def has_model(self, model_id: str) -> bool:
        return model_id in self._served

    def loaded(self, model_id: str) -> models.LoadedModel | None:
        """`model_id`'s loaded model (tokenizer, weights, config); None while not loaded."""
        entry = self._served.get(model_id)
        return entry.loaded if entry is not None else None

    async def load(self, model_id: str) -> models.LoadedModel:
        """Load `model_id` now, as its first request would (a 404 if not served here)."""
        return (await self.runner(model_id)).loaded

    async def runner(self, model_id: str) -> Runner:
        entry = self._served.require(model_id)
        if entry.runner is None:
            async with self._served.lifecycle:  # one load or unload at a time (served.py)
                if entry.runner is None:
                    entry.runner = await self._load(entry.ref)
        # Marks the model busy for the idle janitor before any await can intervene.
        entry.runner.last_used = time.monotonic()
        return entry.runner

    async def _load(self, ref: models.ModelRef) -> Runner:
        """Load `ref` (the lifecycle lock held) and add its runner to the scheduler."""
        if self.before_load is not None:
            await self.before_load(ref)
        if self.settings.memory_preflight:
            await self._make_room(ref)
        loaded = await self._on_mlx(models.load, ref)
        if loaded.vision is not None and self.settings.cache_enabled:
            features = loaded.vision.feature_cache
            features.bind(self.tiers.ram, self.tiers.ssd, loaded.fingerprint, self.tiers.shared)
        runner = Runner(
            loaded,
            self.scheduler,
            self._session_factory(loaded),
            on_result=self._record,
            on_done=functools.partial(self._on_done, loaded),
        )
        self.scheduler.add(runner)
        return runner

    async def _make_room(self, ref: models.ModelRef) -> None:
        """Load only what fits: unload idle models for room, else refuse (preflight.py)."""
        # Off the event loop: it reads the system's memory and stats the weights' files.
        plan = await asyncio.to_thread(self.preflight.check, ref)
        unloaded: list[str] = []
        if not plan.fits:
            await self.warm_ahead.stop_current()  # it holds its model busy
            unloaded = await self._unload_idle(0.0, keep=ref.id)
            if unloaded:
                plan = await asyncio.to_thread(self.preflight.check, ref)
        if not plan.fits:
            message = plan.refusal(unloaded)
            log.warning("%s", message)
            raise EngineError(message, field="model", status=503)
        await self._on_mlx(self.preflight.apply, plan)
        log.info("loading %s: %s", ref.id, plan.figures())

    def _record(self, req: GenerationRequest, result: GenerationResult) -> None:
        self.requests.record(result)
        for listener in self.result_listeners:
            try:
                listener(req, result)
            except Exception:  # a listener's bug must not fail the request it observes
                log.exception("result listener %r failed", listener)

    def _on_done(self, loaded: models.LoadedModel, seq, result: GenerationResult) -> None:
        self.request_log.on_done(seq, result)
        self.turns.ended(loaded, seq.job, result, seq.out)

    async def unload_idle(self, idle_s: float) -> list[str]:
        """Unload models unused for `idle_s` seconds; their cache stays on SSD (and in RAM)."""
        async with self._served.lifecycle:
            return await self._unload_idle(idle_s)

    async def _unload_idle(self, idle_s: float, keep: str | None = None) -> list[str]:
        """`unload_idle` with the lifecycle lock held, sparing `keep` (the model loading)."""
        now, unloaded = time.monotonic(), []
        idle = self._served.take_idle(idle_s, keep)
        while idle:
            model_id, runner = idle.pop(0)
            self.scheduler.remove(runner)
            # The prompt cache's ModelCache holds the LoadedModel; its blocks and
            # checkpoints live in the shared tiers, keyed by the model's fingerprint,
            # and a reload makes a new ModelCache over them.
            self._caches.pop(model_id, None)
            idle_for = now - runner.last_used
            if runner.loaded.vision is not None:
                runner.loaded.vision.feature_cache.unbind()  # its RAM goes back to the budget
            del runner  # the last reference: the weights go with it (test_idle_unload)
            await self._on_mlx(release_memory)
            log.info("unloaded %s after %.0fs idle", model_id, idle_for)
            unloaded.append(model_id)
        return unloaded

    async def janitor(self) -> None:
        """Background upkeep while serving: memory, idle models, idle sessions."""
        await asyncio.gather(self._memory_janitor(), self.session_admin.upkeep())

    async def _memory_janitor(self) -> None:
        """The memory guard, and idle unloading."""
        idle = self.settings.idle_unload_s
        guard = self.settings.ram_min_available_bytes is not None and self.settings.cache_enabled
        if not idle and not guard:
            return
        idle_period = max(1.0, min(30.0, idle / 4)) if idle else 0.0
        period = self.settings.memory_check_s if guard else idle_period
        last_idle_check = last_trim = time.monotonic()
        while True:
            await asyncio.sleep(period)
            if guard:
                # On the MLX thread: a shrink evicts, and a spill turns arrays into bytes,
                # which MLX only does on the thread that owns their stream.
                await self._on_mlx(self.memory.check)
                if time.monotonic() - last_trim >= HEAP_TRIM_S:
                    last_trim = time.monotonic()
                    await asyncio.to_thread(heap.trim)
            if idle and time.monotonic() - last_idle_check >= idle_period:
                last_idle_check = time.monotonic()
                await self.unload_idle(idle)

    def _session_factory(self, loaded: models.LoadedModel):
        if not self.settings.cache_enabled:
            return None
        try:
            cache = ModelCache(loaded, self.tiers, self.settings.cache_policy, self.sessions)
        except kv.UnsupportedCacheError as e:
            log.warning("prompt cache off for %s: %s", loaded.id, e)
            return None
        self._caches[loaded.id] = cache
        return cache.session

    def model_cache(self, model_id: str) -> ModelCache | None:
        """The prompt cache of a loaded model; None when it has none (or is not loaded)."""
        entry = self._served.get(model_id)
        return self._caches.get(model_id) if entry and entry.runner else None

    async def probe(self, req: GenerationRequest) -> ProbeResult:
        """What `req` would restore from RAM and SSD, without running the model."""
        _, job = await self._prepare(req)
        cache = self.model_cache(req.model) if req.use_cache else None
        return await cache_probe.probe(req, job, cache, self._on_mlx)

    async def warm(self, req: GenerationRequest) -> WarmResult:
        """Prefill and store `req`'s prompt, generating nothing."""
        return await cache_probe.warm(self, req, self.settings.cache_enabled)

    async def _prepare(
        self, req: GenerationRequest, rendered: RenderedPrompt | None = None
    ) -> tuple[Runner, Job]:
        """Tokenize and validate; every client mistake surfaces here, before streaming.
        `rendered`: the prompt, already rendered (warming ahead)."""
        runner = await self.runner(req.model)
        loaded = runner.loaded
        if req.messages is not None:
            req = await self._tokenize(self.turns.prepare, loaded, req)
        if rendered is not None:
            prompt = rendered
        elif req.prompt_tokens is not None:
            vocab = _vocab_size(loaded.config)
            bad = [t for t in req.prompt_tokens if not 0 <= t < (vocab or 1 << 62)]
            if bad:
                raise EngineError(
                    f"token id {bad[0]} is outside the model's vocabulary of {vocab} tokens",
                    field="prompt",
                )
            text = await self._tokenize(loaded.tokenizer.decode, req.prompt_tokens)
            prompt = RenderedPrompt(list(req.prompt_tokens), text, [0], [0])
        elif req.messages is not None:
            prompt = await self._render_chat(loaded, req)
        else:
            prompt = await self._tokenize(render_completion, loaded.tokenizer, req.prompt or "")
        n = len(prompt.tokens)
        ctx = loaded.context_length
        if n == 0:
            raise EngineError("the prompt is empty after tokenization", field="prompt")
        if n >= ctx:
            raise EngineError(
                f"the prompt is {n} tokens, longer than the model's context of {ctx} tokens",
                field="messages" if req.messages is not None else "prompt",
            )
        if req.max_tokens > ctx:
            raise EngineError(
                f"max_tokens {req.max_tokens} exceeds the model's context of {ctx} tokens",
                field="max_tokens",
            )
        # Past the context there is nowhere to put a token: stop there with "length".
        max_tokens = min(req.max_tokens, ctx - n)
        fmt = loaded.output_format
        rule = output_rule(
            loaded.tokenizer,
            fmt,
            req.tool_choice,
            has_tools=bool(req.tools),
            opens_in_reasoning=fmt.opens_in_reasoning(prompt.text),
            forced_text=self._forced.pick(prompt.text) if self._forced else None,
        )
        return runner, Job(req, prompt, max_tokens, rule=rule)

    async def start(self, req: GenerationRequest) -> GenerationStream:
        """Validate, queue and look up `req`; returns once its cache hit is known.

        Raises `EngineError` for a request the engine refuses (a 4xx, 429 when the queue is
        full) and `GenerationFailed` when the engine fails before the first event.
        """
        self.turns.loop = asyncio.get_running_loop()
        self.warm_ahead.preempt()  # the machine is the request's now
        return await self._start(req)

    async def _start(
        self, req: GenerationRequest, rendered: RenderedPrompt | None = None
    ) -> GenerationStream:
        # Claimed until the job is queued (then it counts in `active_jobs`): unloading the
        # runner while the prompt renders would strand the job on it.
        with self._served.claim(req.model):
            return await self._launch(*await self._prepare(req, rendered))

    async def _launch(self, runner: Runner, job: Job) -> GenerationStream:
        req = job.request
        # The runner's own generator, not a wrapper: closing it must run its cleanup (cancel,
        # then wait until the scheduler let go) now, not whenever a wrapper is collected.
        events = runner.run(job)
        try:
            first = await anext(events)
        except EngineError:
            await events.aclose()
            raise
        except Exception as e:
            await events.aclose()
            raise GenerationFailed(f"generation failed: {e}") from e
        assert isinstance(first, PromptInfo), f"the runner reports the prompt first: {first!r}"
        choice = req.tool_choice
        return GenerationStream(
            first,
            events,
            context_length=runner.loaded.context_length,
            output=functools.partial(
                runner.loaded.output_format.parser,
                prompt_text=job.prompt.text,
                tools=req.tools if choice.mode != "none" else None,
                parallel=choice.parallel,
            ),
            use_cache=req.use_cache,
        )

    def model_info(self, model_id: str) -> ModelInfo:
        return self._served.require(model_id).info()

    async def count_tokens(self, req: GenerationRequest) -> int:
        runner = await self.runner(req.model)
        req = await self._tokenize(self.turns.prepare, runner.loaded, req)
        return len((await self._render_chat(runner.loaded, req)).tokens)

    def template_defaults(self, model_id: str) -> dict[str, Any]:
        """The chat template kwargs the engine sets for `model_id` unless a request or its
        settings do: `preserve_thinking` where the template reads it. Read from the
        model's files when it is not loaded."""
        entry = self._served.require(model_id)
        if entry.loaded is not None:
            return self.turns.template_defaults(entry.loaded)
        return template_flags.default_kwargs(models.chat_template_text(entry.ref.path))

    # -- warming ahead (warm_ahead.py) ----------------------------------------------------

    def idle_s(self) -> float:
        return self._served.idle_s()

    def warm_room_tokens(self, model_id: str, share: float) -> int | None:
        """How many new tokens of `model_id` fit in `share` of the RAM tier's budget;
        None before a prefill taught the runner its bytes per token."""
        entry = self._served.get(model_id)
        per_token = entry.runner.bytes_per_token if entry and entry.runner else 0.0
        if per_token <= 0:
            return None
        if self.memory.pressure.active:
            return 0  # the guard is shrinking the tier: nothing ahead of need
        return int(self.tiers.ram.budget_bytes * share / per_token)

    async def probe_prompt(self, req: GenerationRequest, prompt: RenderedPrompt) -> ProbeResult:
        if self.loaded(req.model) is None:
            raise EngineError(f"{req.model} is not loaded", status=409)
        _, job = await self._prepare(req, prompt)
        return await cache_probe.probe(req, job, self.model_cache(req.model), self._on_mlx)

    async def start_prompt(
        self, req: GenerationRequest, prompt: RenderedPrompt
    ) -> GenerationStream:
        """Start `req` on a prompt already rendered; it preempts nothing."""
        return await self._start(req, prompt)

    async def _render_chat(
        self, loaded: models.LoadedModel, req: GenerationRequest
    ) -> RenderedPrompt:
        images = vision_prompt.images_of(req.messages)
        limits = self.settings.vision_limits
        if images:
            vision_prompt.check_model(loaded, images)
            vision_prompt.check_count(images, limits)
        prompt = await self._tokenize(
            render_chat,
            loaded.tokenizer,
            req.messages or [],
            rendered_tools(loaded, req),
            req.template_kwargs,
            self.settings.normalization,
            loaded.prefixes,
        )
        if images:
            assert loaded.vision is not None
            prompt = await self._tokenize(
                vision_prompt.attach, prompt, images, loaded.vision.spec, limits, req.tenant
            )
        return prompt

    def stats(self) -> dict:
        """What /v1/cache/stats shows: requests, then every tier's counters as they are."""
        req = asdict(self.requests) | {"hit_ratio": self.requests.hit_ratio}
        return {
            "requests": req,
            "hits": req["hits"],
            "misses": req["misses"],
            "hit_ratio": req["hit_ratio"],
            "cache_enabled": self.settings.cache_enabled,
            "scheduler": self.scheduler.stats.to_json(),
            "memory": asdict(self.memory.pressure) | mlx_memory() | self.preflight.stats(),
            **asdict(self.tiers.stats()),
            "models": self.model_ids,
            "vision": self._served.vision_stats(),
            "alert": self.request_log.alert_state(),
            "warm_ahead": self.warm_ahead.stats(),
            "reasoning_memo": asdict(self.turns.reasoning.stats()),
        }

    async def _on_mlx(self, fn, *args):
        return await self.scheduler.run(fn, *args)

    async def _tokenize(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, *args)

    async def close(self) -> None:
        await self.warm_ahead.close()
        # Cancels what is running or queued; each cancelled request still saves its cache.
        await asyncio.to_thread(self.scheduler.close)
        # Drain queued writes (bounded), so a clean shutdown loses nothing computed.
        await asyncio.to_thread(self.tiers.close, self.settings.ssd_drain_s)
        await asyncio.to_thread(self.sessions.close)
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
