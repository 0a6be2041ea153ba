"""`mlx-prompt-cache doctor`: what is loaded where, the memory figures, the extras and
servers present, and (from a running server) the causes of the last hour's lost prompt
tokens with their fixes, as a report a person reads (or one JSON object with --json).

Nothing here loads a model or imports an optional extra: models are resolved to their
folders and sized on disk, extras are looked up with `importlib.util.find_spec`, and the
running server (if any) and LM Studio are asked over HTTP with short timeouts.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import psutil

from engine_bridge.offline import (
    DEMO_MODEL_IDS,
    ModelRef,
    chat_template_text,
    cpu_blas,
    default_kwargs,
    gb,
    is_demo_model,
    resolve,
    scan,
    weights_bytes,
)
from engine_bridge.types import EngineError

from .config.model import Config
from .config.model_settings import ModelSettingsTable, lmstudio_key
from .config.tomltext import inline
from .config.units import resolve_kv_memory, resolve_min_available, resolve_ram_budget
from .upstream.lmstudio_rest import LmStudioError, LmStudioRest
from .upstream.one_copy import same_model

# module -> (what it enables, the extra that installs it)
EXTRAS = {
    "redis": ("the shared Redis/Valkey tier ([cache.shared])", "shared"),
    "mlx_vlm": ("vision models", "vision"),
    "PIL": ("images in requests", "vision"),
    "matplotlib": ("bench plots", "bench"),
    "playwright": ("the dashboard's browser tests", "test"),
}
PROGRAMS = ("redis-server", "chromium", "chromium-browser", "google-chrome")
HEALTH_TIMEOUT_S = 3.0
LOST_SHOWN = 3  # the causes of lost tokens listed, most tokens first (new content aside)


def _served_specs(config: Config) -> list[str]:
    """The model specs `serve` would serve with this config (as the engine lists them)."""
    specs = list(config.models.serve)
    if config.models.serve_all_mlx:
        dirs = [Path(d) for d in config.models.lmstudio_dirs]
        specs += [str(m.path) for m in scan(dirs) if m.format == "mlx"]
    return specs or ([] if config.models.serve_all_mlx else list(DEMO_MODEL_IDS))


def _row(model_id: str, path: Path | None, demo: bool, note: str | None = None):
    weights = weights_bytes(path) if path is not None and path.is_dir() else None
    path_text = str(path) if path is not None else None
    return {"id": model_id, "path": path_text, "demo": demo, "weights_bytes": weights, "note": note}


def _model_row(spec: str, config: Config) -> tuple[dict[str, Any], ModelRef | None]:
    cache_dir = config.cache.ssd.path
    if is_demo_model(spec):
        # Not built here: a demo model is built on first use under the cache dir.
        path = cache_dir / "models" / spec
        return _row(spec, path, True, None if path.is_dir() else "built on first use"), None
    try:
        ref = resolve(spec, cache_dir, [Path(d) for d in config.models.lmstudio_dirs])
    except EngineError as exc:
        return _row(spec, None, False, exc.message), None
    return _row(ref.id, ref.path, False), ref


def _settings(table: ModelSettingsTable, row: dict[str, Any]) -> dict[str, Any]:
    """A row's [model."<pattern>"] settings as the config resolves them, over the template
    defaults the engine reads from the model's files (Engine.template_defaults)."""
    path = Path(row["path"]) if row["path"] else None
    key = lmstudio_key(path) if path is not None and not row["demo"] else row["id"]
    defaults = default_kwargs(chat_template_text(path)) if path is not None else {}
    return table.resolve(row["id"], key).effective(defaults)


def served_settings(config: Config) -> list[tuple[str, dict[str, Any]]]:
    """Each model `serve` would serve, with its settings from the config (serve --print-config)."""
    table = ModelSettingsTable(config.model)
    rows = [_model_row(spec, config)[0] for spec in _served_specs(config)]
    return [(row["id"], _settings(table, row)) for row in rows]


