"""Loading the configuration: defaults < TOML file < environment < command-line flags.

Environment variables are the config key path with the prefix ``MLX_PROMPT_CACHE_``,
upper-cased, dots turned into underscores (``cache.ram.budget`` ->
``MLX_PROMPT_CACHE_CACHE_RAM_BUDGET=8GB``); see ``model`` for the keys and
``env_var_names()`` for every variable.
"""

from __future__ import annotations

import logging
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from proxy.config import tomltext
from proxy.config.model import Config
from proxy.config.schema import (
    ConfigError,
    build,
    leaves,
    one_line,
    parse_text,
    set_key,
    union_args,
)
from proxy.config.tomltext import Origins
from proxy.config.validate import validate
from proxy.security import is_loopback_bind

log = logging.getLogger(__name__)

ENV_PREFIX = "MLX_PROMPT_CACHE_"
DEFAULT_CONFIG_PATH = Path("~/.config/mlx-prompt-cache/config.toml")

# Variables with our prefix that are not config keys (read by scripts, not by load_config).
# Read elsewhere: the CLI's URL and config path, and the engine's test-only forced output
# (engine_bridge/scheduling/forced_output.py).
_ENV_NOT_CONFIG = frozenset(
    {ENV_PREFIX + "URL", ENV_PREFIX + "CONFIG", ENV_PREFIX + "FORCE_OUTPUT"}
)


# ---------------------------------------------------------------------------------------
# Environment and flags


def _env_name(path: tuple[str, ...]) -> str:
    return ENV_PREFIX + "_".join(path).upper()


def env_var_names() -> dict[str, str]:
    """Every environment variable load_config reads, mapped to its dotted config key."""
    names: dict[str, str] = {}
    for leaf in leaves(Config):
        if not one_line(leaf.tp):
            continue  # a list or table of tables has no sensible one-line spelling
        name = _env_name(leaf.path)
        assert name not in names, f"env var {name} maps to {names[name]} and {leaf.path}"
        names[name] = ".".join(leaf.path)
    return names


def _apply_env(tree: dict[str, Any], env: Mapping[str, str], origins: Origins) -> None:
    by_name = {_env_name(leaf.path): leaf for leaf in leaves(Config)}
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
            value = parse_text(text, leaf.tp)
        except ValueError as exc:
            raise ConfigError(f"environment variable {name} ({names[name]}): {exc}") from None
        set_key(tree, leaf.path, value)
        origins.other[leaf.path] = f"environment variable {name}"


def _apply_overrides(tree: dict[str, Any], overrides: Mapping[str, Any], origins: Origins) -> None:
    by_key = {".".join(leaf.path): leaf for leaf in leaves(Config)}
    for key, value in overrides.items():
        if value is None:
            continue  # an argparse flag that was not given
        if key not in by_key:
            raise ConfigError(f"unknown config key {key!r} in overrides")
        leaf = by_key[key]
        if isinstance(value, os.PathLike):
            value = os.fspath(value)  # argparse type=Path flags such as --cache-dir
        if isinstance(value, str) and str not in union_args(leaf.tp):
            try:
                value = parse_text(value, leaf.tp)
            except ValueError as exc:
                raise ConfigError(f"override {key}: {exc}") from None
        set_key(tree, leaf.path, value)
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
    config = build(Config, tree, (), origins)
    validate(config, origins)
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
