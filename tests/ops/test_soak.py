"""A short load soak in CI: 16 clients, both dialects, streams cut off, leaks and errors
checked the same way as the full ``scripts/soak`` run (tests/tools/soak.py)."""

from __future__ import annotations

from tests.tools.soak import Settings, demo_server, server_errors, soak


def test_sixteen_clients_leave_no_errors_no_leaked_descriptors_and_bypass_equal_answers():
    # A tiny RAM budget and SSD tier fill within the run, so the second half is eviction
    # and SSD write-through at steady state, which is where a leak would show as RSS growth.
    settings = Settings(
        requests=240, clients=16, sample_share=0.12, ram_budget=4_000_000, ssd_max=8_000_000
    )
    with demo_server(settings.ram_budget, settings.ssd_max) as server:
        result = soak(server.url, server.proc.pid, settings)
        log_errors = server_errors(server.log())
        alive = server.proc.poll() is None
    s = result["summary"]
    assert alive and not log_errors, log_errors
    assert result["problems"] == [], result["problems"]
    assert s["completed"] == 240 and s["errors"] == 0
    assert s["disconnected"] > 0 and s["streamed"] > s["disconnected"]
    assert s["by_dialect"]["openai"] > 0 and s["by_dialect"]["anthropic"] > 0
    assert s["fds_end"] == s["fds_start"]
    assert s["bypass_compared"] >= 10 and s["bypass_mismatches"] == 0
    assert s["ram_evicted_mb"] > 0  # the tier was full: eviction ran during the soak
    assert s["ssd_evictions"] > 0 and s["ssd_tier_mb"] <= s["ssd_max_mb"] == 8.0
