"""The engine facade proxy/ talks to: which models are local, start a generation, probe,
warm, the client sessions, the request log, stats. What it hands out is neutral (types.py,
stream.py, plain records): no runner, no job, no cache object.

The work is done by the parts it builds: `served.ModelLifecycle` (loading, unloading, the
memory guard), `prepare.Preparer` (render, tokenize, check), the scheduler and the tiers.
A request enters once, through `start` (or `probe`, `warm`, `count_tokens`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import threading
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from . import cache_probe, kv
from .cache.ram.manager import CacheManager
from .cache.session_registry import SessionRecord
from .cache.ssd.store import SSDConfig, SSDStore
from .cache.tiers import TieredCache
from .cache.write_policy import SPARSE_PERIODIC_EVERY
from .distributed.figures import RankFigures
from .distributed.world import ALONE, World, join
from .engine_settings import EngineSettings  # callers import it with Engine, from here
from .models import discovery
from .models import loading as models
from .models.demo import DEMO_MODEL_IDS
from .ops import diagnosis_report, heap
from .ops.memory import default_kv_memory, mlx_memory
from .ops.request_log import RequestLog, RequestRecord
from .ops.request_stats import RequestStats
from .prepare import Preparer
from .prompting import template_flags
from .prompting.render import RenderedPrompt
from .scheduling.runner import Job, Runner
from .scheduling.scheduler import Scheduler, SchedulerSettings
from .served import ModelLifecycle
from .sessions.admin import Deleted, SessionAdmin
from .sessions.catalog import ClientSessions, Freed, SessionView
from .stream import GenerationStream
from .turns import Turns
from .types import (
    EngineError,
    EngineHalted,
    GenerationFailed,
    GenerationRequest,
    GenerationResult,
    MissReason,
    ModelInfo,
    ProbeResult,
    PromptInfo,
    WarmResult,
)
from .warm_ahead import WarmAhead

log = logging.getLogger("engine_bridge.engine")

RANK_FIGURES_S = 10.0  # how often rank 0 gathers what each rank holds, while serving


class Engine:
    """The composition root and the facade: it builds the scheduler, the tiers, the model
    lifecycle and request preparation, and answers the proxy's calls by delegating."""

    def __init__(self, settings: EngineSettings):
        if settings.world is None and settings.split_mode is not None:
            # Started by mlx.launch as one rank of a split model: join the others.
            settings = dataclasses.replace(settings, world=join(settings.split_mode))
        self.settings = settings
        self.world: World = settings.world or ALONE
        heap.tune()  # glibc: MLX's buffers in mmapped chunks, not fragmenting the heap
        # Every tokenizer call runs on this one thread. Hugging Face tokenizers keep a BPE
        # word cache per thread, so on the shared pool each of its threads filled its own:
        # the load soak's RSS crept ~5 MB a minute until all of them were full.
        self._tokenize_pool = concurrent.futures.ThreadPoolExecutor(1, "tokenize")
        self.requests = RequestStats()
        # The last requests with why each missed, and the hit-ratio alert.
        self.request_log = RequestLog(settings.alert_hit_ratio)
        # Template defaults and dropped reasoning before a render; after a turn, its
        # reasoning kept and the next question's prefix warmed while idle.
        self.warm_ahead = WarmAhead(self, settings.warm_ahead)
        self.turns = Turns(settings, self.warm_ahead, self._tokenize_pool)
        self.prepare = Preparer(settings, self.turns, self._tokenize_pool)
        # Called with every finished request (on the MLX thread): metrics, request logs.
        self._listeners: list[Callable[[GenerationRequest, GenerationResult], None]] = []
        # The one thread that runs MLX work (loading, prefill, decode) for every model.
        self.scheduler = Scheduler(
            SchedulerSettings(
                max_batch=settings.max_batch,
                max_queue=settings.max_queue,
                prefill_chunk=settings.prefill_chunk,
                kv_memory_bytes=settings.kv_memory_bytes or default_kv_memory(settings),
                speculation=settings.speculation,
            ),
            settings.world,
            settings.rank_deadline_s,
        )
        # One set of tiers for every model: the budget is the machine's, not a model's.
        self.tiers = _tiers(settings, self.cache_root)
        # Held-back checkpoint writes that come due between requests go out on the MLX thread.
        self.tiers.call_on_mlx = self.scheduler.call
        self.sessions = ClientSessions(
            self.tiers,
            pin_max_bytes=settings.pin_max_bytes or settings.ram_budget_bytes // 4,
            ttl_s=settings.session_ttl_s,
            # Kept across restarts with the SSD tier it describes.
            store_dir=self.cache_root if self.tiers.ssd is not None else None,
        )
        self.models = ModelLifecycle(
            settings,
            self.scheduler,
            self.tiers,
            self.sessions,
            on_result=self._record,
            on_done=self._on_done,
            before_room=self.warm_ahead.stop_current,
            diagnosis=self.request_log.diagnosis,
        )
        # Across ranks: what each rank's slices hold, gathered on rank 0 (figures.py).
        self.figures: RankFigures | None = None
        if not self.world.alone:
            self.figures = RankFigures(self.world, self._rank_memory, self._rank_disk)
            self.scheduler.handlers["rank_figures"] = self.figures.gather
        self._session_admin = SessionAdmin(self.sessions, self.scheduler.run, self.models.table)
        self.scheduler.handlers["forget"] = self._forget_here
        specs = list(settings.model_specs)
        if settings.serve_all_mlx:
            specs += [
                str(m.path) for m in discovery.scan(settings.lmstudio_dirs) if m.format == "mlx"
            ]
        for spec in specs or DEMO_MODEL_IDS:
            ref = models.resolve(spec, settings.cache_dir, settings.lmstudio_dirs)
            if not self.world.alone:
                models.check_split(ref, self.world)  # refused at start, naming it
            self.models.table.add(ref)

    @property
    def cache_root(self) -> Path:
        """Where this process keeps its SSD tier and session records: the cache dir, or for
        a rank past the first, `rank<N>` inside it (ranks that share a disk keep apart)."""
        root, world = self.settings.cache_dir, self.world
        return root if world.leader else root / f"rank{world.rank}"

    async def rank_stats(self) -> list[dict[str, Any]] | None:
        """What each rank of a split model holds now, by rank; None alone."""
        if self.figures is None:
            return None
        return await self.scheduler.run_shared("rank_figures")

    async def _gather_ranks(self) -> None:
        while self.halted() is None:
            await asyncio.sleep(RANK_FIGURES_S)
            await self.rank_stats()

    def _rank_memory(self) -> dict[str, Any]:
        """This rank's slices in its RAM tier, its live K/V and MLX memory (no I/O)."""
        ram = self.tiers.ram.stats()
        return {
            "ram_bytes": ram.bytes,
            "ram_blocks": ram.blocks,
            "ram_checkpoints": ram.checkpoints,
            "ram_budget_bytes": ram.budget_bytes,
            "kv_bytes": self.scheduler.stats.kv_bytes,
            "mlx_active_bytes": mlx_memory()["mlx_active_bytes"],
        }

    def _rank_disk(self) -> dict[str, Any]:
        """This rank's slices on its SSD (its index's counts: off the MLX thread)."""
        ssd = self.tiers.ssd.stats() if self.tiers.ssd is not None else None
        return {
            "ssd_bytes": ssd.bytes if ssd is not None else 0,
            "ssd_entries": ssd.entries if ssd is not None else 0,
            "ssd_root": str(self.cache_root),
        }

    def halted(self) -> str | None:
        """Why the engine stopped for good (a rank of a split model lost: every request
        answers 503 until the ranks are started again); None while it serves."""
        return self.scheduler.halted

    def ranks(self) -> dict[str, Any] | None:
        """This process's place in a split model's world; None alone."""
        w = self.world
        return None if w.alone else {"rank": w.rank, "size": w.size, "mode": str(w.mode)}

    # -- which models are local -----------------------------------------------------------

    @property
    def model_ids(self) -> list[str]:
        return self.models.table.ids()

    def has_model(self, model_id: str) -> bool:
        return model_id in self.models.table

    def model_info(self, model_id: str) -> ModelInfo:
        return self.models.table.require(model_id).info()

    async def load(self, model_id: str) -> ModelInfo:
        """Load `model_id` now, as its first request would (a 404 if not served here)."""
        await self.models.runner(model_id)
        return self.model_info(model_id)

    @property
    def before_load(self) -> Callable[[models.ModelRef], Awaitable[None]] | None:
        """Awaited before each in-process load: the proxy has LM Studio unload its copy."""
        return self.models.before_load

    @before_load.setter
    def before_load(self, hook: Callable[[models.ModelRef], Awaitable[None]] | None) -> None:
        self.models.before_load = hook

    def template_defaults(self, model_id: str) -> dict[str, Any]:
        """The chat template kwargs the engine sets for `model_id` unless a request or its
        settings do: `preserve_thinking` where the template reads it. Read from the
        model's files when it is not loaded."""
        entry = self.models.table.require(model_id)
        if entry.loaded is not None:
            return self.turns.template_defaults(entry.loaded)
        return template_flags.default_kwargs(models.chat_template_text(entry.ref.path))

    # -- finished requests ----------------------------------------------------------------

    def on_result(
        self, listener: Callable[[GenerationRequest, GenerationResult], None]
    ) -> Callable[[], None]:
        """Call `listener` with every finished request (on the MLX thread); returns the
        call that stops it."""
        self._listeners.append(listener)
        return functools.partial(self._listeners.remove, listener)

    def _record(self, req: GenerationRequest, result: GenerationResult) -> None:
        self.requests.record(result)
        for listener in list(self._listeners):
            try:
                listener(req, result)
            except Exception:  # a listener's bug must not fail the request it observes
                log.exception("result listener %r failed", listener)

    def _on_done(self, loaded: models.LoadedModel, seq, result: GenerationResult) -> None:
        self.request_log.on_done(seq, result)
        self.turns.ended(loaded, seq.job, result, seq.out)

    def recent_requests(self, limit: int, tenant: str | None) -> list[RequestRecord]:
        """The last `limit` requests (of `tenant`, where one is given), with why each missed."""
        return self.request_log.recent(limit, tenant)

    def hit_ratio_alert(self) -> dict | None:
        """The hit-ratio alert while it is on (what fell, since when); None while off."""
        return self.request_log.alert_state()

    def miss_reasons(self) -> dict[tuple[str, MissReason], int]:
        """Requests by (model, miss reason) since start."""
        return self.request_log.reason_totals()

    def diagnosis(self, window_s: float | None = None, **only: str | None) -> dict[str, Any]:
        """Lost tokens by cause, each with its fix (reads the SSD's index: off the loop)."""
        ctx = diagnosis_report.context(self.settings, self.tiers.stats(),
                                       self.models, self.template_defaults)  # fmt: skip
        return diagnosis_report.report(self.request_log.diagnosis, ctx, window_s, **only)

    def lost_tokens(self) -> dict[tuple[str, str], int]:
        """Tokens computed again by (model, cause) since start (/metrics)."""
        return self.request_log.diagnosis.totals()

    # -- client sessions (/v1/cache/sessions, DELETE /v1/cache) ---------------------------

    async def list_sessions(self, tenant: str | None) -> list[SessionView]:
        return await self._session_admin.list(tenant)

    def session_records(self) -> list[SessionRecord]:
        return self._session_admin.records()

    async def delete_session(self, session: str, tenant: str | None) -> Deleted:
        deleted = await self._session_admin.delete(session, tenant)
        await self._forget_on_ranks("delete", session, tenant)
        return deleted

    async def pin_session(self, session: str, tenant: str | None, pinned: bool) -> bool:
        return await self._session_admin.pin(session, tenant, pinned)

    async def clear(self, model: str | None, tenant: str | None) -> Freed:
        """Drop what `model` (or every model) cached for `tenant` (or every tenant)."""
        freed = await self._session_admin.clear(model, tenant)
        await self._forget_on_ranks("clear", model, tenant)
        return freed

    async def _forget_on_ranks(self, kind: str, what: str | None, tenant: str | None) -> None:
        """A split model: every other rank drops its slices as rank 0 just did."""
        if self.figures is not None:
            await self.scheduler.run_shared("forget", kind, what, tenant)

    def _forget_here(self, kind: str, what: str | None, tenant: str | None) -> None:
        if not self.world.leader:  # rank 0 dropped its own before it shared the call
            self._session_admin.forget_here(kind, what, tenant)

    async def janitor(self) -> None:
        """Background upkeep while serving: memory, idle models, idle sessions, and across
        ranks what each rank holds (for /metrics)."""
        work = [self.models.janitor(), self._session_admin.upkeep()]
        if self.figures is not None and self.world.leader:
            work.append(self._gather_ranks())
        try:
            await asyncio.gather(*work)
        except (EngineHalted, EngineError) as e:
            # Work refused by a scheduler that stopped (a follower's, once rank 0 closed)
            # or halted ends the upkeep; any other error is a bug.
            if isinstance(e, EngineError) and self.halted() is None:
                raise
            log.warning("upkeep stops: %s", e)

    # -- a request's one way in -----------------------------------------------------------

    async def probe(self, req: GenerationRequest) -> ProbeResult:
        """What `req` would restore from RAM and SSD, without running the model."""
        _, job = await self._prepare(req)
        cache = self.models.cache(req.model) if req.use_cache else None
        return await cache_probe.probe(req, job, cache, self.scheduler.run)

    async def warm(self, req: GenerationRequest) -> WarmResult:
        """Prefill and store `req`'s prompt, generating nothing."""
        return await cache_probe.warm(self, req, self.settings.cache_enabled)

    def has_cache(self, model_id: str) -> bool:
        """Whether `model_id` is loaded with a prompt cache (some cache types have none)."""
        return self.models.cache(model_id) is not None

    async def count_tokens(self, req: GenerationRequest) -> int:
        runner = await self.models.runner(req.model)
        return await self.prepare.count_tokens(runner.loaded, req)

    async def _prepare(
        self, req: GenerationRequest, rendered: RenderedPrompt | None = None
    ) -> tuple[Runner, Job]:
        runner = await self.models.runner(req.model)
        return runner, await self.prepare.job(runner.loaded, req, rendered)

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
        with self.models.table.claim(req.model):
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

    # -- warming ahead (warm_ahead.py) ----------------------------------------------------

    def idle_s(self) -> float:
        return self.models.table.idle_s()

    def warm_room_tokens(self, model_id: str, share: float) -> int | None:
        return self.models.warm_room_tokens(model_id, share)

    async def probe_prompt(self, req: GenerationRequest, prompt: RenderedPrompt) -> ProbeResult:
        if self.models.loaded(req.model) is None:
            raise EngineError(f"{req.model} is not loaded", status=409)
        _, job = await self._prepare(req, prompt)
        return await cache_probe.probe(req, job, self.models.cache(req.model), self.scheduler.run)

    async def start_prompt(
        self, req: GenerationRequest, prompt: RenderedPrompt
    ) -> GenerationStream:
        """Start `req` on a prompt already rendered; it preempts nothing."""
        return await self._start(req, prompt)

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
            "memory": asdict(self.models.memory.pressure)
            | mlx_memory()
            | self.models.preflight.stats(),
            **asdict(self.tiers.stats()),
            "models": self.model_ids,
            "vision": self.models.table.vision_stats(),
            "alert": self.hit_ratio_alert(),
            "warm_ahead": self.warm_ahead.stats(),
            "reasoning_memo": asdict(self.turns.reasoning.stats()),
            # A split model: what each rank holds, as last gathered (rank_stats).
            "ranks": self.figures.last if self.figures is not None else None,
            "autotune": self.models.autotune_stats(),
        }

    def follow(self) -> None:
        """On a rank other than 0: run rank 0's steps until it closes (lockstep.py)."""
        world = self.settings.world
        if world is None or world.leader:
            raise RuntimeError("only a follower rank follows")
        # This rank's own upkeep: its memory guard and its sessions' TTL (what it holds,
        # never what it computes: the ranks agree on each lookup). Rank 0 alone unloads.
        upkeep = threading.Thread(target=asyncio.run, args=(self.janitor(),),
                                  name="rank-upkeep", daemon=True)  # fmt: skip
        upkeep.start()
        try:
            self.scheduler.join()
        finally:
            # Rank 0 closed, the world was lost, or this process was told to stop (a
            # signal raised here): what this rank's slices wrote is kept.
            self.tiers.close(self.settings.ssd_drain_s)
            self.sessions.close()
            self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    async def close(self) -> None:
        if self.figures is not None:
            self.figures.close()
        await self.warm_ahead.close()
        # Cancels what is running or queued; each cancelled request still saves its cache.
        await asyncio.to_thread(self.scheduler.close)
        # Drain queued writes (bounded), so a clean shutdown loses nothing computed.
        await asyncio.to_thread(self.tiers.close, self.settings.ssd_drain_s)
        await asyncio.to_thread(self.sessions.close)
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)


def _tiers(settings: EngineSettings, root: Path) -> TieredCache:
    """RAM, then SSD and the shared store where the settings turn them on."""
    ssd = None
    if settings.cache_enabled and settings.ssd_enabled:
        ssd = SSDStore(
            SSDConfig(
                root=root,
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
    return TieredCache(
        CacheManager(
            settings.ram_budget_bytes,
            block_size=settings.cache_policy.block_size,
            keep_newest_periodic=settings.cache_policy.keep_periodic,
            protect_frequent=settings.ram_protect_frequent,
        ),  # fmt: skip
        ssd,
        kv.HostCodec(),
        write_through=settings.ssd_write_through,
        policy=settings.ssd_write_policy,
        checkpoint_delay_s=settings.ssd_checkpoint_delay_s,
        periodic_write_every=settings.cache_policy.checkpoint_interval * SPARSE_PERIODIC_EVERY,
        shared=shared,
    )
