"""Typed configuration: defaults < TOML file < environment < command-line flags.

Environment variables are the config key path with the prefix ``MLX_PROMPT_CACHE_``,
upper-cased, dots turned into underscores::

    server.port          -> MLX_PROMPT_CACHE_SERVER_PORT=1236
    upstream.url         -> MLX_PROMPT_CACHE_UPSTREAM_URL=http://127.0.0.1:1234
    models.serve         -> MLX_PROMPT_CACHE_MODELS_SERVE=demo-llama,demo-hybrid
    engine.max_batch     -> MLX_PROMPT_CACHE_ENGINE_MAX_BATCH=4
    cache.ram.budget     -> MLX_PROMPT_CACHE_CACHE_RAM_BUDGET=8GB
    cache.ssd.dir        -> MLX_PROMPT_CACHE_CACHE_SSD_DIR=/Volumes/fast/cache
    tenants.api_keys     -> MLX_PROMPT_CACHE_TENANTS_API_KEYS=sk-a=alice,sk-b=bob

Booleans take 1/0, true/false, yes/no, on/off; lists are comma-separated; an optional
value is cleared by an empty string or ``none``. ``normalization.rules`` (a list of
tables) and ``[model."<pattern>"]`` (a table of tables) can only be set in the file.
``env_var_names()`` lists every variable.

The sections live here; ``loader`` layers the sources, ``schema`` builds the sections
from raw values and ``validate`` checks ranges and formats.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from proxy.config.model_settings import ModelSettings
from proxy.config.shared import SharedCacheConfig


@dataclass(slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 1235
    max_body_bytes: int = 32 * 1024 * 1024
    log_level: str = "info"
    log_json: bool = False
    # Host header values answered beyond loopback names and the bind address ("name",
    # "name:port", "[v6]:port"); "*" answers any Host and gives up DNS-rebinding defence.
    allowed_hosts: list[str] = field(default_factory=list)
    # Browser origins allowed cross-origin (CORS), like "http://localhost:3000"; empty: off.
    cors_origins: list[str] = field(default_factory=list)
    # Listen on a non-loopback address without [tenants] api_keys (serve --insecure).
    insecure: bool = False
    # A stream silent this long (a long prompt's prefill before the first token) gets a beat
    # its client ignores but counts as activity; "10s", "1m" or seconds; 0 turns it off.
    stream_keepalive: str | float = "10s"


@dataclass(slots=True)
class UpstreamConfig:
    url: str = "http://127.0.0.1:1234"
    enabled: bool = True
    # Longest silence between two chunks from the upstream, not a cap on the whole
    # response: a long generation streams for minutes and must not be cut off.
    timeout_s: float = 600.0
    connect_timeout_s: float = 2.0
    # LM Studio's API token (its server's "Require authentication" setting), sent as
    # `Authorization: Bearer` on its REST API (/api/v1, /api/v0); None: no token.
    api_token: str | None = None
    # Before a model loads here, LM Studio unloads its own instances of the same model, so
    # the Mac holds one copy of the weights (proxy/upstream/one_copy.py); false leaves LM Studio be.
    unload_duplicates: bool = True


@dataclass(slots=True)
class ModelsConfig:
    # Empty means the built-in demo models, unless serve_all_mlx is set.
    serve: list[str] = field(default_factory=list)
    serve_all_mlx: bool = False
    lmstudio_dirs: list[str] = field(
        default_factory=lambda: ["~/.lmstudio/models", "~/.cache/lm-studio/models"]
    )
    idle_unload_s: float | None = None


@dataclass(slots=True)
class EngineConfig:
    # Sequences of one model that decode together in one step.
    max_batch: int = 8
    # Requests that may wait beyond a full batch; more are answered 429 with Retry-After.
    max_queue: int = 64
    # Prompt tokens one step prefills, so a long prompt does not stall the batch's decoding.
    prefill_chunk: int = 512
    # Cap on the live K/V of running sequences: "4GB", "30%" of RAM; None leaves it to
    # the engine.
    kv_memory: str | int | None = None
    # Speculative decoding: "off", "prompt-lookup", "mtp" or "auto" (prompt lookup, or a
    # model's MTP head on a GPU), and the bounds of the draft length it adapts between.
    speculative: str = "auto"
    speculative_min_draft: int = 1
    speculative_max_draft: int = 8
    # Tokens an MTP head drafts per verify pass (Qwen's head is trained for 1).
    speculative_mtp_depth: int = 1
    # Before each load, check weights + K/V + RAM cache budgets against free memory:
    # unload idle models first, else refuse with a 503 instead of swapping.
    memory_preflight: bool = True


@dataclass(slots=True)
class WarmAheadConfig:
    # Templates that drop earlier reasoning with no flag to keep it (Qwen3.5, MiniMax M2,
    # gpt-oss, Gemma 4, GLM-4.7 by default): when a turn ends with an answer, the next
    # question's prefix is prefilled while no request runs; any request preempts it.
    enabled: bool = True
    # Sessions waiting to be warmed; the oldest offer is dropped beyond this.
    max_sessions: int = 4
    # Tokens prefilled ahead per minute, at most.
    tokens_per_minute: int = 120_000
    # The RAM tier's share one warm-up may fill.
    max_ram_share: float = 0.5
    # Seconds with no request before a warm-up starts (scripts and agents send their next
    # request at once; a person reads first).
    after_idle: float = 1.0


@dataclass(slots=True)
class RamCacheConfig:
    # "20%" of available RAM, or a size: "8GB", "512MiB", 8000000000.
    budget: str | int = "20%"
    quantize_bits: int = 0
    checkpoint_interval: int = 1024
    keep_periodic: bool = False
    # The share of the budget entries read twice or more keep past eviction's turn (0:
    # plain LRU); [autotune] adapts it from here. "auto": 0 with [autotune] off, and with
    # it on the middle of the range, for what comes back to lean it either way.
    protect_frequent: str | float = "auto"
    # Memory pressure: when the system's available memory falls below this ("5%" of all
    # RAM, or a size), the RAM tier shrinks and spills to SSD; "off" turns the guard off.
    min_available: str | int = "5%"


@dataclass(slots=True)
class SsdCacheConfig:
    enabled: bool = True
    dir: str = "~/.cache/mlx-prompt-cache"
    max_size: str | int = "10GB"
    # None keeps entries until capacity evicts them; else "7d", "12h", "90m" or seconds.
    ttl: str | float | None = None
    # When the SSD is written: "through" (as stored), "evict" (only what RAM evicts) or
    # "second-use" (once a later request reuses it). None: "through", or write_through's.
    write_policy: str | None = None
    # The older switch, an alias: true is "through", false "evict"; an error if it
    # disagrees with write_policy.
    write_through: bool | None = None
    queue_size: int = 256
    # Bytes the SSD tier may write per UTC day ("20GB"); None: no cap. Reads go on.
    max_write_per_day: str | int | None = None
    # A checkpoint is written once it has stayed the deepest on its path this long
    # (superseded ones never are); "60s", "5m" or seconds; 0 writes at once.
    checkpoint_write_delay: str | float = "60s"

    @property
    def path(self) -> Path:
        return Path(self.dir).expanduser()


@dataclass(slots=True)
class CacheConfig:
    enabled: bool = True
    block_size: int = 64
    # Client sessions idle this long ("12h", "90m", seconds) lose their own cached entries
    # from RAM and SSD (what they share with others stays); None: never.
    session_ttl: str | float | None = None
    # RAM pinned sessions may hold against eviction: a share of the RAM budget or a size.
    pin_max: str | int = "25%"
    # Warn (log, dashboard, GET /v1/cache/stats) when the hit ratio of the last 20 requests
    # that used the cache falls below this; 0 turns the alert off.
    alert_hit_ratio: float = 0.5
    # The reasoning generated for each assistant turn, kept to put back where a client
    # sends the turn without it (so the prompt is the previous one plus what was generated).
    reasoning_memo: str | int = "16MB"
    warm_ahead: WarmAheadConfig = field(default_factory=WarmAheadConfig)
    ram: RamCacheConfig = field(default_factory=RamCacheConfig)
    ssd: SsdCacheConfig = field(default_factory=SsdCacheConfig)
    shared: SharedCacheConfig = field(default_factory=SharedCacheConfig)


@dataclass(slots=True)
class TenantsConfig:
    header: str = "x-tenant"
    # API key -> tenant name; a request with a known key is cached under that tenant.
    api_keys: dict[str, str] = field(default_factory=dict)
    default: str = "local"


@dataclass(slots=True)
class Rule:
    name: str
    pattern: str
    replacement: str = ""
    roles: list[str] = field(default_factory=lambda: ["system"])


@dataclass(slots=True)
class NormalizationConfig:
    # Claude Code puts a per-request billing line in the system prompt; stripping it keeps
    # the prefix (and so the cache) identical from one request to the next.
    claude_code_billing_header: bool = True
    rules: list[Rule] = field(default_factory=list)
    log_divergence: bool = True


@dataclass(slots=True)
class VisionConfig:
    # Images in requests (models with a vision tower, and the vision extra installed).
    # Larger images or more of them answer 413/400 naming the image.
    max_image_size: str | int = "20MB"
    # Width x height, read from the header before decoding (decompression bombs).
    max_image_pixels: int = 50_000_000
    max_images: int = 100


@dataclass(slots=True)
class DistributedConfig:
    # One model split across several processes (docs/distributed.md): `ranks` of them on
    # this machine over loopback (to try a split out), or one per host of `hostfile`
    # (mlx.launch's JSON, this machine first). 0 or 1 ranks and no hostfile: one process.
    ranks: int = 0
    hostfile: str | None = None
    backend: str = "ring"  # "ring" (TCP: Ethernet, Thunderbolt bridge) or "jaccl" (RDMA)
    mode: str = "tensor"  # "tensor": every rank holds its heads; "pipeline": its layers
    # The first TCP port of the links between the ranks (each rank one more); None: 32323.
    port: int | None = None
    # A step the other ranks leave unanswered this long ends its requests with a 503, and
    # the ranks are started again ("60s", "2m" or seconds).
    deadline: str | float = "60s"


@dataclass(slots=True)
class AutotuneConfig:
    # The RAM budget and eviction policy tuned by load (docs/observability.md): the budget
    # grows from [cache.ram] budget up to `ram_max` while evicted entries keep coming back,
    # and protect_frequent follows what came back. false: the fixed settings, exactly.
    enabled: bool = True
    ram_max: str | int = "auto"  # "auto": twice [cache.ram] budget; or a size
    interval: str | float = "10s"


@dataclass(slots=True)
class AlertsConfig:
    # Alerts that name a cause of lost tokens and its fix (GET /v1/cache/diagnosis): when
    # the hit ratio falls below [cache] alert_hit_ratio, or one cause passes `cause_share`
    # of the tokens computed again, over the last `window`. Always logged; POSTed as JSON
    # to `webhook` when set. One notice per alert per `repeat`; cleared when the cause goes.
    webhook: str | None = None
    cause_share: float = 0.3  # 0: alerts by cause off
    min_tokens: int = 4096  # a window that lost fewer tokens raises nothing
    window: str | float = "15m"
    repeat: str | float = "15m"
    interval: str | float = "10s"  # how often the diagnosis is read


@dataclass(slots=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    upstream: UpstreamConfig = field(default_factory=UpstreamConfig)
    models: ModelsConfig = field(default_factory=ModelsConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    tenants: TenantsConfig = field(default_factory=TenantsConfig)
    normalization: NormalizationConfig = field(default_factory=NormalizationConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    alerts: AlertsConfig = field(default_factory=AlertsConfig)
    autotune: AutotuneConfig = field(default_factory=AutotuneConfig)
    # [model."<pattern>"] sections: per-model sampling defaults and template kwargs,
    # keyed by model id, LM Studio key or a glob over either (config/model_settings.py).
    model: dict[str, ModelSettings] = field(default_factory=dict)
