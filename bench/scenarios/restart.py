"""The restart scenario: build a cached prefix, restart the server, send the next turn.

Our proxy should come back warm from its SSD tier; mlx_lm.server keeps its cache in RAM
only, and the --no-cache server shows what a cold prefill of the same prompt costs. The
SSD tier's reload rate is set against `dd`'s sequential read in the same run.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from .. import traces
from ..harness import Harness, Settings, chars_per_token, stats
from ..results import Row, ScenarioResult, ratio
from ..servers import ModelSpec

_DD_RATE = re.compile(r"([\d.,]+)\s*([kKMGT]?i?B)/s")
_BSD_RATE = re.compile(r"\((\d+) bytes/sec\)")  # macOS dd
_UNITS = {"B": 1e-6, "kB": 1e-3, "KB": 1e-3, "KiB": 1.024e-3, "MB": 1.0, "MiB": 1.048576}
_UNITS |= {"GB": 1e3, "GiB": 1073.741824, "TB": 1e6}


def restart(settings: Settings, model: ModelSpec, scenario: str = "restart") -> ScenarioResult:
    result = ScenarioResult(scenario, model.id)
    prefix = settings.size(2000, 8000) if scenario == "restart" else settings.size(1000, 8000)
    trace = traces.chat_trace(settings.seed + 1, 2, prefix, chars_per_token(model))
    first, second = {"messages": trace.messages(0)}, {"messages": trace.messages(1)}
    before: dict = {}
    reloaded: dict = {}
    after_restart = {}
    repeat = None
    with Harness(settings, result, model) as h:
        for kind in ("ours", "mlx_lm", "nocache"):
            with h.serve(kind) as server:
                if kind != "nocache":
                    sample = h.send(server, "openai", first, 0, "prefix")
                    h.progress("build prefix", server, sample)
                    if kind == "ours":
                        before = stats(server)
                    h.progress("restart (SIGTERM, start again)", server)
                    server = h.restart(server)
                sample = h.send(server, "openai", second, 1, "after-restart")
                after_restart[kind] = sample
                h.progress("next turn", server, sample)
                if kind == "ours":
                    reloaded = stats(server)
                    repeat = h.send(server, "openai", second, 2, "repeat")
                    h.progress("same turn again (RAM)", server, repeat)
    result.metrics |= {
        "prefix_prompt_tokens": result.of("ours", "prefix")[0].prompt_tokens,
        "ram_bytes_before_restart": before.get("ram", {}).get("bytes"),
        "ours_after_restart_cached_tokens": after_restart["ours"].cached_tokens,
        "ours_repeat_ttft_s": repeat.ttft_s if repeat else None,
    }
    result.notes.append(f"ours after restart: x-prompt-cache-source={after_restart['ours'].source}")
    ttft = {k: s.ttft_s for k, s in after_restart.items()}
    result.rows.append(
        Row(
            "TTFT of the next turn after a restart (s)",
            ttft,
            {
                "cold (no-cache) / ours": ratio(ttft["nocache"], ttft["ours"]),
                "mlx_lm / ours": ratio(ttft["mlx_lm"], ttft["ours"]),
            },
            note="nocache = a cold prefill of the same prompt; the model load after a restart "
            "is paid by a warm-up request and is not in these numbers",
        )
    )
    result.rows.append(
        Row(
            "cached tokens of the next turn after a restart",
            {k: s.cached_tokens for k, s in after_restart.items()},
        )
    )
    _ssd_vs_dd(result, before, reloaded, settings.out, settings.size(128, 512))
    return result.finish()


def _ssd_vs_dd(result: ScenarioResult, before: dict, reloaded: dict, out: Path, dd_mb: int) -> None:
    ssd = reloaded.get("ssd")
    rate = None
    if isinstance(ssd, dict):
        bps = ssd.get("reload_bytes_per_s")
        rate = bps / 1e6 if isinstance(bps, int | float) and bps > 0 else None
        result.metrics |= {
            f"ssd_{k}": v
            for k, v in ssd.items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }
        if rate is None:
            result.notes.append("the ssd section reports no reload rate (nothing was read back)")
    else:
        result.notes.append(
            "/v1/cache/stats has no ssd section in this build: SSD reload MB/s is null"
        )
    dd = dd_read_mb_s(out, dd_mb)
    result.metrics |= {f"dd_{k}": v for k, v in dd.items()}
    result.rows.append(
        Row(
            "SSD reload MB/s vs dd sequential read MB/s",
            {"ours": rate},
            {
                "ours / dd (page cache)": ratio(rate, dd.get("buffered_mb_s")),
                "ours / dd (O_DIRECT)": ratio(rate, dd.get("direct_mb_s")),
            },
            note=f"dd read a {dd_mb} MB file written just before: the buffered figure is "
            "mostly the page cache (caches cannot be dropped here); O_DIRECT bypasses it "
            "where the filesystem allows",
        )
    )


def dd_read_mb_s(folder: Path, size_mb: int) -> dict[str, float | None]:
    """MB/s of `dd` reading a freshly written file, buffered and (if possible) O_DIRECT."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "dd-probe.bin"
    block = os.urandom(1 << 20)
    try:
        with path.open("wb") as f:
            for _ in range(size_mb):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        return {
            "file_mb": float(size_mb),
            "buffered_mb_s": _dd(path, []),
            "direct_mb_s": _dd(path, ["iflag=direct"]),
        }
    finally:
        path.unlink(missing_ok=True)


def _dd(path: Path, flags: list[str]) -> float | None:
    try:
        proc = subprocess.run(
            ["dd", f"if={path}", "of=/dev/null", "bs=1M", *flags],
            capture_output=True,
            text=True,
            timeout=600,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    bsd = _BSD_RATE.findall(proc.stderr)
    if bsd:
        return int(bsd[-1]) / 1e6
    found = _DD_RATE.findall(proc.stderr)
    if not found:
        return None
    value, unit = found[-1]
    return float(value.replace(",", ".")) * _UNITS.get(unit, 1.0)
