"""What the scheduler passes around for one request: the job, its events, its place in line."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..cache.kinds import SavePoint
from ..prompting.render import RenderedPrompt
from ..types import CacheSource, GenerationRequest, GenerationResult, PromptInfo, TokenEvent
from .output_rules import OutputRule


class CacheSession(Protocol):
    """What the runner needs from the prompt cache for one request."""

    def restore(self) -> tuple[list[Any], int, CacheSource]: ...

    def stop_points(self) -> list[int]: ...

    def save(
        self, cache: list[Any], tokens: list[int], position: int, point: SavePoint
    ) -> None: ...


@dataclass(slots=True, weakref_slot=True)
class Job:
    request: GenerationRequest
    prompt: RenderedPrompt
    max_tokens: int
    cancel: threading.Event = field(default_factory=threading.Event)
    # Forced and banned tokens (tool_choice, the test hook); None for plain sampling.
    rule: OutputRule | None = None
    # What the runner reads to stop the job. Alone, `cancel` itself; across ranks, set only
    # where rank 0 shares the cancel with every rank (the top of a step), so that all of
    # them stop it at the same step, whenever the client left.
    halt: threading.Event | None = None
    # Rank 0's number for the job, by which every rank names it (0 alone).
    key: int = 0

    def __post_init__(self) -> None:
        if self.halt is None:
            self.halt = self.cancel


Event = PromptInfo | TokenEvent | GenerationResult


class Failed:
    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


Emit = Callable[[Event | Failed | None], None]


@dataclass(slots=True)
class Pending:
    job: Job
    emit: Emit
    # TTFT counts from here: time waiting for a batch slot is time the client waits.
    queued_at: float = field(default_factory=time.perf_counter)
