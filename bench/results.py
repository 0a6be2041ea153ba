"""What a scenario produces: raw samples, summary rows for the report, notes and errors."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

Number = float | int | None


@dataclass(slots=True)
class Sample:
    """One request to one server, as measured by the client."""

    server: str  # a servers.Kind, or "bare" for in-process mlx-lm
    step: int  # turn or request index within the scenario
    ttft_s: float | None
    total_s: float
    prompt_tokens: int | None
    cached_tokens: int | None
    completion_tokens: int | None
    source: str | None
    ok: bool
    error: str | None = None
    label: str = ""  # what the request was: "turn", "new-only", "after-restart", …
    session: int = 0
    output: str = ""

    @property
    def hit_ratio(self) -> float | None:
        if not self.prompt_tokens or self.cached_tokens is None:
            return None
        return self.cached_tokens / self.prompt_tokens


@dataclass(slots=True)
class Row:
    """One line of the report: a metric, its value per server, and the ratios that matter."""

    metric: str  # with its unit
    values: dict[str, Number]
    ratios: dict[str, Number] = field(default_factory=dict)
    note: str = ""


@dataclass(slots=True)
class ScenarioResult:
    scenario: str
    model: str
    rows: list[Row] = field(default_factory=list)  # rows[0] is the headline
    samples: list[Sample] = field(default_factory=list)
    metrics: dict[str, Number] = field(default_factory=dict)
    servers: dict[str, dict[str, Number | str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    # Why it did not run (a missing prerequisite, see prerequisites.py); None when it ran.
    skipped: str | None = None
    seconds: float = 0.0
    # perf_counter() when the scenario began; the report leaves it out.
    t0: float = field(default_factory=time.perf_counter)

    def finish(self) -> ScenarioResult:
        self.seconds = time.perf_counter() - self.t0
        return self

    def of(self, server: str, label: str = "turn") -> list[Sample]:
        return [s for s in self.samples if s.server == server and s.label == label]


def median(values: Iterable[Number]) -> float | None:
    vals = [float(v) for v in values if v is not None and math.isfinite(v)]
    return statistics.median(vals) if vals else None


def mean(values: Iterable[Number]) -> float | None:
    vals = [float(v) for v in values if v is not None and math.isfinite(v)]
    return statistics.fmean(vals) if vals else None


def ratio(a: Number, b: Number) -> float | None:
    """a / b, or None when either is missing or b is zero."""
    if a is None or b is None or b == 0:
        return None
    return float(a) / float(b)


def total(values: Iterable[Number]) -> float | None:
    vals = [float(v) for v in values if v is not None]
    return sum(vals) if vals else None
