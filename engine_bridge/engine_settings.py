"""What an Engine is built with: the models, the cache tiers, the memory guard, the scheduler.

Every type an `EngineSettings` field holds is defined or re-exported here, so that
`proxy/` builds and validates the settings from this module alone, and importing it loads
no mlx (the config is checked before any model is).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from .cache.shared.config import (
    BYTES_BUCKETS,
    LATENCY_BUCKETS_S,
    SharedConfig,
    SharedWritePolicy,
)
from .cache.write_policy import WritePolicy, resolve_write_policy

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = [
    "AutotuneSettings",
    "BYTES_BUCKETS",
    "CLAUDE_CODE_BILLING_HEADER",
    "LATENCY_BUCKETS_S",
    "CachePolicy",
    "EngineSettings",
    "Mode",
    "NormalizationRule",
    "SharedConfig",
    "SharedWritePolicy",
    "SpeculativeSettings",
    "VisionLimits",
    "WarmAheadSettings",
    "WritePolicy",
    "resolve_write_policy",
]


@dataclass(frozen=True, slots=True)
class AutotuneSettings:
    """`[autotune]`: the RAM budget and eviction policy tuned by load (ops/autotune.py)."""

    # Where protect_frequent starts under tuning ([cache.ram] protect_frequent = "auto"):
    # the middle, as ARC starts with no lean, so the first burst of one-off prompts meets a
    # shared prefix already read twice protected, and what comes back leans it either way.
    PROTECT_START: ClassVar[float] = 0.5

    enabled: bool = False  # the server's config turns it on ([autotune] enabled)
    ram_max_bytes: int | None = None  # None: twice the configured budget
    interval_s: float = 10.0


@dataclass(slots=True)
class CachePolicy:
    """How one model's prompt cache keys and keeps its states (prompt_cache.py)."""

    block_size: int = 64
    # Snapshot models also checkpoint every this many tokens of a long prefill.
    checkpoint_interval: int = 1024
    # Keep each path's newest periodic checkpoint when a deeper one of another kind comes
    # (a prompt that changes a long message's end then resumes near it); False: only
    # message boundaries outlive the request (one checkpoint fewer per path).
    keep_periodic: bool = False
    # 0 keeps K/V exact; 8 or 4 quantizes stored blocks (smaller, slightly lossy).
    quantize_bits: int = 0
    # Log, once per request, where a prompt left the nearest cached sequence.
    log_divergence: bool = True


@dataclass(frozen=True, slots=True)
class NormalizationRule:
    """A regex applied to message text before tokenization, to drop per-session noise
    (prompting/render.py applies them)."""

    name: str
    pattern: re.Pattern[str]
    replacement: str = ""
    roles: tuple[str, ...] = ("system",)


# Claude Code puts `x-anthropic-billing-header: cc_version=…; cc_entrypoint=…; …` first in
# the system prompt, with a suffix that differs per session. Left alone, every new session
# diverges from the cached 30k-token agent prompt at token ~15. The header is a system block
# of its own, and joined blocks put the real prompt on the same line, so the rule takes
# `key=value;` fields (the last may end the line instead), never the rest of the line.
CLAUDE_CODE_BILLING_HEADER = NormalizationRule(
    name="claude_code_billing_header",
    pattern=re.compile(
        r"^x-anthropic-billing-header:(?:[ \t]*[\w.-]+=[^;\n]*(?:;|$))*[ \t]*\n?", re.MULTILINE
    ),
    replacement="",
)


class Mode(StrEnum):
    """`[engine] speculative`: which drafter a sequence gets (speculation/control.py)."""

    OFF = "off"
    PROMPT_LOOKUP = "prompt-lookup"
    MTP = "mtp"
    AUTO = "auto"


@dataclass(slots=True)
class SpeculativeSettings:
    """`[engine] speculative` and the draft length bounds."""

    mode: Mode = Mode.AUTO
    min_draft: int = 1
    max_draft: int = 8
    min_ngram: int = 3
    # Tokens the MTP head drafts per verify pass: Qwen's head is trained for one; deeper
    # drafts chain the head on its own output and are accepted less often.
    mtp_depth: int = 1
    # Tests replace the drafter (an oracle, a corrupted oracle, one always wrong): it is
    # made per sequence from the prompt's tokens, and is a `speculation.drafters.Drafter`.
    drafter: Callable[[Sequence[int]], object] | None = field(default=None, repr=False)


@dataclass(frozen=True, slots=True)
class VisionLimits:
    """What one request may carry; each is answered with a 4xx naming the image."""

    max_image_bytes: int = 20 << 20
    # Decoded size, checked from the header before any pixel is decoded (decompression bombs).
    max_image_pixels: int = 50_000_000
    max_images: int = 100