async def _server_health(url: str) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.get(url + "/health") as r:
                ok = r.status == 200
                body = orjson.loads(await r.read()) if r.status in (200, 503) else None
            settings = await _server_settings(session, url) if ok else {}
            held = await _rank_holdings(session, url) if ok and _ranks(body) else None
            lost, lost_error = await _diagnosis(session, url) if ok else (None, None)
    except (aiohttp.ClientError, TimeoutError, OSError, orjson.JSONDecodeError) as exc:
        return {"url": url, "running": False, "error": str(exc) or type(exc).__name__}
    ranks = _ranks(body)
    if ranks is not None:
        ranks = ranks | {"holdings": held}
    if not isinstance(body, dict) or body.get("status") != "ok":
        why = body.get("reason") if isinstance(body, dict) else None
        return {"url": url, "running": False, "ranks": ranks,
                "error": why or "no mlx-prompt-cache /health there"}  # fmt: skip
    return {
        "url": url,
        "running": True,
        "error": None,
        "models": [m for m in body.get("models", []) if isinstance(m, str)],
        "loaded": [m for m in body.get("loaded", []) if isinstance(m, str)],
        "settings": settings,
        "ranks": ranks,
        "diagnosis": lost,
        "diagnosis_error": lost_error,
    }


def _ranks(body: Any) -> dict[str, Any] | None:
    """A split model's ranks as the front reports them on /health; None for one process."""
    ranks = body.get("ranks") if isinstance(body, dict) else None
    return ranks if isinstance(ranks, dict) and "size" in ranks else None


async def _rank_holdings(session: aiohttp.ClientSession, url: str) -> list[dict] | None:
    """What each rank's slices hold (GET /v1/cache/stats `ranks`)."""
    async with session.get(url + "/v1/cache/stats") as r:
        if r.status != 200:
            return None
        held = orjson.loads(await r.read()).get("ranks")
    return held if isinstance(held, list) else None


async def _diagnosis(
    session: aiohttp.ClientSession, url: str
) -> tuple[dict[str, Any] | None, str | None]:
    """The last hour's lost tokens by cause (GET /v1/cache/diagnosis), or why not."""
    path = "/v1/cache/diagnosis?window=1h"
    try:
        async with session.get(url + path) as r:
            if r.status != 200:
                return None, f"GET {path} answered HTTP {r.status}"
            body = orjson.loads(await r.read())
    except (aiohttp.ClientError, TimeoutError, OSError, orjson.JSONDecodeError) as exc:
        return None, f"GET {path}: {exc or type(exc).__name__}"
    if not isinstance(body, dict) or not isinstance(body.get("causes"), list):
        return None, f"GET {path} answered no diagnosis"
    return body, None


async def _server_settings(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    """The running server's effective settings per local model (GET /v1/models); {} when
    it cannot say, and the config's are shown instead."""
    try:
        async with session.get(url + "/v1/models") as r:
            data = orjson.loads(await r.read()).get("data") if r.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, OSError, orjson.JSONDecodeError, AttributeError):
        return {}
    entries = data if isinstance(data, list) else []
    return {
        e["id"]: e["settings"]
        for e in entries
        if isinstance(e, dict) and isinstance(e.get("settings"), dict)
    }


async def _lmstudio(config: Config, refs: list[ModelRef]) -> dict[str, Any]:
    u = config.upstream
    out: dict[str, Any] = {
        "url": u.url,
        "enabled": u.enabled,
        "reachable": False,
        "api": None,
        "can_unload": None,
        "error": None,
        "loaded": [],
    }
    if not u.enabled:
        return out
    try:
        async with LmStudioRest(u.url, u.api_token, connect_timeout_s=u.connect_timeout_s) as lms:
            listing = await lms.models()
    except LmStudioError as exc:
        out["error"] = str(exc)
        return out
    out.update(reachable=True, api=listing.api, can_unload=listing.can_unload)
    for m in listing.loaded:
        out["loaded"].append(
            {
                "key": m.key,
                "instances": list(m.instances),
                "size_bytes": m.size_bytes,
                "format": m.format,
                "type": m.type,
                "also_served_here": [r.id for r in refs if same_model(r, m)],
            }
        )
    return out


