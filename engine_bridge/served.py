"""The models this process serves, by id: each one's reference, and its runner once loaded.

The engine owns one table and loads into it; the session routes (sessions/admin.py) read it
to find running jobs and loaded models without knowing the engine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

from .models.loading import LoadedModel, ModelRef
from .scheduling.jobs import Job
from .scheduling.runner import Runner
from .types import EngineError, ModelInfo


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
