"""The neutral request and event types that cross from proxy/ into engine_bridge/.

proxy/ turns an OpenAI or Anthropic body into a `GenerationRequest`; the runner answers
with a stream of `TokenEvent`s and one final `GenerationResult`. No dialect leaks in here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

CacheSource = Literal["ram", "ssd", "none"]
FinishReason = Literal["stop", "length", "stop_string", "cancelled"]


class EngineError(Exception):
    """A client's mistake found inside the engine (e.g. prompt too long); maps to a 4xx."""

    def __init__(self, message: str, *, field: str | None = None, status: int = 400):
        super().__init__(message)
        self.message = message
        self.field = field
        self.status = status


@dataclass(slots=True)
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(slots=True)
class GenerationRequest:
    """One request, dialect-free: either chat `messages` or a raw `prompt`."""

    model: str
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    tools: list[dict[str, Any]] | None = None
    max_tokens: int = 512
    stop: list[str] = field(default_factory=list)
    sampling: Sampling = field(default_factory=Sampling)
    tenant: str = "local"
    use_cache: bool = True
    request_id: str = ""
    # Extra keyword arguments for the chat template (e.g. enable_thinking).
    template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class PromptInfo:
    """What the runner learned before decoding: sizes and what the cache gave."""

    prompt_tokens: int
    cached_tokens: int
    source: CacheSource


@dataclass(slots=True)
class TokenEvent:
    """Newly decoded text; `text` may be empty while a multi-byte char is incomplete."""

    text: str
    token: int


@dataclass(slots=True)
class GenerationResult:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    source: CacheSource
    finish_reason: FinishReason
    text: str
    ttft_s: float
    generation_s: float
    stop_string: str | None = None
    # False for bypassed requests and cache-less models: they stay out of the hit ratio.
    used_cache: bool = True
