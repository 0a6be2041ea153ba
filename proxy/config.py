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
value is cleared by an empty string or ``none``. ``normalization.rules`` is a list of
tables and can only be set in the file. ``env_var_names()`` lists every variable.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import tomllib
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine_bridge.cache.write_policy import resolve_write_policy
from proxy import tomltext
from proxy.security import check_host_entry, check_origin_entry, is_loopback_bind
from proxy.tomltext import Origins

# Re-exported: callers read sizes and durations through the config module.
from proxy.units import RAM_BUDGET_FLOOR as RAM_BUDGET_FLOOR
from proxy.units import parse_duration as parse_duration
from proxy.units import parse_size as parse_size
from proxy.units import resolve_kv_memory as resolve_kv_memory
from proxy.units import resolve_min_available as resolve_min_available
from proxy.units import resolve_ram_budget as resolve_ram_budget
from proxy.units import resolve_share_of_ram as resolve_share_of_ram

log = logging.getLogger(__name__)

ENV_PREFIX = "MLX_PROMPT_CACHE_"
DEFAULT_CONFIG_PATH = Path("~/.config/mlx-prompt-cache/config.toml")

# Variables with our prefix that are not config keys (read by scripts, not by load_config).
_ENV_NOT_CONFIG = frozenset({ENV_PREFIX + "URL", ENV_PREFIX + "CONFIG"})

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")


class ConfigError(ValueError):
    """A config file, environment variable or flag that cannot be used as given."""


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


@dataclass(slots=True)
class UpstreamConfig:
    url: str = "http://127.0.0.1:1234"
    enabled: bool = True
    # Longest silence between two chunks from the upstream, not a cap on the whole
    # response: a long generation streams for minutes and must not be cut off.
    timeout_s: float = 600.0
    connect_timeout_s: float = 2.0


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