def _memory(config: Config, weights: list[int | None]) -> dict[str, Any]:
    vm = psutil.virtual_memory()
    ram, kv = config.cache.ram, config.engine.kv_memory
    return {
        "total_bytes": vm.total,
        "available_bytes": vm.available,
        "weights_bytes": sum(w for w in weights if w),
        "ram_budget": ram.budget,
        "ram_budget_bytes": resolve_ram_budget(ram.budget, vm.available),
        "kv_memory": kv,
        "kv_memory_bytes": None if kv is None else resolve_kv_memory(kv, vm.total),
        "min_available": ram.min_available,
        "min_available_bytes": None
        if ram.min_available == "off"
        else resolve_min_available(ram.min_available, vm.total),
        "unload_duplicates": config.upstream.unload_duplicates,
    }


async def diagnose(config: Config) -> dict[str, Any]:
    """The whole report as plain JSON-ready data."""
    rows, refs = [], []
    for spec in _served_specs(config):
        row, ref = _model_row(spec, config)
        rows.append(row)
        if ref is not None:
            refs.append(ref)
    host = config.server.host
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    host = f"[{host}]" if ":" in host else host
    server = await _server_health(f"http://{host}:{config.server.port}")
    table = ModelSettingsTable(config.model)
    for r in rows:
        r["settings"] = _settings(table, r)
    if server["running"]:
        configured = {r["id"] for r in rows}
        for model_id in server["models"]:
            if model_id not in configured:  # started with other --model flags
                note = "served by the running server"
                rows.append(_row(model_id, None, is_demo_model(model_id), note))
        for r in rows:
            r["loaded"] = r["id"] in server["loaded"]
            # What the server applies: its config, and the engine's template defaults.
            r["settings"] = server["settings"].get(r["id"], r.get("settings", {}))
            if r["id"] not in server["models"] and r["note"] is None:
                r["note"] = "configured, but not served by the running server"
    else:
        for r in rows:
            r["loaded"] = None  # unknown: no server to ask
    return {
        "server": server,
        "models": rows,
        "lmstudio": await _lmstudio(config, refs),
        "memory": _memory(config, [r["weights_bytes"] for r in rows]),
        "extras": {name: importlib.util.find_spec(name) is not None for name in EXTRAS},
        "programs": {name: shutil.which(name) for name in PROGRAMS},
        "cpu_blas": {"name": (blas := cpu_blas()).name, "advice": blas.advice()},
    }


def _size(n: int | None) -> str:
    return "-" if n is None else gb(n)


def _is_share(spec: Any) -> bool:
    return isinstance(spec, str) and spec.strip().endswith("%")


def _spec(spec: Any, resolved: int | None, of: str) -> str:
    """A setting as the user wrote it, and what a share ("20%") comes to on this machine."""
    return f"{spec} ({_size(resolved)} {of})" if _is_share(spec) else str(spec)


