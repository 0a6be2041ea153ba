"""TOML text the standard library does not handle: where keys sit, and writing it back.

tomllib parses but keeps no line numbers and cannot write; config errors need the former
and ``serve --print-config`` the latter. Plain dataclasses in, no config semantics here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

_HEADER_RE = re.compile(r"^\s*(\[\[?)\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_KEY_RE = re.compile(
    r"^\s*((?:[A-Za-z0-9_-]+|\"[^\"]*\"|'[^']*')(?:\s*\.\s*(?:[A-Za-z0-9_-]+|\"[^\"]*\"|'[^']*'))*)\s*="
)
_DOTTED_PART_RE = re.compile(r"[A-Za-z0-9_-]+|\"[^\"]*\"|'[^']*'")


def _split_key(text: str) -> tuple[str, ...]:
    return tuple(p.strip("\"'") for p in _DOTTED_PART_RE.findall(text))


def key_lines(text: str) -> dict[tuple[str | int, ...], int]:
    """Line numbers of tables and keys, found by scanning the text (tomllib keeps none).

    Array-of-tables entries get their index in the path: ("normalization", "rules", 0, "name").
    Lines inside multi-line strings and arrays are skipped so their content is not a key.
    """
    lines: dict[tuple[str | int, ...], int] = {}
    table: tuple[str | int, ...] = ()
    array_counts: dict[tuple[str | int, ...], int] = {}
    in_string: str | None = None
    depth = 0
    for number, line in enumerate(text.splitlines(), start=1):
        if in_string is not None:
            if line.count(in_string) % 2 == 1:
                in_string = None
            continue
        if depth > 0:
            depth += _bracket_delta(line)
            continue
        if m := _HEADER_RE.match(line):
            path = _split_key(m.group(2))
            if m.group(1) == "[[":
                index = array_counts.get(path, 0)
                array_counts[path] = index + 1
                table = (*path, index)
                lines.setdefault(path, number)
            else:
                table = path
            lines.setdefault(table, number)
            continue
        if m := _KEY_RE.match(line):
            lines.setdefault((*table, *_split_key(m.group(1))), number)
            rest = line[m.end() :]
            for quote in ('"""', "'''"):
                if rest.count(quote) % 2 == 1:
                    in_string = quote
            if in_string is None:
                depth = max(_bracket_delta(rest), 0)
    return lines


def _bracket_delta(text: str) -> int:
    # Good enough for arrays spanning lines; brackets inside strings are stripped first.
    text = re.sub(r"\"(?:\\.|[^\"\\])*\"|'[^']*'", "", text).split("#", 1)[0]
    return text.count("[") + text.count("{") - text.count("]") - text.count("}")


def _toml_string(value: str) -> str:
    # JSON string escapes are a subset of TOML basic-string escapes; DEL must be escaped too.
    return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else _toml_string(key)


def inline(value: Any) -> str:
    """A value as TOML writes it inline: a string, number, array or `{ k = v }` table."""
    return _toml_value(value)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        items = ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items())
        return "{ " + items + " }" if items else "{}"
    raise AssertionError(f"no TOML form for {value!r}")


def dumps(obj: Any) -> str:
    """A dataclass tree as TOML: nested dataclasses and dicts become tables, lists of
    dataclasses arrays of tables, dicts of dataclasses tables of tables.

    Unset optional keys (None) are written as comments, since TOML has no null; in a
    table of tables they are left out.
    """
    out: list[str] = []

    def section(obj: Any, path: tuple[str, ...], header: str) -> None:
        scalars, tables = [], []
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                tables.append((f.name, value))
            elif isinstance(value, dict):
                tables.append((f.name, value))
            elif isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
                tables.append((f.name, value))
            else:
                scalars.append((f.name, value))
        if path:
            if out:
                out.append("")
            out.append(header)
        for name, value in scalars:
            if value is None:
                out.append(f"# {name} is not set")
            else:
                out.append(f"{name} = {_toml_value(value)}")
        for name, value in tables:
            sub = (*path, name)
            dotted = ".".join(_toml_key(p) for p in sub)
            if value and isinstance(value, dict) and dataclasses.is_dataclass(_first(value)):
                for key, item in value.items():  # a table of tables: [model."<pattern>"]
                    out.extend(("", f"[{dotted}.{_toml_key(key)}]"))
                    out.extend(_set_keys(item))
            elif isinstance(value, dict):
                out.append("")
                out.append(f"[{dotted}]")
                out.extend(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items())
            elif isinstance(value, list):
                for item in value:
                    section(item, sub, f"[[{dotted}]]")
            else:
                section(value, sub, f"[{dotted}]")

    section(obj, (), "")
    return "\n".join(out).lstrip("\n") + "\n"


def _first(table: dict[str, Any]) -> Any:
    return next(iter(table.values()))


def _set_keys(obj: Any) -> list[str]:
    # A table of tables is a few overrides each: only the keys set, their tables inline.
    return [
        f"{f.name} = {_toml_value(value)}"
        for f in dataclasses.fields(obj)
        if (value := getattr(obj, f.name)) is not None and value != {}
    ]


class Origins:
    """Maps a key path to the place its value was set, for error messages."""

    def __init__(self, file: Path | None = None, text: str = "") -> None:
        self.file = file
        self._lines = key_lines(text) if text else {}
        self.other: dict[tuple[str | int, ...], str] = {}

    def line(self, path: tuple[str | int, ...]) -> int | None:
        # An unknown or inline key may not have a line of its own: fall back to its table.
        for n in range(len(path), 0, -1):
            if path[:n] in self._lines:
                return self._lines[path[:n]]
        return None

    def where(self, path: tuple[str | int, ...]) -> str:
        for n in range(len(path), 0, -1):
            if path[:n] in self.other:
                return self.other[path[:n]]
        line = self.line(path)
        if self.file is not None and line is not None:
            return f"{self.file} line {line}"
        return str(self.file) if self.file is not None else "defaults"
