"""proxy/config/units.py: sizes, shares of RAM and durations as config values spell them."""

from __future__ import annotations

import pytest

from proxy.config.units import (
    RAM_BUDGET_FLOOR,
    parse_duration,
    parse_size,
    resolve_kv_memory,
    resolve_ram_budget,
)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (123, 123),
        ("123", 123),
        ("8GB", 8 * 10**9),
        ("8 gb", 8 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5G", 1_500_000_000),
        ("10KiB", 10240),
        ("0", 0),
    ],
)
def test_parse_size(spec, expected):
    assert parse_size(spec) == expected


@pytest.mark.parametrize("spec", ["", "GB", "8XB", "-1", -1, True, "1e3"])
def test_parse_size_rejects(spec):
    with pytest.raises(ValueError):
        parse_size(spec)


def test_resolve_kv_memory():
    gib = 2**30
    assert resolve_kv_memory("30%", 100 * gib) == 30 * gib
    assert resolve_kv_memory("4GB", 1) == 4 * 10**9
    assert resolve_kv_memory(4096, gib) == 4096
    for bad in ("0%", "101%", "x%", "0", 0, "lots"):
        with pytest.raises(ValueError):
            resolve_kv_memory(bad, gib)


def test_resolve_ram_budget():
    gib = 2**30
    assert resolve_ram_budget("20%", 100 * gib) == 20 * gib
    assert resolve_ram_budget("50 %", 10 * gib) == 5 * gib
    assert resolve_ram_budget("20%", 10 * 2**20) == RAM_BUDGET_FLOOR  # percent has a floor
    assert resolve_ram_budget("8GB", 1) == 8 * 10**9
    assert resolve_ram_budget("1MB", 100 * gib) == 10**6  # an explicit size is taken as given
    assert resolve_ram_budget(4096, 100 * gib) == 4096
    for bad in ("0%", "101%", "x%"):
        with pytest.raises(ValueError):
            resolve_ram_budget(bad, gib)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("7d", 7 * 86400.0),
        ("12h", 43200.0),
        ("90m", 5400.0),
        ("45s", 45.0),
        ("1h30m", 5400.0),
        ("2w", 14 * 86400.0),
        ("3600", 3600.0),
        (3600, 3600.0),
        (1.5, 1.5),
    ],
)
def test_parse_duration(spec, expected):
    assert parse_duration(spec) == expected


@pytest.mark.parametrize("spec", ["", "7 days", "h", "1x", "-5", -5, False])
def test_parse_duration_rejects(spec):
    with pytest.raises(ValueError):
        parse_duration(spec)