def render(report: dict[str, Any]) -> str:
    """The report as text for a person."""
    out: list[str] = []
    server, lms, mem = report["server"], report["lmstudio"], report["memory"]
    state = "running" if server["running"] else "not running"
    out.append(f"Served in-process (server at {server['url']}: {state})")
    out += _render_ranks(server.get("ranks"))
    width = max([len(r["id"]) for r in report["models"]] + [10])
    for r in report["models"]:
        loaded = {True: "loaded", False: "not loaded", None: "configured"}[r["loaded"]]
        extra = f"  ({r['note']})" if r["note"] else ""
        out.append(
            f"  {r['id']:{width}}  {loaded:10}  {_size(r['weights_bytes']):>8}  "
            f"{r['path'] or '-'}{extra}"
        )
        if r["settings"]:
            out.append(f"  {'':{width}}  settings {inline(r['settings'])}")
    out += _render_lost(server)
    out.append("")
    if not lms["enabled"]:
        out.append(f"LM Studio at {lms['url']}: upstream disabled ([upstream] enabled = false)")
    elif not lms["reachable"]:
        out.append(f"LM Studio: {lms['error']}")  # it names the URL
    else:
        api = lms["api"] + ("" if lms["can_unload"] else ", no unload: LM Studio before 0.4")
        out.append(f"LM Studio at {lms['url']} (REST API {api})")
        if not lms["loaded"]:
            out.append("  nothing loaded")
        for m in lms["loaded"]:
            dup = m["also_served_here"]
            also = f"  also served here as {', '.join(dup)}: two copies" if dup else ""
            out.append(
                f"  {m['key']}  loaded as {', '.join(m['instances'])}  "
                f"{_size(m['size_bytes'])}{also}"
            )
    out.append("")
    kv = (
        "derived at each load from what the weights leave"
        if mem["kv_memory"] is None
        else _spec(mem["kv_memory"], mem["kv_memory_bytes"], "of all RAM")
    )
    ram_tier = _spec(mem["ram_budget"], mem["ram_budget_bytes"], "of available RAM now")
    if _is_share(mem["ram_budget"]):
        ram_tier += "; at each load, a share of what the weights leave"
    floor = (
        "off"
        if mem["min_available_bytes"] is None
        else _spec(mem["min_available"], mem["min_available_bytes"], "of all RAM")
    )
    out += [
        "Memory",
        f"  RAM              {gb(mem['total_bytes'])} total, "
        f"{gb(mem['available_bytes'])} available",
        f"  weights served   {gb(mem['weights_bytes'])} (those on disk, all models)",
        f"  RAM tier budget  {ram_tier}",
        f"  K/V memory       {kv}",
        f"  kept free        {floor}",
        f"  unload LM Studio's copy before a load: {'yes' if mem['unload_duplicates'] else 'no'}",
        "",
        "Optional extras (Python packages)",
    ]
    for name, present in report["extras"].items():
        what, extra = EXTRAS[name]
        how = "installed" if present else f"missing (pip install '.[{extra}]')"
        out.append(f"  {name:11} {how:34} {what}")
    out += ["", "Programs on PATH"]
    for name, where in report["programs"].items():
        out.append(f"  {name:17} {where or 'not found'}")
    blas = report["cpu_blas"]
    out += ["", f"MLX's CPU BLAS: {blas['name']}"]
    if blas["advice"]:
        out.append(f"  {blas['advice']}")
    return "\n".join(out)


def _render_ranks(ranks: dict[str, Any] | None) -> list[str]:
    """A split model's ranks: their state, and what each one's slices hold."""
    if not ranks:
        return []
    restarts = ranks.get("restarts", 0)
    last = f"; last lost: {ranks['last_failure']}" if ranks.get("last_failure") else ""
    out = [f"  split across {ranks['size']} ranks ({ranks['mode']} over {ranks['backend']}): "
           f"{ranks['state']}, {restarts} restarts{last}"]  # fmt: skip
    for r in ranks.get("holdings") or []:
        out.append(
            f"    rank {r['rank']} ({r['layout']}): RAM {_size(r.get('ram_bytes'))} in "
            f"{r.get('ram_blocks', 0)} blocks and {r.get('ram_checkpoints', 0)} checkpoints, "
            f"SSD {_size(r.get('ssd_bytes'))} in {r.get('ssd_entries', 0)} files "
            f"({r.get('ssd_root')}), live K/V {_size(r.get('kv_bytes'))}"
        )
    return out


def _render_lost(server: dict[str, Any]) -> list[str]:
    """The running server's top causes of lost prompt tokens, new content aside (nothing
    fixes that), each with its share and its fix: the sentence, and the setting as TOML."""
    if not server["running"]:
        return []
    out = ["", "Lost tokens (last hour)"]
    d = server.get("diagnosis")
    if d is None:
        return out + [f"  {server.get('diagnosis_error')}"]
    if not d["requests"]:
        return out + ["  no requests in the last hour"]
    lost = [c for c in d["causes"] if c["cause"] != "new_content"]
    fresh = d["computed_tokens"] - sum(c["tokens"] for c in lost)
    out.append(f"  {d['computed_tokens'] - fresh:,} of {d['prompt_tokens']:,} prompt tokens "
               f"computed again, {fresh:,} new, in {d['requests']:,} requests")  # fmt: skip
    if not lost:
        return out + ["  nothing lost: every token computed was new"]
    width = max(len(c["cause"]) for c in lost[:LOST_SHOWN])
    for c in lost[:LOST_SHOWN]:
        fix = c["fix"]
        out.append(f"  {c['cause']:{width}}  {c['tokens']:,} tokens ({c['share']:.0%}): "
                   f"{fix['text']}")  # fmt: skip
        if fix.get("key"):
            out.append(f"  {'':{width}}  {fix['key']} = {inline(fix['value'])}")
    return out
