"""What the /v1/cache/sessions routes and DELETE /v1/cache ask of the engine, as coroutines.

A session that is generating finishes first: its delete waits until the jobs it had
running when the delete came in have ended (their end-of-generation save included), then
drops what only it references, RAM on the MLX thread, then disk.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from ..cache.session_registry import SessionKey, SessionRecord
from ..models import loading as models
from ..scheduling.jobs import Job
from ..types import EngineError, EngineHalted
from .catalog import ClientSessions, Freed, SessionView
from .prune import GoneEntries

log = logging.getLogger("engine_bridge.sessions.admin")

# How often a delete looks whether the generation it waits for has ended.
_POLL_S = 0.02
# How often changed sessions are written to disk (and idle ones looked for, at most).
SAVE_S = 5.0

OnMlx = Callable[..., Awaitable[Any]]


class Served(Protocol):
    """What the session routes read of the engine's models (served.py's `ServedModels`):
    passed in, so that this wing, below the model lifecycle, never imports it."""

    def require(self, model_id: str) -> Any: ...  # an entry: its `ref`, its `runner` or None

    def loaded(self) -> Iterator[models.LoadedModel]: ...

    def live_jobs(self) -> list[tuple[str, Job]]: ...


@dataclass(frozen=True, slots=True)
class Deleted:
    id: str
    freed_bytes: int
    entries: int


class SessionAdmin:
    def __init__(self, sessions: ClientSessions, on_mlx: OnMlx, served: Served):
        self.sessions = sessions
        self.gone = GoneEntries(sessions)
        self._on_mlx = on_mlx
        self._served = served  # the engine's models: their running jobs, the loaded ones

    def _live_jobs(self) -> list[tuple[str, Job]]:
        return self._served.live_jobs()

    async def _fingerprint(self, model_id: str) -> str | None:
        """The cache's name for a model, loaded or not (None if its files are gone)."""
        entry = self._served.require(model_id)
        if entry.runner is not None:
            return entry.runner.loaded.fingerprint
        try:
            return await asyncio.to_thread(models.fingerprint, entry.ref.path)
        except OSError:
            return None

    async def list(self, tenant: str | None = None) -> list[SessionView]:
        # Off the event loop: it reads the SSD index for every session's entries.
        return await asyncio.to_thread(self.sessions.views, tenant)

    def records(self) -> list[SessionRecord]:
        """Every session the registry knows, as it stands (what /metrics counts)."""
        return self.sessions.registry.records()

    def _keys(self, session: str, tenant: str | None) -> list[SessionKey]:
        keys = [r.key for r in self.sessions.registry.find(session, tenant)]
        if not keys:
            raise EngineError(f"no cached session {session!r}", field="id", status=404)
        return keys

    async def delete(self, session: str, tenant: str | None) -> Deleted:
        """Drop what only this session references, after its running generations end."""
        keys = self._keys(session, tenant)
        await self._wait_idle(keys)
        freed = await self._drop(keys)
        log.info(
            "deleted session %r: %d entries, %d bytes freed", session, freed.entries, freed.bytes
        )
        return Deleted(session, freed.bytes, freed.entries)

    async def pin(self, session: str, tenant: str | None, pinned: bool) -> bool:
        keys = self._keys(session, tenant)
        if pinned:
            await self._on_mlx(self.sessions.pin, keys)
        else:
            await self._on_mlx(self.sessions.unpin, keys)
        return pinned

    async def clear(self, model: str | None, tenant: str | None) -> Freed:
        """Drop every cached entry (of one model and/or tenant) that no request is using."""
        fingerprint = None
        if model is not None:
            fingerprint = await self._fingerprint(model)
            if fingerprint is None:
                return Freed()  # never loaded and not on disk under any fingerprint
        freed, plan = await self._on_mlx(self.sessions.clear_ram, model, fingerprint, tenant)
        freed.add(*await self._on_mlx(self._clear_features, fingerprint, tenant))
        return await asyncio.to_thread(self.sessions.drop_ssd, plan, freed)

    def forget_here(self, kind: str, what: str | None, tenant: str | None) -> None:
        """A rank past the first, as rank 0 just did (a shared call, on the MLX thread):
        drop its slices of a session (`delete`, `what` its id) or of a model and/or tenant
        (`clear`, `what` the model), in RAM and on its SSD (this rank answers no client, so
        its SSD I/O here stalls no one)."""
        if kind == "delete":
            keys = [r.key for r in self.sessions.registry.find(what, tenant)] if what else []
            if not keys:
                return
            freed, plan = self.sessions.drop_ram(keys)
        else:
            fingerprint = None
            if what is not None:
                loaded = next((m for m in self._served.loaded() if m.id == what), None)
                if loaded is None:  # its slices here age out of RAM, and off the SSD
                    log.info("clear of %s: not loaded on this rank", what)
                    return
                fingerprint = loaded.fingerprint
            freed, plan = self.sessions.clear_ram(what, fingerprint, tenant)
            freed.add(*self._clear_features(fingerprint, tenant))
        freed = self.sessions.drop_ssd(plan, freed)
        log.info("%s %s on this rank: %d entries, %d bytes freed", kind, what or "all",
                 freed.entries, freed.bytes)  # fmt: skip

    def _clear_features(self, fingerprint: str | None, tenant: str | None) -> tuple[int, int]:
        """Vision features the loaded models hold in RAM (MLX thread); those on SSD go with
        the clear's plan, like every other entry kind of their scope."""
        entries = nbytes = 0
        for loaded in self._served.loaded():
            if loaded.vision is None:
                continue
            if fingerprint is None or loaded.fingerprint == fingerprint:
                n, b = loaded.vision.feature_cache.clear(tenant)
                entries, nbytes = entries + n, nbytes + b
        return entries, nbytes

    async def expire_idle(self) -> int:
        """Delete sessions idle past [cache] session_ttl that are not generating."""
        if not self.sessions.idle():
            return 0
        busy = {self._key_of(model, job) for model, job in self._live_jobs()}
        # Chosen again on the MLX thread, where requests note their use: one that came
        # back since the look above is not idle any more.
        keys, freed, plan = await self._on_mlx(self.sessions.drop_idle, busy)
        if not keys:
            return 0
        freed = await asyncio.to_thread(self.sessions.drop_ssd, plan, freed)
        log.info(
            "expired %d idle sessions (session_ttl %.0fs): %d entries, %d bytes freed",
            len(keys), self.sessions.ttl_s, freed.entries, freed.bytes,
        )  # fmt: skip
        return len(keys)

    async def upkeep(self) -> None:
        """Expire idle sessions, forget entries no tier holds, and save the registry every so
        often (the engine's janitor)."""
        ttl = self.sessions.ttl_s
        period = SAVE_S if ttl is None else max(0.2, min(SAVE_S, ttl / 4))
        while True:
            await asyncio.sleep(period)
            try:
                if ttl is not None:
                    await self.expire_idle()
                confirmed = await asyncio.to_thread(self.gone.look)
                if confirmed:
                    await self._on_mlx(self.gone.forget, confirmed)
                await asyncio.to_thread(self.sessions.save)
            except EngineHalted as e:
                log.warning("session upkeep stops: %s", e)  # the engine stopped for good
                return
            except Exception:
                log.exception("session upkeep failed")

    async def _drop(self, keys: list[SessionKey]) -> Freed:
        freed, plan = await self._on_mlx(self.sessions.drop_ram, keys)
        return await asyncio.to_thread(self.sessions.drop_ssd, plan, freed)

    async def _wait_idle(self, keys: list[SessionKey]) -> None:
        """Wait for the jobs of `keys` running now; later ones are not waited for."""
        wanted = set(keys)
        running = [job for model, job in self._live_jobs() if self._key_of(model, job) in wanted]
        if running:
            log.info("session delete waits for %d running generation(s)", len(running))
        while running:
            await asyncio.sleep(_POLL_S)
            live = {id(job) for _, job in self._live_jobs()}
            running = [job for job in running if id(job) in live]

    @staticmethod
    def _key_of(model: str, job: Job) -> SessionKey:
        req = job.request
        return SessionKey(req.tenant, model, req.session)
