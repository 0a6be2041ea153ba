"""Write a run's results: results.json (every raw number), results.md (tables), PNG plots."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from .results import Number, Row, ScenarioResult
from .servers import LABELS, REPO

COLUMNS = ("ours", "nocache", "mlx_lm", "mlx_vlm", "bare")
HEADERS = {**LABELS, "bare": "bare mlx-lm (in-process)"}


def machine() -> dict[str, Any]:
    import psutil

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "ram_bytes": psutil.virtual_memory().total,
        "ram_available_bytes": psutil.virtual_memory().available,
    }
    gpu = _run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"])
    chip = _run(["sysctl", "-n", "machdep.cpu.brand_string"]) if sys.platform == "darwin" else None
    info["gpu"] = gpu or chip
    info["load_avg_1m"] = load_avg()
    return info


def load_avg() -> float | None:
    """The 1-minute load average: other work on the machine makes every timing noisier."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in ("mlx", "mlx-lm", "mlx-metal", "mlx-cuda", "aiohttp", "mlx-prompt-cache"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    if out["mlx-prompt-cache"] is None:  # run from a checkout that is not installed
        text = (REPO / "pyproject.toml").read_text() if (REPO / "pyproject.toml").is_file() else ""
        line = next((ln for ln in text.splitlines() if ln.startswith("version")), "")
        out["mlx-prompt-cache"] = line.split("=")[-1].strip().strip('"') or None
    commit = _run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"])
    dirty = _run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"])
    out["git"] = f"{commit}{'-dirty' if dirty else ''}" if commit else None
    return out


def _run(cmd: list[str]) -> str | None:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() or None if proc.returncode == 0 else None


def finite(value: Any) -> Any:
    """The value with every non-finite float replaced by None, so JSON stays strict."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def to_json(results: list[ScenarioResult], meta: dict[str, Any]) -> dict[str, Any]:
    scenarios = []
    for r in results:
        d = dataclasses.asdict(r)
        d.pop("t0")
        scenarios.append(d)
    return finite({"meta": meta, "scenarios": scenarios})


def write(out: Path, results: list[ScenarioResult], meta: dict[str, Any]) -> dict[str, Any]:
    """Write every file; returns the paths of the plots and the note if there are none."""
    from .plots import plot_all

    out.mkdir(parents=True, exist_ok=True)
    plots, plot_note = plot_all(out, results)
    meta = {**meta, "plots": [p.name for p in plots], "plot_note": plot_note}
    data = to_json(results, meta)
    (out / "results.json").write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")
    (out / "results.md").write_text(markdown(results, meta))
    return {"plots": plots, "plot_note": plot_note}


def _load(value: float | None) -> str:
    return f"{value:.2f}" if value is not None else "—"


def fmt(value: Number, metric: str = "") -> str:
    if value is None:
        return "—"
    if "bytes" in metric:
        return _bytes(float(value))
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if abs(value) >= 999.5:  # .3g would print 1004 tok/s as "1e+03"
        return f"{value:.0f}"
    return f"{value:.3g}"


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} GB"


def _ratios(row: Row) -> str:
    parts = [f"{k}: {v:.2f}×" for k, v in row.ratios.items() if v is not None]
    return "; ".join(parts) or "—"


def main_table(results: list[ScenarioResult]) -> str:
    cols = [c for c in COLUMNS if any(c in r.rows[0].values for r in results if r.rows)]
    head = ["scenario", "model", "metric", *(HEADERS[c] for c in cols), "ratios"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        if r.skipped is not None:
            cells = [r.scenario, r.model, "skipped: " + r.skipped]
            lines.append("| " + " | ".join(cells + ["—"] * (len(cols) + 1)) + " |")
            continue
        if not r.rows:
            cells = [r.scenario, r.model, "failed: " + "; ".join(r.errors)[:200]]
            lines.append("| " + " | ".join(cells + ["—"] * (len(cols) + 1)) + " |")
            continue
        row = r.rows[0]
        cells = [r.scenario, r.model, row.metric]
        cells += [fmt(row.values.get(c), row.metric) for c in cols]
        lines.append("| " + " | ".join(cells + [_ratios(row)]) + " |")
    return "\n".join(lines)


def details(r: ScenarioResult) -> str:
    if r.skipped is not None:
        return f"### {r.scenario} — skipped\n\n- **skipped**: {r.skipped}"
    cols = [c for c in COLUMNS if any(c in row.values for row in r.rows)]
    head = ["metric", *(HEADERS[c] for c in cols), "ratios", "note"]
    lines = [f"### {r.scenario} — {r.model} ({r.seconds:.0f} s)", ""]
    if r.rows:
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for row in r.rows:
            cells = [row.metric, *(fmt(row.values.get(c), row.metric) for c in cols)]
            lines.append("| " + " | ".join(cells + [_ratios(row), row.note]) + " |")
    for note in dict.fromkeys(r.notes):
        lines.append(f"- {note}")
    for err in r.errors:
        lines.append(f"- **error**: {err}")
    return "\n".join(lines)


def markdown(results: list[ScenarioResult], meta: dict[str, Any]) -> str:
    m, v = meta["machine"], meta["versions"]
    lines = [
        f"# mlx-prompt-cache bench{' (--quick)' if meta.get('quick') else ''}",
        "",
        f"`{meta['command']}` — {meta['started_at']}, {meta['duration_s']:.0f} s.",
        "",
        f"Machine: {m['platform']}, {m['cpu_count']} CPUs, {_bytes(m['ram_bytes'])} RAM"
        + (f", {m['gpu']}" if m.get("gpu") else "")
        + f". Versions: mlx {v.get('mlx')}, mlx-lm {v.get('mlx-lm')}, python {v['python']}, "
        f"mlx-prompt-cache {v.get('mlx-prompt-cache')} ({v.get('git')}).",
        f"Load average (1 min) at start {_load(m.get('load_avg_1m'))}, at end "
        f"{_load(meta.get('load_avg_1m_end'))} on {m['cpu_count']} CPUs: timings are noisier "
        "when it is above the CPU count.",
        f"Model: {meta['model']['id']} ({meta['model']['path']}). Every server got the same "
        f"requests over HTTP, streaming, greedy, max_tokens={meta['max_tokens']}. "
        "TTFT = time to the first output delta.",
        "",
        main_table(results),
        "",
        "## Details",
        "",
    ]
    lines += [details(r) + "\n" for r in results]
    if meta.get("plots"):
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in meta["plots"]]
    if meta.get("plot_note"):
        lines += ["", meta["plot_note"]]
    return "\n".join(lines) + "\n"