@dataclass(slots=True)
class WarmAheadSettings:
    """`[cache.warm_ahead]`: the next question's prefix prefilled while idle (warm_ahead.py)."""

    enabled: bool = True
    # Sessions whose next question waits to be warmed; the oldest offer goes beyond this.
    max_sessions: int = 4
    # Tokens prefilled ahead per minute, at most (a token bucket a minute deep).
    tokens_per_minute: int = 120_000
    # The RAM tier's share one warm-up may fill (its new K/V bytes, estimated).
    max_ram_share: float = 0.5
    # Seconds with no request before a warm-up starts: an agent or script sends its next
    # request within milliseconds, and would wait for the warm-up's prefill chunk in
    # progress (measured: 1.6x the total TTFT of the bench's replayed agent trace); a
    # person reading the answer takes longer than this.
    after_idle_s: float = 1.0
    # Fewer new tokens than this are not worth a job: the question prefills them itself.
    min_tokens: int = 16
    # A preempted warm-up is offered again this many times.
    retries: int = 3


@dataclass(slots=True)
class EngineSettings:
    cache_dir: Path
    model_specs: list[str] = field(default_factory=list)
    lmstudio_dirs: list[Path] = field(default_factory=list)
    cache_enabled: bool = True
    serve_all_mlx: bool = False
    ram_budget_bytes: int = 1 << 30
    # `[cache.ram] budget` as a share ("20%"): of what a model's weights leave, derived at
    # each load by the memory preflight; None: ram_budget_bytes is a size, taken as given.
    ram_budget_share: float | None = None
    # Before each load, check weights + K/V + RAM tier budgets against free memory
    # (preflight.py): unload idle models, then refuse with a 503 rather than swap.
    memory_preflight: bool = True
    # Under memory pressure (the system's available memory below this), the RAM tier
    # shrinks, spilling to SSD, instead of the OS killing the process; None: no guard.
    ram_min_available_bytes: int | None = None
    memory_check_s: float = 2.0
    # The share of the RAM budget entries read twice or more keep past eviction's turn
    # (cache/ram/manager.py); 0: plain LRU. [autotune] adapts it.
    ram_protect_frequent: float = 0.0
    autotune: AutotuneSettings = field(default_factory=AutotuneSettings)
    # The RAM tier never shrinks below this under pressure (a few sessions' prefixes).
    ram_pressure_min_budget_bytes: int = 64 << 20
    idle_unload_s: float | None = None
    ssd_enabled: bool = True
    ssd_max_bytes: int = 10 * 1000**3
    ssd_ttl_s: float | None = None
    ssd_queue_size: int = 256
    ssd_write_through: bool = True
    # When the SSD is written (cache/write_policy.py); None: ssd_write_through decides.
    ssd_write_policy: WritePolicy | None = None
    ssd_max_write_per_day: int | None = None  # bytes per UTC day; None: no cap
    # Checkpoints are written once they stayed the deepest on their path this long.
    ssd_checkpoint_delay_s: float = 60.0
    # How long shutdown waits for queued SSD writes.
    ssd_drain_s: float = 10.0
    # The Redis/Valkey tier several machines share ([cache.shared]); None: off.
    shared: SharedConfig | None = None
    # Warn when the hit ratio of the last 20 cacheable requests falls below this (0: off).
    alert_hit_ratio: float = 0.5
    # Client sessions (/v1/cache/sessions): idle ones expire after this many seconds
    # (None: never); pinned ones hold at most this much RAM (None: a quarter of the budget).
    session_ttl_s: float | None = None
    pin_max_bytes: int | None = None
    cache_policy: CachePolicy = field(default_factory=CachePolicy)
    # The scheduler: how many sequences of one model decode together, how many requests
    # may wait beyond those (more answer 429), how many prompt tokens one step prefills,
    # and how many bytes the live K/V of running sequences may take (None: a share of RAM).
    max_batch: int = 8
    max_queue: int = 64
    prefill_chunk: int = 512
    kv_memory_bytes: int | None = None
    # Speculative decoding ([engine] speculative and its draft bounds).
    speculation: SpeculativeSettings = field(default_factory=SpeculativeSettings)
    normalization: list[NormalizationRule] = field(
        default_factory=lambda: [CLAUDE_CODE_BILLING_HEADER]
    )
    # Images per request and per image ([vision]); over a limit answers 4xx.
    vision_limits: VisionLimits = field(default_factory=VisionLimits)
    # Templates that drop earlier reasoning with no flag to keep it: the next question's
    # prefix is prefilled while the machine is idle (warm_ahead.py). Off for an engine
    # built in-process (tests, probes), whose next request must hit what it predicts; the
    # server's config turns it on ([cache.warm_ahead] enabled, true by default).
    warm_ahead: WarmAheadSettings = field(default_factory=lambda: WarmAheadSettings(enabled=False))
    # The reasoning generated per assistant turn, put back where a client drops it (bytes).
    reasoning_memo_bytes: int = 16 << 20
    # The ranks one model is split across (a distributed.world.World); None: this process
    # alone. Typed loosely: the world holds an mx.distributed group, and this module
    # loads no mlx.
    world: Any = None
    # How to split each model when this process is one of several ranks mlx.launch started
    # ("tensor" or "pipeline"): the engine joins their world. None: it never joins one.
    split_mode: str | None = None
    # Rank 0 ends the requests of a step the other ranks leave unanswered this long (503).
    rank_deadline_s: float = 60.0
