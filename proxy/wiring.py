"""Turn the typed config into the settings each layer takes (engine, HTTP app)."""

from __future__ import annotations

import re
from pathlib import Path

import psutil

from engine_bridge.engine_settings import (
    CLAUDE_CODE_BILLING_HEADER,
    AutotuneSettings,
    CachePolicy,
    EngineSettings,
    Mode,
    NormalizationRule,
    SpeculativeSettings,
    VisionLimits,
    WarmAheadSettings,
    resolve_write_policy,
)

from .config.model import Config
from .config.model_settings import ModelSettingsTable, lmstudio_key
from .config.shared import shared_settings
from .config.units import (
    parse_duration,
    parse_size,
    ram_share,
    resolve_kv_memory,
    resolve_min_available,
    resolve_ram_budget,
    resolve_share_of_ram,
)
from .state import AlertRules, ProxySettings
from .upstream.one_copy import UnloadDuplicates


def normalization_rules(config: Config) -> list[NormalizationRule]:
    rules = [CLAUDE_CODE_BILLING_HEADER] if config.normalization.claude_code_billing_header else []
    for r in config.normalization.rules:
        rules.append(
            NormalizationRule(
                r.name, re.compile(r.pattern, re.MULTILINE), r.replacement, tuple(r.roles)
            )
        )
    return rules


def engine_settings(config: Config, rank: bool = False) -> EngineSettings:
    """`rank`: this process is one rank of a split model ([distributed]), started by the
    front through mlx.launch: the engine joins the other ranks."""
    cache = config.cache
    engine = config.engine
    ram = psutil.virtual_memory()
    return EngineSettings(
        cache_dir=cache.ssd.path,
        model_specs=list(config.models.serve),
        lmstudio_dirs=[Path(d) for d in config.models.lmstudio_dirs],
        serve_all_mlx=config.models.serve_all_mlx,
        idle_unload_s=config.models.idle_unload_s,
        cache_enabled=cache.enabled,
        ram_budget_bytes=resolve_ram_budget(cache.ram.budget, ram.available),
        # A share is of what the weights leave, derived at each load (engine_bridge/models/preflight.py).
        ram_budget_share=ram_share(cache.ram.budget),
        ram_min_available_bytes=None
        if cache.ram.min_available == "off"
        else resolve_min_available(cache.ram.min_available, ram.total),
        max_batch=engine.max_batch,
        max_queue=engine.max_queue,
        prefill_chunk=engine.prefill_chunk,
        memory_preflight=engine.memory_preflight,
        speculation=SpeculativeSettings(
            mode=Mode(engine.speculative),
            min_draft=engine.speculative_min_draft,
            max_draft=engine.speculative_max_draft,
            mtp_depth=engine.speculative_mtp_depth,
        ),
        kv_memory_bytes=None
        if engine.kv_memory is None
        else resolve_kv_memory(engine.kv_memory, ram.total),
        ram_protect_frequent=protect_frequent(config),
        autotune=AutotuneSettings(
            enabled=config.autotune.enabled,
            ram_max_bytes=None
            if config.autotune.ram_max == "auto"
            else parse_size(config.autotune.ram_max),
            interval_s=parse_duration(config.autotune.interval),
        ),
        cache_policy=CachePolicy(
            block_size=cache.block_size,
            checkpoint_interval=cache.ram.checkpoint_interval,
            keep_periodic=cache.ram.keep_periodic,
            quantize_bits=cache.ram.quantize_bits,
            log_divergence=config.normalization.log_divergence,
        ),
        normalization=normalization_rules(config),
        ssd_enabled=cache.ssd.enabled,
        ssd_max_bytes=parse_size(cache.ssd.max_size),
        ssd_ttl_s=parse_duration(cache.ssd.ttl) if cache.ssd.ttl is not None else None,
        ssd_queue_size=cache.ssd.queue_size,
        ssd_write_policy=resolve_write_policy(cache.ssd.write_policy, cache.ssd.write_through),
        ssd_max_write_per_day=None
        if cache.ssd.max_write_per_day is None
        else parse_size(cache.ssd.max_write_per_day),
        ssd_checkpoint_delay_s=parse_duration(cache.ssd.checkpoint_write_delay),
        shared=shared_settings(cache.shared),
        session_ttl_s=None if cache.session_ttl is None else parse_duration(cache.session_ttl),
        pin_max_bytes=resolve_share_of_ram(
            cache.pin_max, resolve_ram_budget(cache.ram.budget, ram.available), "pin_max"
        ),
        alert_hit_ratio=cache.alert_hit_ratio,
        reasoning_memo_bytes=parse_size(cache.reasoning_memo),
        warm_ahead=WarmAheadSettings(
            enabled=cache.warm_ahead.enabled and cache.enabled,
            max_sessions=cache.warm_ahead.max_sessions,
            tokens_per_minute=cache.warm_ahead.tokens_per_minute,
            max_ram_share=cache.warm_ahead.max_ram_share,
            after_idle_s=cache.warm_ahead.after_idle,
        ),
        split_mode=config.distributed.mode if rank else None,
        rank_deadline_s=parse_duration(config.distributed.deadline),
        vision_limits=VisionLimits(
            max_image_bytes=parse_size(config.vision.max_image_size),
            max_image_pixels=config.vision.max_image_pixels,
            max_images=config.vision.max_images,
        ),
    )


def protect_frequent(config: Config) -> float:
    """[cache.ram] protect_frequent, "auto" resolved: where tuning starts it, or plain LRU."""
    pf = config.cache.ram.protect_frequent
    if pf != "auto":
        return float(pf)
    return AutotuneSettings.PROTECT_START if config.autotune.enabled else 0.0


def proxy_settings(config: Config) -> ProxySettings:
    return ProxySettings(
        max_body_bytes=config.server.max_body_bytes,
        cache_enabled=config.cache.enabled,
        tenant_header=config.tenants.header,
        tenant_api_keys=dict(config.tenants.api_keys),
        default_tenant=config.tenants.default,
        model_settings=model_settings(config),
        stream_keepalive_s=parse_duration(config.server.stream_keepalive),
        alerts=AlertRules(
            webhook=config.alerts.webhook,
            window_s=parse_duration(config.alerts.window),
            interval_s=parse_duration(config.alerts.interval),
            hit_ratio=config.cache.alert_hit_ratio,
            cause_share=config.alerts.cause_share,
            min_tokens=config.alerts.min_tokens,
            repeat_s=parse_duration(config.alerts.repeat),
        ),
    )


def model_settings(config: Config) -> ModelSettingsTable:
    """The [model."<pattern>"] sections, with the LM Studio key of each model served from
    a folder outside LM Studio's (inside, its id is that key already)."""
    keys = {}
    for spec in config.models.serve:
        path = Path(spec).expanduser()
        if path.is_dir():
            path = path.resolve()
            keys[path.name] = lmstudio_key(path)  # the id the engine gives such a folder
    return ModelSettingsTable(config.model, keys)


def before_load_hook(config: Config) -> UnloadDuplicates | None:
    """What the engine awaits before each load: LM Studio unloads its copy of the model."""
    upstream = config.upstream
    if not (upstream.enabled and upstream.unload_duplicates):
        return None
    return UnloadDuplicates(upstream.url, upstream.api_token, upstream.connect_timeout_s)
