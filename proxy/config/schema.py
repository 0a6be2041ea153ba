"""Typed building of config dataclasses from raw TOML, env and flag values.

Knows the field types of any dataclass tree, not our sections: it walks the leaves,
checks a raw value against its field's type, parses a one-line string into that type,
and names the offending key and where it was set when a value does not fit.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from proxy.config.tomltext import Origins

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


class ConfigError(ValueError):
    """A config file, environment variable or flag that cannot be used as given."""


# ---------------------------------------------------------------------------------------
# Schema walking


@dataclass(slots=True, frozen=True)
class Leaf:
    path: tuple[str, ...]
    tp: Any


@functools.cache  # keyed by the config's section classes: bounded by construction
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def leaves(cls: type, prefix: tuple[str, ...] = ()) -> Iterator[Leaf]:
    for f in dataclasses.fields(cls):
        tp = _hints(cls)[f.name]
        if is_section(tp):
            yield from leaves(tp, (*prefix, f.name))
        else:
            yield Leaf((*prefix, f.name), tp)


def union_args(tp: Any) -> tuple[Any, ...]:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return typing.get_args(tp)
    return (tp,)


def list_item(tp: Any) -> Any:
    return typing.get_args(tp)[0] if typing.get_origin(tp) is list else None


def table_item(tp: Any) -> Any:
    """The value type of a `dict[str, V]` field; None for any other type."""
    return typing.get_args(tp)[1] if typing.get_origin(tp) is dict else None


def one_line(tp: Any) -> bool:
    """Whether an env var or flag can spell the field: not a list or table of tables."""
    return not (is_section(list_item(tp)) or is_section(table_item(tp)))


def _type_name(tp: Any) -> str:
    names = {str: "a string", int: "an integer", float: "a number", bool: "a boolean"}
    parts = []
    for arg in union_args(tp):
        if arg is type(None):
            continue
        if typing.get_origin(arg) is list:
            item = list_item(arg)
            parts.append("an array of tables" if is_section(item) else "an array of strings")
        elif typing.get_origin(arg) is dict:
            item = table_item(arg)
            parts.append(
                "a table of tables"
                if is_section(item)
                else ("a table of strings" if item is str else "a table")
            )
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


def key_error(path: tuple[str | int, ...], origins: Origins, message: str) -> ConfigError:
    return ConfigError(f"config key {_dotted(path)}: {message} (at {origins.where(path)})")


def _dotted(path: tuple[str | int, ...]) -> str:
    out = ""
    for part in path:
        if isinstance(part, str) and not _BARE_KEY.fullmatch(part):
            part = json.dumps(part, ensure_ascii=False)  # a [model."<pattern>"] key
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def _coerce(value: Any, tp: Any, path: tuple[str | int, ...], origins: Origins) -> Any:
    """Check a raw TOML/flag value against a field type; ints widen to float, nothing else."""
    if is_section(table_item(tp)):
        if not isinstance(value, dict):
            raise key_error(path, origins, f"expected {_type_name(tp)}, got {_describe(value)}")
        out = {}
        for key, item in value.items():
            if not isinstance(item, dict):
                raise key_error((*path, key), origins, f"expected a table, got {_describe(item)}")
            out[key] = build(table_item(tp), item, (*path, key), origins)
        return out
    if list_item(tp) is not None and is_section(list_item(tp)):
        if not isinstance(value, list):
            raise key_error(path, origins, f"expected {_type_name(tp)}, got {_describe(value)}")
        item_cls = list_item(tp)
        out = []
        for i, item in enumerate(value):
            if not isinstance(item, dict):
                raise key_error((*path, i), origins, f"expected a table, got {_describe(item)}")
            out.append(build(item_cls, item, (*path, i), origins))
        return out
    for arg in union_args(tp):
        if arg is type(None):
            continue
        if typing.get_origin(arg) is list:
            if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
                return list(value)
        elif typing.get_origin(arg) is dict:
            if isinstance(value, dict) and (
                table_item(arg) is not str or all(isinstance(v, str) for v in value.values())
            ):
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
    raise key_error(path, origins, f"expected {_type_name(tp)}, got {_describe(value)}")


def build(cls: type, raw: Mapping[str, Any], path: tuple[str | int, ...], origins: Origins):
    hints = _hints(cls)
    for key in raw:
        if key not in hints:
            known = ", ".join(hints)
            raise key_error((*path, key), origins, f"unknown key (known keys here: {known})")
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if f.name not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise key_error((*path, f.name), origins, "missing required key")
            continue
        value = raw[f.name]
        if is_section(tp):
            if not isinstance(value, dict):
                raise key_error(
                    (*path, f.name), origins, f"expected a table, got {_describe(value)}"
                )
            kwargs[f.name] = build(tp, value, (*path, f.name), origins)
        else:
            kwargs[f.name] = _coerce(value, tp, (*path, f.name), origins)
    return cls(**kwargs)


# ---------------------------------------------------------------------------------------
# One-line text (environment variables and flags)


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_text(text: str, tp: Any) -> Any:
    """A string (env var or flag) as a value of the field's type; raises ValueError."""
    args = union_args(tp)
    if type(None) in args and text.strip().lower() in ("", "none"):
        return None
    if str in args:
        return text  # size/duration specs stay strings; validation parses them
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


def set_key(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    """Put one env/flag value into the raw tree; None clears an optional key to its default."""
    for part in path[:-1]:
        node = tree.setdefault(part, {})
        if not isinstance(node, dict):
            return  # the file has a non-table here; building reports that with its line
        tree = node
    if value is None:
        tree.pop(path[-1], None)
    else:
        tree[path[-1]] = value
