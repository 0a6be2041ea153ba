"""The models this process serves, by id: each one's reference, and its runner once loaded.

The engine owns one table and loads into it; the session routes (sessions/admin.py) read it
to find running jobs and loaded models without knowing the engine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

from .models.loading import LoadedModel, ModelRef
from .scheduling.jobs import Job
from .scheduling.runner import Runner
from .types import EngineError


@dataclass(slots=True)
class ModelEntry:
    """A model this process serves; loaded lazily on first use."""

    ref: ModelRef
    runner: Runner | None = None
    # Held while the model loads or unloads: one load at a time, none under a request.
    loading: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def loaded(self) -> LoadedModel | None:
        return self.runner.loaded if self.runner is not None else None


class ServedModels:
    """The table of served models, in the order they were added."""

    def __init__(self) -> None:
        self._by_id: dict[str, ModelEntry] = {}

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

    def __contains__(self, model_id: object) -> bool:
        return model_id in self._by_id

    def ids(self) -> list[str]:
        return list(self._by_id)

    def entries(self) -> list[tuple[str, ModelEntry]]:
        """(id, entry) of every served model; a copy, so callers may await while walking it."""
        return list(self._by_id.items())

    def loaded(self) -> Iterator[LoadedModel]:
        """The models loaded now."""
        for entry in list(self._by_id.values()):
            if entry.runner is not None:
                yield entry.runner.loaded

    def idle_s(self) -> float:
        """Seconds since a request of a loaded model last started or ended; 0 while one
        runs."""
        runners = [e.runner for e in list(self._by_id.values()) if e.runner is not None]
        if any(r.active_jobs for r in runners):
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
