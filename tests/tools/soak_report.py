"""The soak's verdict and its report: targets checked, figures written as JSON and markdown."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

MB = 1e6
# RSS may wobble by allocator noise; growth past this in the second half counts as a leak.
GROWTH_TOLERANCE = 16_000_000


@dataclass(frozen=True, slots=True)
class Sample:
    t: float  # seconds since the monitor started
    rss: int
    fds: int
    done: int  # requests finished (or failed) so far
    # From /v1/cache/stats, polled every few samples: MLX's live arrays and its buffer cache.
    mlx_active: int = 0
    mlx_cache: int = 0
    # The C heap under everything (MLX's CPU buffers included), where glibc says: bytes in
    # use, and bytes freed but kept. Growth in the second tells fragmentation from a leak.
    heap_in_use: int = 0
    heap_free: int = 0


def growth(samples: list[Sample], figure: str = "rss") -> tuple[int, float]:
    """Growth of RSS (or another figure) over the second half of the run: (end minus
    start of that half, MB/min).

    Medians of the first and last fifth of the second half, so one sample's spike is not
    taken for a trend.
    """
    half = samples[len(samples) // 2 :]
    if len(half) < 5:
        return 0, 0.0
    k = max(len(half) // 5, 1)
    values = [getattr(s, figure) for s in half]
    grew = int(statistics.median(values[-k:]) - statistics.median(values[:k]))
    ts = [s.t for s in half]
    slope = statistics.linear_regression(ts, values).slope if len(set(ts)) > 1 else 0
    return grew, slope * 60 / MB


def evaluate(
    *,
    settings: dict[str, Any],
    tally: dict[str, Any],
    elapsed_s: float,
    samples: list[Sample],
    start_fds: int,
    end_fds: int,
    compared: int,
    mismatches: list[str],
    stats: dict[str, Any],
) -> dict[str, Any]:
    """Check the targets; the result holds the figures, the problems and ``passed``."""
    start = samples[0]
    bound = start.rss + settings["ram_budget"] + settings["margin"]
    peak = max(s.rss for s in samples)
    grew, slope = growth(samples)
    ram = stats.get("ram", {})
    requests = stats.get("requests", {})
    problems = []
    if tally["errors"]:
        problems.append(f"{len(tally['errors'])} requests failed; first: {tally['errors'][0]}")
    if peak > bound:
        problems.append(f"peak RSS {peak / MB:.0f} MB over the bound {bound / MB:.0f} MB")
    if grew > max(GROWTH_TOLERANCE, 0.02 * peak):
        problems.append(f"RSS grew {grew / MB:.1f} MB in the second half ({slope:+.2f} MB/min)")
    if end_fds != start_fds:
        problems.append(f"open descriptors: {start_fds} at the start, {end_fds} at the end")
    if mismatches:
        problems.append(
            f"{len(mismatches)} of {compared} answers differ from bypass: {mismatches[0]}"
        )
    if ram.get("bytes", 0) > ram.get("budget_bytes", settings["ram_budget"]):
        problems.append(
            f"RAM tier holds {ram['bytes']} bytes over its budget {ram['budget_bytes']}"
        )
    summary = {
        "requests": tally["sent"],
        "completed": tally["completed"],
        "errors": len(tally["errors"]),
        "clients": settings["clients"],
        "streamed": tally["streamed"],
        "disconnected": tally["disconnected"],
        "by_dialect": tally["by_dialect"],
        "by_prompt_size": tally["by_size"],
        "elapsed_s": round(elapsed_s, 1),
        "requests_per_s": round(tally["completed"] / max(elapsed_s, 1e-9), 2),
        "rss_ready_mb": round(start.rss / MB, 1),
        "ram_budget_mb": round(settings["ram_budget"] / MB, 1),
        "margin_mb": round(settings["margin"] / MB, 1),
        "rss_bound_mb": round(bound / MB, 1),
        "rss_peak_mb": round(peak / MB, 1),
        "rss_end_mb": round(samples[-1].rss / MB, 1),
        "rss_second_half_growth_mb": round(grew / MB, 1),
        "rss_second_half_slope_mb_per_min": round(slope, 2),
        "mlx_cache_peak_mb": round(max(x.mlx_cache for x in samples) / MB, 1),
        "mlx_active_peak_mb": round(max(x.mlx_active for x in samples) / MB, 1),
        "heap_in_use_second_half_growth_mb": round(growth(samples, "heap_in_use")[0] / MB, 1),
        "heap_free_second_half_growth_mb": round(growth(samples, "heap_free")[0] / MB, 1),
        "fds_start": start_fds,
        "fds_end": end_fds,
        "bypass_compared": compared,
        "bypass_mismatches": len(mismatches),
        "cache_hit_ratio": requests.get("hit_ratio"),
        "ram_tier_mb": round(ram.get("bytes", 0) / MB, 1),
        "ram_evicted_mb": round(ram.get("evicted_bytes", 0) / MB, 1),
        "ssd_written_mb": round(stats.get("ssd", {}).get("bytes_written", 0) / MB, 1),
        "ssd_max_mb": round(stats.get("ssd", {}).get("max_bytes", 0) / MB, 1),
        "ssd_tier_mb": round(stats.get("ssd", {}).get("bytes", 0) / MB, 1),
        "ssd_evictions": stats.get("ssd", {}).get("evictions", 0),
        "cancelled": requests.get("cancelled"),
    }
    return {
        "summary": summary,
        "problems": problems,
        "passed": not problems,
        "errors": tally["errors"],
        "mismatches": mismatches,
        "samples": [asdict(s) for s in samples],
    }


def write_report(result: dict[str, Any], out: Path) -> None:
    """soak.json (everything), soak.md (the table) and soak.png (RSS over time) into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(result, indent=1))
    s = result["summary"]
    lines = [
        "# Load soak",
        "",
        f"Verdict: **{'passed' if result['passed'] else 'FAILED'}**",
        "",
        "| figure | value |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in s.items()),
        "",
    ]
    lines += [f"- FAIL: {p}" for p in result["problems"] + result.get("server_log_errors", [])]
    (out / "soak.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    samples = result["samples"]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot([p["t"] for p in samples], [p["rss"] / MB for p in samples], label="RSS")
    ax.axhline(s["rss_bound_mb"], color="red", linestyle="--", label="bound")
    ax.set_xlabel("seconds")
    ax.set_ylabel("MB")
    ax.set_title(f"{s['requests']} requests, {s['clients']} clients: server RSS")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "soak.png", dpi=100)
    plt.close(fig)
