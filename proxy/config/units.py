"""Sizes, durations and the RAM budget, as written in config files and flags."""

from __future__ import annotations

import math
import re

# A percentage budget never goes below this: on a machine under memory pressure 20% of
# "available" can be a few MB, which would make every block an immediate eviction.
RAM_BUDGET_FLOOR = 100 * 1000 * 1000


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgt", start=1):
    _SIZE_UNITS |= {_p: 1000**_i, _p + "b": 1000**_i, _p + "ib": 1024**_i}


def parse_size(spec: str | int) -> int:
    """Bytes from ``8GB`` (SI, 10^9), ``512MiB`` (binary), ``1.5G`` or a plain integer."""
    if isinstance(spec, bool):
        raise ValueError(f"invalid size {spec!r}")
    if isinstance(spec, int):
        if spec < 0:
            raise ValueError(f"invalid size {spec!r}: negative")
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"invalid size {spec!r}")
    m = _SIZE_RE.match(spec)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _SIZE_UNITS:
        raise ValueError(f"invalid size {spec!r}: expected e.g. '8GB', '512MiB' or bytes")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


def resolve_ram_budget(spec: str | int, available_bytes: int) -> int:
    """RAM tier budget in bytes: ``"20%"`` of available (floor 100 MB), or a fixed size.

    A fixed size is taken as given, so tests and small machines can ask for less.
    """
    if isinstance(spec, str) and spec.strip().endswith("%"):
        text = spec.strip()[:-1].strip()
        try:
            percent = float(text)
        except ValueError:
            raise ValueError(f"invalid RAM budget {spec!r}: expected e.g. '20%'") from None
        if not 0 < percent <= 100:
            raise ValueError(f"invalid RAM budget {spec!r}: percent must be in (0, 100]")
        return max(int(available_bytes * percent / 100), RAM_BUDGET_FLOOR)
    return parse_size(spec)


def ram_share(spec: str | int) -> float | None:
    """The RAM budget's share as a fraction when it is given as one ("20%"); None for a size."""
    if isinstance(spec, str) and spec.strip().endswith("%"):
        return float(spec.strip()[:-1].strip()) / 100
    return None


def resolve_share_of_ram(spec: str | int, total_bytes: int, what: str = "KV memory") -> int:
    """Bytes from ``"30%"`` of all RAM, or a size; `what` names the setting in errors."""
    if isinstance(spec, str) and spec.strip().endswith("%"):
        text = spec.strip()[:-1].strip()
        try:
            percent = float(text)
        except ValueError:
            raise ValueError(f"invalid {what} {spec!r}: expected e.g. '30%'") from None
        if not 0 < percent <= 100:
            raise ValueError(f"invalid {what} {spec!r}: percent must be in (0, 100]")
        return int(total_bytes * percent / 100)
    size = parse_size(spec)
    if size == 0:
        raise ValueError(f"invalid {what} {spec!r}: must be more than 0 bytes")
    return size


def resolve_kv_memory(spec: str | int, total_bytes: int) -> int:
    """The running sequences' K/V cap in bytes: ``"30%"`` of all RAM, or a size."""
    return resolve_share_of_ram(spec, total_bytes, "KV memory")


def resolve_min_available(spec: str | int, total_bytes: int) -> int:
    """The memory-pressure floor in bytes: ``"5%"`` of all RAM, or a size."""
    return resolve_share_of_ram(spec, total_bytes, "minimum available memory")


_DURATION_PART_RE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)", re.IGNORECASE)
_DURATION_UNITS = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(spec: str | float) -> float:
    """Seconds from ``"7d"``, ``"12h"``, ``"1h30m"``, ``"90s"`` or a number of seconds."""
    if isinstance(spec, bool):
        raise ValueError(f"invalid duration {spec!r}")
    if isinstance(spec, int | float):
        if spec < 0 or math.isnan(spec):
            raise ValueError(f"invalid duration {spec!r}: negative")
        return float(spec)
    if not isinstance(spec, str):
        raise ValueError(f"invalid duration {spec!r}")
    text = spec.strip().replace(" ", "")
    total = 0.0
    pos = 0
    for m in _DURATION_PART_RE.finditer(text):
        unit = m.group(2).lower()
        if m.start() != pos or unit not in _DURATION_UNITS:
            break
        total += float(m.group(1)) * _DURATION_UNITS[unit]
        pos = m.end()
    if not text or pos != len(text):
        raise ValueError(f"invalid duration {spec!r}: expected e.g. '7d', '12h', '90m' or seconds")
    return total
