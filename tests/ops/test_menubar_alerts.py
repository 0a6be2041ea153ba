"""The SwiftBar/xbar plugin's lines for the alerts on now (one each, cut to fit) and the
autotuned RAM budget: against a stats server that says what a real one said, and the
real proxy's budget. The rest of the plugin: test_menubar.py."""

from __future__ import annotations

import json

import httpx

from tests.ops.test_menubar import (
    parse_output,
    run_plugin,
    sandbox_fixture,  # noqa: F401 (the `sandbox` fixture)
    stats_server,
)

# As a server wrote them: a snippet of the prompt in quotes, with a "|" and an escaped
# newline in it, and non-ASCII (JSON writes it as \uXXXX).
REWROTE = ("client_rewrote (49%: the client rewrites message 0 changed at 't time: 2026-12-05 0'"
           " | '3:13:37\\nThe billing ' (was '2:12:27\\nThe billing '), costing 1,347 tokens: "
           "this rule makes the changing text the same every time) of the last 16 requests' "
           "prompt tokens")  # fmt: skip
RULE = {"name": "volatile-time", "pattern": "Current\\ time:\\ \\d+",
        "replacement": "Current time: <time>", "roles": ["system", "user"]}  # fmt: skip
ALERTS = [
    {"key": "hit_ratio", "cause": "client_rewrote",
     "message": f"prompt cache hit ratio 41% is below 50% over 16 requests; most lost to {REWROTE}",
     "fix": {"text": "…", "key": "normalization.rules", "value": RULE}, "since": 1_790_000_000.5,
     "share": 0.4895, "hit_ratio": 0.41},
    {"key": "client_rewrote", "cause": "client_rewrote", "message": REWROTE,
     "fix": {"text": "…", "key": "normalization.rules", "value": RULE}, "since": 1_790_000_001.5,
     "share": 0.4895, "hit_ratio": 0.41},
    {"key": "evicted", "cause": "evicted", "message": "evicted (35%: RAM evicted 413 tokens → "
     "a RAM budget of 843KB would have kept them) of the last 12 requests' prompt tokens",
     "fix": {"text": "…", "key": "cache.ram.budget", "value": "843KB"}, "since": 1_790_000_002.5,
     "share": 0.3539, "hit_ratio": 0.41},
]  # fmt: skip
TUNED = {
    "enabled": True, "ram_budget_bytes": 525_000, "protect_frequent": 0.1, "keep_periodic": False,
    "bounds": {"ram_min_bytes": 300_000, "ram_max_bytes": 600_000, "protect_frequent_max": 0.9},
    "ghost_hits": {"recent": 2, "frequent": 1, "came_back_bytes": 98_304},
    "changes": [{"time": 1_790_000_000.5, "setting": "cache.ram.budget", "from": 300_000,
                 "to": 525_000, "reason": "0.1 MB of evicted entries came back since the last look"}],
}  # fmt: skip


async def test_one_line_per_alert_on_cut_to_fit_and_the_autotuned_budget(aiohttp_server, sandbox):
    stats = {"hit_ratio": 0.41, "requests": 16, "ram": {"bytes": 524_288, "blocks": 14},
             "alert": None, "alerts": ALERTS, "autotune": TUNED}  # fmt: skip
    url = await stats_server(aiohttp_server, stats)
    lines = parse_output(await run_plugin(url, sandbox))
    on = {"length": "72", "color": "red", "href": f"{url}/dashboard"}
    assert lines[:10] == [
        ("⚡ 41% ⚠", {}),
        ("---", {}),
        (f"mlx-prompt-cache at {url}", {"href": f"{url}/health"}),
        *((f"⚠ {a['message'].replace('|', '¦')}", on) for a in ALERTS),
        ("Token hit ratio: 41%", {}),
        ("Requests: 16", {}),
        ("RAM: 524.3 KB in 14 blocks", {}),
        ("Autotune: RAM budget 525.0 KB (bounds 300.0 KB–600.0 KB), protect_frequent 0.1", {}),
    ]


async def test_no_alert_line_while_none_is_on_and_no_autotune_line_while_it_is_off(
    aiohttp_server, sandbox
):
    for autotune in ({"enabled": False}, None):
        stats = {"hit_ratio": 0.9, "alert": None, "alerts": []}
        url = await stats_server(
            aiohttp_server, stats | ({"autotune": autotune} if autotune else {})
        )
        lines = parse_output(await run_plugin(url, sandbox))
        assert lines[0] == ("⚡ 90%", {})
        assert not any(t.startswith(("⚠", "Autotune")) for t, _ in lines), lines


def human(n: int) -> str:
    """A byte count as the plugin writes it (awk's printf, C's rounding)."""
    units, x, i = ["B", "KB", "MB", "GB", "TB"], float(n), 0
    while x >= 1000 and i < len(units) - 1:
        x, i = x / 1000, i + 1
    return f"{n} B" if i == 0 else f"{x:.1f} {units[i]}"


async def test_real_proxy_autotune_line_is_its_stats(server, sandbox):
    """The plugin against the real proxy, which tunes by default: its budget, bounds and
    protect_frequent are the ones GET /v1/cache/stats reports."""
    lines = parse_output(await run_plugin(server.url, sandbox))
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        r = await http.get("/v1/cache/stats")
    assert r.status_code == 200, r.text
    auto = r.json()["autotune"]
    bounds = auto["bounds"]
    assert auto["enabled"] is True
    expected = (f"Autotune: RAM budget {human(auto['ram_budget_bytes'])} (bounds "
                f"{human(bounds['ram_min_bytes'])}–{human(bounds['ram_max_bytes'])}), "
                f"protect_frequent {json.dumps(auto['protect_frequent'])}")  # fmt: skip
    assert (expected, {}) in lines
