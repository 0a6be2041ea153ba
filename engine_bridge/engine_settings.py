"""What an Engine is built with: the models, the cache tiers, the memory guard, the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .cache.shared.config import SharedConfig
from .cache.write_policy import WritePolicy
from .prompt_cache import CachePolicy
from .prompting.render import CLAUDE_CODE_BILLING_HEADER, NormalizationRule
from .scheduling.speculation.control import SpeculativeSettings
from .vision.prompt import VisionLimits
from .warm_ahead import WarmAheadSettings


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