@dataclass(slots=True)
class RamCacheConfig:
    # "20%" of available RAM, or a size: "8GB", "512MiB", 8000000000.
    budget: str | int = "20%"
    quantize_bits: int = 0
    checkpoint_interval: int = 1024
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
    ram: RamCacheConfig = field(default_factory=RamCacheConfig)
    ssd: SsdCacheConfig = field(default_factory=SsdCacheConfig)


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
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    upstream: UpstreamConfig = field(default_factory=UpstreamConfig)
    models: ModelsConfig = field(default_factory=ModelsConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    tenants: TenantsConfig = field(default_factory=TenantsConfig)
    normalization: NormalizationConfig = field(default_factory=NormalizationConfig)


# ---------------------------------------------------------------------------------------
# Schema walking


@dataclass(slots=True, frozen=True)
class _Leaf:
    path: tuple[str, ...]
    tp: Any


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _leaves(cls: type = Config, prefix: tuple[str, ...] = ()) -> Iterator[_Leaf]:
    for f in dataclasses.fields(cls):
        tp = _hints(cls)[f.name]
        if _is_section(tp):
            yield from _leaves(tp, (*prefix, f.name))
        else:
            yield _Leaf((*prefix, f.name), tp)


def _env_name(path: tuple[str, ...]) -> str:
    return ENV_PREFIX + "_".join(path).upper()


def env_var_names() -> dict[str, str]:
    """Every environment variable load_config reads, mapped to its dotted config key."""
    names: dict[str, str] = {}
    for leaf in _leaves():
        if _list_item(leaf.tp) is Rule:
            continue  # a list of tables has no sensible one-line spelling
        name = _env_name(leaf.path)
        assert name not in names, f"env var {name} maps to {names[name]} and {leaf.path}"
        names[name] = ".".join(leaf.path)
    return names


def _union_args(tp: Any) -> tuple[Any, ...]:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return typing.get_args(tp)
    return (tp,)


def _list_item(tp: Any) -> Any:
    return typing.get_args(tp)[0] if typing.get_origin(tp) is list else None


def _type_name(tp: Any) -> str:
    names = {str: "a string", int: "an integer", float: "a number", bool: "a boolean"}
    parts = []
    for arg in _union_args(tp):
        if arg is type(None):
            continue
        if typing.get_origin(arg) is list:
            item = _list_item(arg)
            parts.append("an array of tables" if _is_section(item) else "an array of strings")
        elif typing.get_origin(arg) is dict:
            parts.append("a table of strings")
        else:
            parts.append(names[arg])
    return " or ".join(parts)


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return "a table"
    kinds = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array"}
    return f"{kinds.get(type(value), type(value).__name__)} {value!r}"


# ---------------------------------------------------------------------------------------
# Building the dataclasses from merged raw values


def _error(path: tuple[str | int, ...], origins: Origins, message: str) -> ConfigError:
    return ConfigError(f"config key {_dotted(path)}: {message} (at {origins.where(path)})")


def _dotted(path: tuple[str | int, ...]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def _coerce(value: Any, tp: Any, path: tuple[str | int, ...], origins: Origins) -> Any:
    """Check a raw TOML/flag value against a field type; ints widen to float, nothing else."""
    if _list_item(tp) is not None and _is_section(_list_item(tp)):
        if not isinstance(value, list):
            raise _error(path, origins, f"expected {_type_name(tp)}, got {_describe(value)}")
        item_cls = _list_item(tp)
        out = []
        for i, item in enumerate(value):
            if not isinstance(item, dict):
                raise _error((*path, i), origins, f"expected a table, got {_describe(item)}")
            out.append(_build(item_cls, item, (*path, i), origins))
        return out
    for arg in _union_args(tp):
        if arg is type(None):
            continue
        if typing.get_origin(arg) is list:
            if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
                return list(value)
        elif typing.get_origin(arg) is dict:
            if isinstance(value, dict) and all(isinstance(v, str) for v in value.values()):
                return dict(value)
        elif arg is bool:
            if isinstance(value, bool):
                return value
        elif arg is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        elif arg is float:
            if isinstance(value, int | float) and not isinstance(value, bool):
                return float(value)
        elif arg is str:
            if isinstance(value, str):
                return value
    raise _error(path, origins, f"expected {_type_name(tp)}, got {_describe(value)}")


def _build(cls: type, raw: Mapping[str, Any], path: tuple[str | int, ...], origins: Origins):
    hints = _hints(cls)
    for key in raw:
        if key not in hints:
            known = ", ".join(hints)
            raise _error((*path, key), origins, f"unknown key (known keys here: {known})")
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if f.name not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise _error((*path, f.name), origins, "missing required key")
            continue
        value = raw[f.name]
        if _is_section(tp):
            if not isinstance(value, dict):
                raise _error((*path, f.name), origins, f"expected a table, got {_describe(value)}")
            kwargs[f.name] = _build(tp, value, (*path, f.name), origins)
        else:
            kwargs[f.name] = _coerce(value, tp, (*path, f.name), origins)
    return cls(**kwargs)


def _validate(config: Config, origins: Origins) -> None:
    """Range and format checks that a type alone cannot express."""

    def check(path: str, ok: bool, message: str) -> None:
        if not ok:
            raise _error(tuple(path.split(".")), origins, message)

    def parses(path: str, fn: Any, value: Any) -> None:
        try:
            fn(value)
        except ValueError as exc:
            raise _error(tuple(path.split(".")), origins, str(exc)) from None

    s, u, c = config.server, config.upstream, config.cache
    check("server.port", 0 <= s.port <= 65535, f"port {s.port} is not in 0..65535")
    check("server.max_body_bytes", s.max_body_bytes > 0, "must be positive")
    check("server.log_level", s.log_level.lower() in LOG_LEVELS, f"must be one of {LOG_LEVELS}")
    for name, entries, entry_check in (
        ("allowed_hosts", s.allowed_hosts, check_host_entry),
        ("cors_origins", s.cors_origins, check_origin_entry),
    ):
        for i, entry in enumerate(entries):
            try:
                entry_check(entry)
            except ValueError as exc:
                raise _error(("server", name, i), origins, str(exc)) from None
    check(
        "upstream.url",
        re.match(r"^https?://[^/\s]+", u.url) is not None,
        f"{u.url!r} is not an http:// or https:// URL",
    )
    check("upstream.timeout_s", u.timeout_s > 0, "must be positive")
    check("upstream.connect_timeout_s", u.connect_timeout_s > 0, "must be positive")
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
    check("cache.block_size", c.block_size > 0, "must be positive")
    if c.session_ttl is not None:
        parses("cache.session_ttl", parse_duration, c.session_ttl)
    parses("cache.pin_max", lambda v: resolve_share_of_ram(v, 1 << 30, "pin_max"), c.pin_max)
    check(
        "cache.alert_hit_ratio",
        0 <= c.alert_hit_ratio <= 1,
        f"must be from 0 (off) to 1, got {c.alert_hit_ratio}",
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
    check("tenants.header", bool(config.tenants.header.strip()), "must not be empty")
    for i, rule in enumerate(config.normalization.rules):
        path = ("normalization", "rules", i)
        try:
            re.compile(rule.pattern)
        except re.error as exc:
            raise _error((*path, "pattern"), origins, f"invalid regex: {exc}") from None
        for role in rule.roles:
            if role not in MESSAGE_ROLES:
                raise _error((*path, "roles"), origins, f"unknown role {role!r}")


# ---------------------------------------------------------------------------------------
# Environment and flags


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _parse_text(text: str, tp: Any) -> Any:
    """A string (env var or flag) as a value of the field's type; raises ValueError."""
    args = _union_args(tp)
    if type(None) in args and text.strip().lower() in ("", "none"):
        return None
    if str in args:
        return text  # size/duration specs stay strings; _validate parses them
    for arg in args:
        if typing.get_origin(arg) is list:
            return [part.strip() for part in text.split(",") if part.strip()]
        if typing.get_origin(arg) is dict:
            out = {}
            for pair in filter(None, (p.strip() for p in text.split(","))):
                key, sep, value = pair.partition("=")
                if not sep or not key.strip():
                    raise ValueError(f"expected key=value pairs separated by commas, got {pair!r}")
                out[key.strip()] = value.strip()
            return out
        if arg is bool:
            low = text.strip().lower()
            if low in _TRUE | _FALSE:
                return low in _TRUE
            raise ValueError(f"expected a boolean (true/false, 1/0, yes/no, on/off), got {text!r}")
        if arg is int:
            try:
                return int(text.strip())
            except ValueError:
                raise ValueError(f"expected an integer, got {text!r}") from None
        if arg is float:
            try:
                return float(text.strip())
            except ValueError:
                raise ValueError(f"expected a number, got {text!r}") from None
    raise AssertionError(f"no text parser for {tp!r}")


def _set(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for part in path[:-1]:
        node = tree.setdefault(part, {})
        if not isinstance(node, dict):
            return  # the file has a non-table here; building reports that with its line
        tree = node
    if value is None:
        tree.pop(path[-1], None)  # None clears an optional key back to its default
    else:
        tree[path[-1]] = value


def _apply_env(tree: dict[str, Any], env: Mapping[str, str], origins: Origins) -> None:
    by_name = {_env_name(leaf.path): leaf for leaf in _leaves()}
    names = env_var_names()
    for name, text in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        if name not in names:
            if name not in _ENV_NOT_CONFIG:
                log.warning("ignoring %s: not a config key (known: %s)", name, ", ".join(names))
            continue
        leaf = by_name[name]
        try:
            value = _parse_text(text, leaf.tp)
        except ValueError as exc:
            raise ConfigError(f"environment variable {name} ({names[name]}): {exc}") from None
        _set(tree, leaf.path, value)
        origins.other[leaf.path] = f"environment variable {name}"


def _apply_overrides(tree: dict[str, Any], overrides: Mapping[str, Any], origins: Origins) -> None:
    leaves = {".".join(leaf.path): leaf for leaf in _leaves()}
    for key, value in overrides.items():
        if value is None:
            continue  # an argparse flag that was not given
        if key not in leaves:
            raise ConfigError(f"unknown config key {key!r} in overrides")
        leaf = leaves[key]
        if isinstance(value, os.PathLike):
            value = os.fspath(value)  # argparse type=Path flags such as --cache-dir
        if isinstance(value, str) and str not in _union_args(leaf.tp):
            try:
                value = _parse_text(value, leaf.tp)
            except ValueError as exc:
                raise ConfigError(f"override {key}: {exc}") from None
        _set(tree, leaf.path, value)
        origins.other[leaf.path] = f"override {key}"


# ---------------------------------------------------------------------------------------
# Public entry points


def load_config(
    path: Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """The effective config: ``overrides`` > ``env`` > file > defaults.

    ``path=None`` reads the default file if it exists; an explicit path must exist.
    ``env`` is usually ``os.environ``; ``overrides`` maps dotted keys (``"server.port"``)
    to flag values, and a ``None`` value means the flag was not given.
    """
    tree: dict[str, Any] = {}
    origins = Origins()
    file = path
    if file is None:
        default = DEFAULT_CONFIG_PATH.expanduser()
        file = default if default.is_file() else None
    if file is not None:
        file = Path(file).expanduser()
        try:
            text = file.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"config file {file} does not exist") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read config file {file}: {exc}") from None
        try:
            tree = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"invalid TOML in {file}: {exc}") from None
        origins = Origins(file, text)
    _apply_env(tree, env or {}, origins)
    _apply_overrides(tree, overrides or {}, origins)
    config = _build(Config, tree, (), origins)
    _validate(config, origins)
    return config


def check_exposure(config: Config) -> None:
    """Refuse to serve the network without API keys unless the user said --insecure."""
    host = config.server.host
    if is_loopback_bind(host) or config.tenants.api_keys or config.server.insecure:
        return
    raise ConfigError(
        f"server.host {host!r} is not a loopback address, so anyone on the network could run "
        "the models and read or clear the prompt cache. Set [tenants] api_keys (clients then "
        "send 'Authorization: Bearer KEY' or 'x-api-key: KEY'), bind to 127.0.0.1, or pass "
        "--insecure (server.insecure = true) to serve the network without keys"
    )


def config_to_toml(config: Config) -> str:
    """The effective config as TOML that load_config reads back to an equal Config."""
    return tomltext.dumps(config)
