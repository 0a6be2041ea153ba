"""Range and format checks on a built Config that its field types alone cannot express.

Each failure names the key and where it was set (file line, env var or flag).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from engine_bridge.engine_settings import Mode, resolve_write_policy
from proxy.config.model_settings import validate_model_settings
from proxy.config.schema import key_error
from proxy.config.shared import validate_shared
from proxy.config.tomltext import Origins
from proxy.config.units import (
    parse_duration,
    parse_size,
    resolve_kv_memory,
    resolve_min_available,
    resolve_ram_budget,
    resolve_share_of_ram,
)
from proxy.security import check_host_entry, check_origin_entry

if TYPE_CHECKING:
    from proxy.config.model import Config

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")


def validate(config: Config, origins: Origins) -> None:
    """Raise ConfigError for the first value out of range or unparseable."""

    def check(path: str, ok: bool, message: str) -> None:
        if not ok:
            raise key_error(tuple(path.split(".")), origins, message)

    def parses(path: str, fn: Any, value: Any) -> None:
        try:
            fn(value)
        except ValueError as exc:
            raise key_error(tuple(path.split(".")), origins, str(exc)) from None

    s, u, c = config.server, config.upstream, config.cache
    check("server.port", 0 <= s.port <= 65535, f"port {s.port} is not in 0..65535")
    check("server.max_body_bytes", s.max_body_bytes > 0, "must be positive")
    check("server.log_level", s.log_level.lower() in LOG_LEVELS, f"must be one of {LOG_LEVELS}")
    parses("server.stream_keepalive", parse_duration, s.stream_keepalive)
    for name, entries, entry_check in (
        ("allowed_hosts", s.allowed_hosts, check_host_entry),
        ("cors_origins", s.cors_origins, check_origin_entry),
    ):
        for i, entry in enumerate(entries):
            try:
                entry_check(entry)
            except ValueError as exc:
                raise key_error(("server", name, i), origins, str(exc)) from None
    check(
        "upstream.url",
        re.match(r"^https?://[^/\s]+", u.url) is not None,
        f"{u.url!r} is not an http:// or https:// URL",
    )
    check("upstream.timeout_s", u.timeout_s > 0, "must be positive")
    check("upstream.connect_timeout_s", u.connect_timeout_s > 0, "must be positive")
    if u.api_token is not None:
        # It goes into a header: whitespace or control characters would break or split it.
        check(
            "upstream.api_token",
            re.fullmatch(r"[\x21-\x7e]+", u.api_token) is not None,
            "must be printable ASCII without spaces (LM Studio's API token)",
        )
    idle = config.models.idle_unload_s
    check("models.idle_unload_s", idle is None or idle > 0, "must be positive")
    e = config.engine
    check("engine.max_batch", e.max_batch >= 1, f"must be at least 1, got {e.max_batch}")
    check("engine.max_queue", e.max_queue >= 0, f"must be 0 or more, got {e.max_queue}")
    check(
        "engine.prefill_chunk",
        e.prefill_chunk >= 16,
        f"must be at least 16 tokens, got {e.prefill_chunk}",
    )
    if e.kv_memory is not None:
        parses("engine.kv_memory", lambda v: resolve_kv_memory(v, 1 << 30), e.kv_memory)
    modes = [m.value for m in Mode]
    check("engine.speculative", e.speculative in modes,
          f"must be one of {', '.join(modes)}, got {e.speculative!r}")  # fmt: skip
    check(
        "engine.speculative_min_draft",
        1 <= e.speculative_min_draft <= e.speculative_max_draft <= 64,
        "the draft bounds must satisfy 1 <= speculative_min_draft <= speculative_max_draft"
        f" <= 64, got {e.speculative_min_draft} and {e.speculative_max_draft}",
    )
    check("engine.speculative_mtp_depth", 1 <= e.speculative_mtp_depth <= 8,
          f"must be 1 to 8 tokens, got {e.speculative_mtp_depth}")  # fmt: skip
    v = config.vision
    parses("vision.max_image_size", parse_size, v.max_image_size)
    check("vision.max_image_pixels", v.max_image_pixels > 0, "must be positive")
    check("vision.max_images", v.max_images >= 0, f"must be 0 or more, got {v.max_images}")
    check("cache.block_size", c.block_size > 0, "must be positive")
    if c.session_ttl is not None:
        parses("cache.session_ttl", parse_duration, c.session_ttl)
    parses("cache.pin_max", lambda v: resolve_share_of_ram(v, 1 << 30, "pin_max"), c.pin_max)
    check(
        "cache.alert_hit_ratio",
        0 <= c.alert_hit_ratio <= 1,
        f"must be from 0 (off) to 1, got {c.alert_hit_ratio}",
    )
    parses("cache.reasoning_memo", parse_size, c.reasoning_memo)
    w = c.warm_ahead
    check("cache.warm_ahead.max_sessions", w.max_sessions >= 1, "must be 1 or more")
    check("cache.warm_ahead.tokens_per_minute", w.tokens_per_minute >= 0, "must be 0 or more")
    check("cache.warm_ahead.max_ram_share", 0 < w.max_ram_share <= 1,
          f"must be above 0 and at most 1, got {w.max_ram_share}")  # fmt: skip
    check(
        "cache.warm_ahead.after_idle", w.after_idle >= 0, f"must be 0 or more, got {w.after_idle}"
    )
    parses("cache.ram.budget", lambda v: resolve_ram_budget(v, 0), c.ram.budget)
    if c.ram.min_available != "off":
        parses(
            "cache.ram.min_available",
            lambda v: resolve_min_available(v, 1 << 30),
            c.ram.min_available,
        )
    check("cache.ram.quantize_bits", c.ram.quantize_bits in (0, 4, 8), "must be 0, 4 or 8")
    check("cache.ram.checkpoint_interval", c.ram.checkpoint_interval > 0, "must be positive")
    parses("cache.ssd.max_size", parse_size, c.ssd.max_size)
    if c.ssd.ttl is not None:
        parses("cache.ssd.ttl", parse_duration, c.ssd.ttl)
    check("cache.ssd.queue_size", c.ssd.queue_size > 0, "must be positive")
    parses(
        "cache.ssd.write_policy",
        lambda v: resolve_write_policy(v, c.ssd.write_through),
        c.ssd.write_policy,
    )
    if c.ssd.max_write_per_day is not None:
        parses("cache.ssd.max_write_per_day", parse_size, c.ssd.max_write_per_day)
        check(
            "cache.ssd.max_write_per_day",
            parse_size(c.ssd.max_write_per_day) > 0,
            "must be positive",
        )
    parses("cache.ssd.checkpoint_write_delay", parse_duration, c.ssd.checkpoint_write_delay)
    validate_shared(c.shared, check, parses)
    check("tenants.header", bool(config.tenants.header.strip()), "must not be empty")
    t = config.autotune
    if t.ram_max != "auto":
        parses("autotune.ram_max", parse_size, t.ram_max)
    parses("autotune.interval", parse_duration, t.interval)
    check("autotune.interval", parse_duration(t.interval) >= 1, "must be at least 1s")
    pf = c.ram.protect_frequent
    check("cache.ram.protect_frequent", pf == "auto" or 0 <= _number(pf, -1.0) <= 0.9,
          f'must be "auto" or 0 to 0.9, got {pf!r}')  # fmt: skip
    a = config.alerts
    check("alerts.cause_share", 0 <= a.cause_share <= 1, f"must be 0 to 1, got {a.cause_share}")
    check("alerts.min_tokens", a.min_tokens >= 0, f"must be 0 or more, got {a.min_tokens}")
    check("alerts.webhook", a.webhook is None or a.webhook.startswith(("http://", "https://")),
          f"must be an http:// or https:// URL, got {a.webhook!r}")  # fmt: skip
    for name in ("window", "repeat", "interval"):
        parses(f"alerts.{name}", parse_duration, getattr(a, name))
    d = config.distributed
    check("distributed.ranks", 0 <= d.ranks <= 64, f"must be 0 to 64, got {d.ranks}")
    check("distributed.backend", d.backend in ("ring", "jaccl"),
          f'must be "ring" or "jaccl", got {d.backend!r}')  # fmt: skip
    check("distributed.mode", d.mode in ("tensor", "pipeline"),
          f'must be "tensor" or "pipeline", got {d.mode!r}')  # fmt: skip
    check("distributed.hostfile", not (d.hostfile and d.ranks > 1),
          "give ranks (this machine) or a hostfile (one rank per host), not both")  # fmt: skip
    if d.port is not None:
        check("distributed.port", 1024 <= d.port <= 65000, f"must be 1024 to 65000, got {d.port}")
    parses("distributed.deadline", parse_duration, d.deadline)
    check("distributed.deadline", parse_duration(d.deadline) >= 1, "must be at least 1s")
    for i, rule in enumerate(config.normalization.rules):
        path = ("normalization", "rules", i)
        try:
            re.compile(rule.pattern)
        except re.error as exc:
            raise key_error((*path, "pattern"), origins, f"invalid regex: {exc}") from None
        for role in rule.roles:
            if role not in MESSAGE_ROLES:
                raise key_error((*path, "roles"), origins, f"unknown role {role!r}")
    validate_model_settings(config.model, origins)


def _number(value: str | float, default: float) -> float:
    """`value` as a number (an environment variable spells one as a string), else `default`."""
    try:
        return float(value)
    except ValueError:
        return default
