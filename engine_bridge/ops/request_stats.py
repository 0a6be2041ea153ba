"""Request-level counters of /v1/cache/stats: totals, hits, misses and the token hit ratio."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..types import GenerationResult


@dataclass(slots=True)
class RequestStats:
    """Request-level accounting, the one place requests are counted.

    Bypassed requests and cache-less models stay out of the hits, misses and token counts
    that the hit ratio (cached / prompt tokens) is made of.
    """

    total: int = 0
    completed: int = 0
    cancelled: int = 0
    bypassed: int = 0
    hits: int = 0
    misses: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    by_source: dict[str, int] = field(
        default_factory=lambda: {"ram": 0, "ssd": 0, "shared": 0, "none": 0}
    )
    last_cancelled_completion_tokens: int = 0

    def record(self, r: GenerationResult) -> None:
        self.total += 1
        if r.finish_reason == "cancelled":
            self.cancelled += 1
            self.last_cancelled_completion_tokens = r.completion_tokens
        else:
            self.completed += 1
        self.completion_tokens += r.completion_tokens
        if not r.used_cache:
            self.bypassed += 1
            return
        self.prompt_tokens += r.prompt_tokens
        self.cached_tokens += r.cached_tokens
        self.by_source[r.source] = self.by_source.get(r.source, 0) + 1
        if r.cached_tokens:
            self.hits += 1
        else:
            self.misses += 1

    @property
    def hit_ratio(self) -> float:
        return round(self.cached_tokens / self.prompt_tokens, 4) if self.prompt_tokens else 0.0
