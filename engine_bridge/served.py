"""The models this process serves: the table of them by id (each one's reference, and its
runner once loaded), and their lifecycle: a load makes room first (the memory preflight
unloads idle models, else refuses), idle models unload, and the memory guard runs.

The engine owns one `ModelLifecycle`; the session routes (sessions/admin.py) read its table
to find running jobs and loaded models without knowing the engine.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

from . import kv
from .cache.tiers import TieredCache
from .distributed.world import ALONE
from .engine_settings import EngineSettings
from .models import loading as models
from .models.loading import LoadedModel, ModelRef
from .models.preflight import Preflight
from .ops import heap
from .ops.autotune import Autotune
from .ops.diagnosis import Diagnosis
from .ops.memory import HEAP_TRIM_S, MemoryGuard, release_memory
from .prompt_cache import ModelCache
from .scheduling.jobs import Job
from .scheduling.runner import Runner
from .scheduling.scheduler import Scheduler
from .sessions.catalog import ClientSessions
from .types import EngineError, GenerationRequest, GenerationResult, ModelInfo

log = logging.getLogger("engine_bridge.served")


@dataclass(slots=True)
class ModelEntry:
    """A model this process serves; loaded lazily on first use."""

    ref: ModelRef
    runner: Runner | None = None
    # Requests between finding the runner and queueing their job (rendering, tokenizing):
    # an unload then would leave the job queued to a runner the scheduler no longer steps.
    claims: int = 0

    @property
    def loaded(self) -> LoadedModel | None:
        return self.runner.loaded if self.runner is not None else None

    def info(self) -> ModelInfo:
        loaded = self.loaded
        if loaded is None:
            return ModelInfo(self.ref.id, loaded=False)
        return ModelInfo(
            self.ref.id,
            loaded=True,
            arch=loaded.config.get("model_type"),
            context_length=loaded.context_length,
            cache_kind=loaded.cache_kind,
            max_batch=self.runner.max_batch,
            vision=loaded.vision is not None,
        )

    def idle(self, idle_s: float, now: float) -> bool:
        """Loaded, with no job running or on its way, and unused for `idle_s` at `now`."""
        r = self.runner
        return (
            r is not None and not r.active_jobs and not self.claims and now - r.last_used >= idle_s
        )


class ServedModels:
    """The table of served models, in the order they were added."""

    def __init__(self) -> None:
        self._by_id: dict[str, ModelEntry] = {}
        # Held while any model loads or unloads. One lock for all models: a load's preflight
        # reads what every loaded model holds, so it must not overlap another load or an
        # unload; and with per-model locks, two first loads making room for each other
        # each held its own lock while waiting for the other's.
        self.lifecycle = asyncio.Lock()

    def add(self, ref: ModelRef) -> ModelEntry:
        """Serve `ref` (not loaded yet); a second ref with the same id replaces the first."""
        entry = self._by_id[ref.id] = ModelEntry(ref)
        return entry

    def get(self, model_id: str) -> ModelEntry | None:
        return self._by_id.get(model_id)

    def require(self, model_id: str) -> ModelEntry:
        """The entry of `model_id`; a 404 `EngineError` naming the field when not served."""
        entry = self._by_id.get(model_id)
        if entry is None:
            raise EngineError(f"model {model_id!r} is not served here", field="model", status=404)
        return entry

    @contextmanager
    def claim(self, model_id: str) -> Iterator[ModelEntry]:
        """Keep `model_id` loaded (from the idle janitor and room-making) while held."""
        entry = self.require(model_id)
        entry.claims += 1
        try:
            yield entry
        finally:
            entry.claims -= 1

    def take_idle(self, idle_s: float, keep: str | None = None) -> list[tuple[str, Runner]]:
        """Detach the runners of models idle for `idle_s` (all but `keep`), to unload them;
        `lifecycle` is held, and nothing can start on them once this returns."""
        now = time.monotonic()
        taken = []
        for model_id, entry in self._by_id.items():
            if model_id != keep and entry.idle(idle_s, now):
                taken.append((model_id, entry.runner))
                entry.runner = None
        return taken

    def __contains__(self, model_id: object) -> bool:
        return model_id in self._by_id

    def ids(self) -> list[str]:
        return list(self._by_id)

    def loaded(self) -> Iterator[LoadedModel]:
        """The models loaded now."""
        for entry in list(self._by_id.values()):
            if entry.runner is not None:
                yield entry.runner.loaded

    def idle_s(self) -> float:
        """Seconds since a request of a loaded model last started or ended; 0 while one
        runs or is on its way."""
        entries = list(self._by_id.values())
        runners = [e.runner for e in entries if e.runner is not None]
        if any(r.active_jobs for r in runners) or any(e.claims for e in entries):
            return 0.0
        return time.monotonic() - max((r.last_used for r in runners), default=0.0)

    def vision_stats(self) -> dict[str, int]:
        """Feature and preprocessing caches, summed over the loaded models that see."""
        total: dict[str, int] = {}
        for loaded in self.loaded():
            seeing = loaded.vision
            if seeing is None:
                continue
            counts = asdict(seeing.feature_cache.snapshot()) | seeing.spec.prepared.stats()
            for k, v in counts.items():
                total[k] = total.get(k, 0) + v
        return total

    def live_jobs(self) -> list[tuple[str, Job]]:
        """(model id, job) of every job submitted to a loaded model and not yet ended."""
        return [
            (model_id, job)
            for model_id, entry in list(self._by_id.items())
            if entry.runner is not None
            for job in list(entry.runner.live_jobs.values())
        ]


class ModelLifecycle:
    """Loads and unloads the served models on the one MLX thread, one at a time.

    A model loads on first use (`runner`), after the memory preflight made room for it;
    `unload_idle` and the janitor let go of models no request used lately. Each loaded
    model gets its prompt cache here (`cache`), over the process-wide tiers.
    """

    def __init__(
        self,
        settings: EngineSettings,
        scheduler: Scheduler,
        tiers: TieredCache,
        sessions: ClientSessions,
        *,
        on_result: Callable[[GenerationRequest, GenerationResult], None],
        on_done: Callable[[LoadedModel, object, GenerationResult], None],
        before_room: Callable[[], Awaitable[None]],
        diagnosis: Diagnosis | None = None,
    ):
        self.table = ServedModels()
        self.settings = settings
        self.scheduler = scheduler
        self.tiers = tiers
        self.sessions = sessions
        self.memory = MemoryGuard(tiers, settings)
        self.preflight = Preflight(settings, scheduler, tiers)
        # Across ranks, a load runs on every rank at the same step (scheduling/lockstep.py).
        self.world = settings.world or ALONE
        # The RAM budget and eviction policy tuned by load, after the guard (autotune.py).
        tuned = settings.autotune.enabled and settings.cache_enabled
        # The checkpoint interval is tuned in one process only: a split model's ranks must
        # stop their prefills at the same points, and each rank tunes on its own.
        spaced = settings.cache_policy if self.world.alone else None
        self.autotune = (
            Autotune(settings.autotune, tiers, self.memory, diagnosis, spaced) if tuned else None
        )
        # Awaited before a model loads in-process, with what is about to load: the proxy
        # asks LM Studio to let go of its own copy of the same weights.
        self.before_load: Callable[[ModelRef], Awaitable[None]] | None = None
        self._caches: dict[str, ModelCache] = {}  # each loaded model's prompt cache
        self._on_result = on_result
        self._on_done = on_done
        # Awaited before idle models are unloaded to make room (a warm-up holds its model).
        self._before_room = before_room
        scheduler.handlers["load"] = self._load_here

    def _load_here(self, ref: ModelRef) -> LoadedModel:
        """This rank's part of `ref`, on the MLX thread. A follower rank also makes the
        runner rank 0 is about to add, so that the add finds it."""
        if self.world.alone:
            return models.load(ref)
        loaded = models.load(ref, self.world)
        if not self.world.leader:
            lockstep = self.scheduler.lockstep
            assert lockstep is not None
            lockstep.made[ref.id] = self._runner(loaded)
        return loaded

    def loaded(self, model_id: str) -> LoadedModel | None:
        """`model_id`'s loaded model (tokenizer, weights, config); None while not loaded."""
        entry = self.table.get(model_id)
        return entry.loaded if entry is not None else None

    def cache(self, model_id: str) -> ModelCache | None:
        """The prompt cache of a loaded model; None when it has none (or is not loaded)."""
        entry = self.table.get(model_id)
        return self._caches.get(model_id) if entry and entry.runner else None

    async def runner(self, model_id: str) -> Runner:
        """`model_id`'s runner, loading the model first if it is not (a 404 if not served)."""
        entry = self.table.require(model_id)
        if entry.runner is None:
            async with self.table.lifecycle:  # one load or unload at a time
                if entry.runner is None:
                    entry.runner = await self._load(entry.ref)
        # Marks the model busy for the idle janitor before any await can intervene.
        entry.runner.last_used = time.monotonic()
        return entry.runner

    async def _load(self, ref: ModelRef) -> Runner:
        """Load `ref` (the lifecycle lock held) and add its runner to the scheduler."""
        if self.before_load is not None:
            await self.before_load(ref)
        if self.settings.memory_preflight:
            await self._make_room(ref)
        loaded = await self.scheduler.run_shared("load", ref)
        runner = self._runner(loaded)
        self.scheduler.add(runner)
        return runner

    def _runner(self, loaded: LoadedModel) -> Runner:
        if loaded.vision is not None and self.settings.cache_enabled:
            features = loaded.vision.feature_cache
            features.bind(self.tiers.ram, self.tiers.ssd, loaded.fingerprint, self.tiers.shared)
        return Runner(
            loaded,
            self.scheduler,
            self._session_factory(loaded),
            on_result=self._on_result,
            on_done=functools.partial(self._on_done, loaded),
        )

    async def _make_room(self, ref: ModelRef) -> None:
        """Load only what fits: unload idle models for room, else refuse (preflight.py)."""
        # Off the event loop: it reads the system's memory and stats the weights' files.
        plan = await asyncio.to_thread(self.preflight.check, ref)
        unloaded: list[str] = []
        if not plan.fits:
            await self._before_room()
            unloaded = await self._unload_idle(0.0, keep=ref.id)
            if unloaded:
                plan = await asyncio.to_thread(self.preflight.check, ref)
        if not plan.fits:
            message = plan.refusal(unloaded)
            log.warning("%s", message)
            raise EngineError(message, field="model", status=503)
        await self.scheduler.run(self.preflight.apply, plan)
        log.info("loading %s: %s", ref.id, plan.figures())

    def _session_factory(self, loaded: LoadedModel):
        if not self.settings.cache_enabled:
            return None
        try:
            cache = ModelCache(
                loaded, self.tiers, self.settings.cache_policy, self.sessions, self.world
            )
        except kv.UnsupportedCacheError as e:
            log.warning("prompt cache off for %s: %s", loaded.id, e)
            return None
        self._caches[loaded.id] = cache
        return cache.session

    async def unload_idle(self, idle_s: float) -> list[str]:
        """Unload models unused for `idle_s` seconds; their cache stays on SSD (and in RAM)."""
        async with self.table.lifecycle:
            return await self._unload_idle(idle_s)

    async def _unload_idle(self, idle_s: float, keep: str | None = None) -> list[str]:
        """`unload_idle` with the lifecycle lock held, sparing `keep` (the model loading)."""
        now, unloaded = time.monotonic(), []
        idle = self.table.take_idle(idle_s, keep)
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
            await self.scheduler.run(release_memory)
            log.info("unloaded %s after %.0fs idle", model_id, idle_for)
            unloaded.append(model_id)
        return unloaded

    def autotune_stats(self) -> dict:
        return self.autotune.stats() if self.autotune is not None else {"enabled": False}

    async def janitor(self) -> None:
        """The memory guard, the autotuner, and idle unloading, while serving."""
        # Across ranks, rank 0 alone decides an unload (a shared step: lockstep.py).
        idle = self.settings.idle_unload_s if self.world.leader else 0
        guard = self.settings.ram_min_available_bytes is not None and self.settings.cache_enabled
        tune = self.autotune
        if not idle and not guard and tune is None:
            return
        idle_period = max(1.0, min(30.0, idle / 4)) if idle else 0.0
        periods = [self.settings.memory_check_s if guard else 0, idle_period,
                   tune.settings.interval_s if tune else 0]  # fmt: skip
        period = min(p for p in periods if p > 0)
        if tune is not None:  # ghosts that came back are asked about between its looks
            period = min(period, tune.EARLY_S)
        last_idle_check = last_trim = last_tune = last_check = time.monotonic()
        while True:
            await asyncio.sleep(period)
            if guard and time.monotonic() - last_check >= self.settings.memory_check_s:
                last_check = time.monotonic()
                # On the MLX thread: a shrink evicts, and a spill turns arrays into bytes,
                # which MLX only does on the thread that owns their stream.
                await self.scheduler.run(self.memory.check)
                if time.monotonic() - last_trim >= HEAP_TRIM_S:
                    last_trim = time.monotonic()
                    await asyncio.to_thread(heap.trim)
            if tune is not None and tune.due(time.monotonic() - last_tune):
                last_tune = time.monotonic()
                # After the guard's own check, and on the MLX thread too (a give-back evicts).
                await self.scheduler.run(tune.tick)
            if idle and time.monotonic() - last_idle_check >= idle_period:
                last_idle_check = time.monotonic()
                await self.unload_idle(idle)

    def warm_room_tokens(self, model_id: str, share: float) -> int | None:
        """How many new tokens of `model_id` fit in `share` of the RAM tier's budget;
        None before a prefill taught the runner its bytes per token."""
        entry = self.table.get(model_id)
        per_token = entry.runner.bytes_per_token if entry and entry.runner else 0.0
        if per_token <= 0:
            return None
        if self.memory.pressure.active:
            return 0  # the guard is shrinking the tier: nothing ahead of need
        return int(self.tiers.ram.budget_bytes * share / per_token)
