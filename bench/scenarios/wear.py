"""SSD wear per agent session: bytes written and RAM held under each write policy, and the
hit a restart keeps.

Run as `python -m bench.scenarios.wear --model demo-hybrid --out DIR` (or `--shape qwen3.6-35b-a3b`
for a layer-scaled build of that shape: real per-layer dimensions, fewer layers and
experts, unquantized, its bytes scaled by the layer count). Each row also prices its entry
counts at qwen3.6-35b-a3b's entry sizes (`scaled`), with the issue's target, 1.5 x (final
KV + one checkpoint). It drives an in-process Engine (its own process, like engine_bridge.probes.shapes)
through one session of the bench's agent trace, turn by turn, closes it (a graceful
restart), opens a new one on the same cache folder and sends the session's next turn and a
second session's first call; it reports, per policy, the SSD bytes written, the RAM the
tier holds at the end, the session's final KV and one checkpoint's bytes, and the tokens
the two requests after the restart got from the cache.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

from .. import traces

# Layer-scaled shape: 3 Gated DeltaNet layers and 1 attention layer (the real 30 + 10 over
# 4), 8 experts of 2 per token instead of 256 of 8; everything per layer is the real one.
SHAPE_OVERRIDES = {
    "num_hidden_layers": 4,
    "full_attention_interval": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
}
SHAPE_REAL_LAYERS = 40
BLOCK_TOKENS = 64


def shape_entry_bytes(shape: str = "qwen3.6-35b-a3b") -> tuple[int, int]:
    """(block, checkpoint) bytes of the real shape: a 64-token bf16 block of its attention
    layers' K and V, and a checkpoint of its Gated DeltaNet layers' float32 recurrent and
    bf16 conv states plus half a block of tail (a checkpoint sits mid-block on average)."""
    from engine_bridge.probes.shapes import SHAPES

    c = SHAPES[shape]["config"]
    layers, every = c["num_hidden_layers"], c["full_attention_interval"]
    attention, linear = layers // every, layers - layers // every
    block = attention * 2 * c["num_key_value_heads"] * c["head_dim"] * BLOCK_TOKENS * 2
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    hk, hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    conv_dim = 2 * hk * dk + hv * dv
    state = hv * dk * dv * 4 + (c["linear_conv_kernel_dim"] - 1) * conv_dim * 2
    return block, linear * state + block // 2


def scaled(row: dict[str, Any], shape: str = "qwen3.6-35b-a3b") -> dict[str, float]:
    """A row's entry counts priced at the shape's entry sizes: SSD bytes written, RAM held
    (and its live part), the final prompt's KV, and the target 1.5 x (final KV + one
    checkpoint)."""
    block, ckpt = shape_entry_bytes(shape)
    files, ram = row["ssd_files"], row["ram_by_kind"]
    written = files["blocks"][0] * block + files["checkpoints"][0] * ckpt
    live = ram["blocks"][0] * block + ram["checkpoints"][0] * ckpt
    final_kv = row["final_prompt_tokens"] // BLOCK_TOKENS * block
    target = 1.5 * (final_kv + ckpt)
    return {
        "written": written,
        "ram": live + ram["superseded"][0] * ckpt,
        "ram_live": live,
        "final_kv": final_kv,
        "checkpoint": ckpt,
        "target": target,
        "written_over_kv_and_checkpoint": written / (final_kv + ckpt),
    }


def _request(body: dict[str, Any], model: str, max_tokens: int):
    from engine_bridge.types import GenerationRequest, Sampling
    from proxy.dialects.anthropic import build_messages, parse_tools

    return GenerationRequest(
        model=model,
        messages=build_messages(body),
        tools=parse_tools(body),
        max_tokens=max_tokens,
        sampling=Sampling(temperature=0.0),
        tenant="local",
    )


async def _send(engine, req) -> tuple[int, int]:
    stream = await engine.start(req)
    async for _ in stream:
        pass
    return stream.prompt_tokens, stream.cached_tokens


def _progress(line: str) -> None:
    """A line per turn on stderr: a layer-scaled run takes hours on a CPU."""
    print(f"wear: {line}", file=sys.stderr, flush=True)


def _settings(cache_dir: Path, model_spec: str, policy: str | None, args) -> Any:
    from engine_bridge.engine import EngineSettings

    names = {f.name for f in fields(EngineSettings)}
    kw: dict[str, Any] = {
        "cache_dir": cache_dir,
        "model_specs": [model_spec],
        "ram_budget_bytes": args.ram_budget,
    }
    if "ssd_write_policy" in names:  # after this change; before it, write_through only
        from engine_bridge.cache.write_policy import WritePolicy

        kw["ssd_write_policy"] = WritePolicy(policy)
        kw["ssd_checkpoint_delay_s"] = args.checkpoint_delay
    else:
        assert policy in ("through", "evict"), f"{policy} needs the new code"
        kw["ssd_write_through"] = policy == "through"
    return EngineSettings(**kw)


def _kv_and_checkpoint_bytes(engine) -> tuple[int, int]:
    """Bytes of the RAM tier's blocks, and of its largest checkpoint (one checkpoint)."""
    entries = engine.tiers.ram.entries()
    blocks = sum(e.nbytes for e in entries if e.kind.value == "blocks")
    ckpts = [e.nbytes for e in entries if e.kind.value == "checkpoints"]
    return blocks, max(ckpts, default=0)


def _files_by_kind(root: Path) -> dict[str, list[int]]:
    """{kind: [files, bytes]} of the entry files under `root`."""
    out = {"blocks": [0, 0], "checkpoints": [0, 0]}
    for kind, counts in out.items():
        for f in root.glob(f"*/*/{kind}/*/*.safetensors"):
            counts[0] += 1
            counts[1] += f.stat().st_size
    return out


def _ram_by_kind(entries) -> dict[str, list[int]]:
    """{kind: [entries, bytes]} held in RAM, checkpoints also split live / superseded."""
    out = {"blocks": [0, 0], "checkpoints": [0, 0], "superseded": [0, 0]}
    for e in entries:
        key = e.kind.value if not getattr(e, "superseded", False) else "superseded"
        out[key][0] += 1
        out[key][1] += e.nbytes
    return out


def run_policy(policy: str, model_spec: str, model_id: str, root: Path, args) -> dict[str, Any]:
    from engine_bridge.engine import Engine

    trace = traces.agent_trace(
        args.seed,
        (args.turns + 1, 1),
        system_chars=args.system_chars,
        tool_detail_chars=0,
        result_chars=args.result_chars,
        compact_tools=True,
    )
    session = [c for c in trace.calls if c.session == 0]
    other = [c for c in trace.calls if c.session == 1]
    cache_dir = root / f"cache-{policy}"
    shutil.rmtree(cache_dir, ignore_errors=True)
    cache_dir.mkdir(parents=True)
    # Reuse the model build: copy nothing, point at the shared models folder.
    (cache_dir / "models").symlink_to(root / "models")
    loop = asyncio.Runner()
    engine = Engine(_settings(cache_dir, model_spec, policy, args))
    started = time.perf_counter()
    prompt = 0
    for turn, call in enumerate(session[: args.turns], 1):
        prompt, cached = loop.run(_send(engine, _request(call.body, model_id, args.max_tokens)))
        _progress(
            f"{policy}: turn {turn}/{args.turns}: {prompt:,} prompt tokens, {cached:,} cached,"
            f" {time.perf_counter() - started:.0f} s"
        )
    ram = engine.tiers.ram.stats()
    kv_bytes, ckpt_bytes = _kv_and_checkpoint_bytes(engine)
    ram_entries = engine.tiers.ram.entries()
    loop.run(engine.close())
    ssd = engine.tiers.ssd.stats()
    session_s = time.perf_counter() - started
    loop.close()
    written = _files_by_kind(cache_dir)  # what the session left on disk, before the restart
    ram_by_kind = _ram_by_kind(ram_entries)
    # The restart: a new engine on the same folder sends the session's next turn, another
    # on a copy of it a second session's first call (each sees only what the disk kept).
    copy = root / f"cache-{policy}-copy"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(cache_dir, copy, symlinks=True)
    after = []
    on_disk = 0
    for folder, call in ((cache_dir, session[args.turns]), (copy, other[0])):
        loop = asyncio.Runner()
        engine = Engine(_settings(folder, model_spec, policy, args))
        engine.tiers.ssd.wait_reconciled(60)
        on_disk = engine.tiers.ssd.stats().bytes
        after.append(loop.run(_send(engine, _request(call.body, model_id, args.max_tokens))))
        _progress(f"{policy}: after the restart: {after[-1][1]:,} of {after[-1][0]:,} cached")
        loop.run(engine.close())
        loop.close()
    return {
        "policy": policy,
        "turns": args.turns,
        "final_prompt_tokens": prompt,
        "ssd_bytes_written": ssd.bytes_written,
        "ssd_writes": ssd.writes,
        "ssd_bytes_on_disk": on_disk,
        "ssd_files": written,
        "ram_by_kind": ram_by_kind,
        "superseded_skips": getattr(ssd, "superseded_skips", None),
        "ram_bytes": ram.bytes,
        "ram_checkpoint_bytes": ram.checkpoint_bytes,
        "ram_checkpoints": ram.checkpoints,
        "ram_superseded": getattr(ram, "superseded_checkpoints", None),
        "final_kv_bytes": kv_bytes,
        "checkpoint_bytes": ckpt_bytes,
        "target_bytes": int(1.5 * (kv_bytes + ckpt_bytes)),
        "restart_prompt_tokens": [a[0] for a in after],
        "restart_cached_tokens": [a[1] for a in after],
        "restart_hit_ratio": sum(a[1] for a in after) / sum(a[0] for a in after),
        "session_s": session_s,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.scenarios.wear", description=__doc__)
    p.add_argument("--model", default="demo-hybrid")
    p.add_argument("--shape", help="build this shape layer-scaled instead of --model")
    p.add_argument("--policies", default="through,evict,second-use")
    p.add_argument("--turns", type=int, default=50)
    p.add_argument("--result-chars", type=int, default=300)
    p.add_argument("--system-chars", type=int, default=3000)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--ram-budget", type=int, default=8 << 30)
    p.add_argument("--checkpoint-delay", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench-out/wear"))
    p.add_argument("--label", default="", help="a name for this run in the output file")
    args = p.parse_args(argv)
    root = args.out.resolve()
    (root / "models").mkdir(parents=True, exist_ok=True)
    scale = 1.0
    if args.shape:
        from engine_bridge.probes.shapes import build_shape

        # Unquantized: MLX's CPU quantized matmul is a scalar loop (a 16-token forward of the
        # 4-bit build ran past 2 minutes), and a weight's format changes no entry's size.
        path = build_shape(args.shape, root, SHAPE_OVERRIDES, bits=None)
        from engine_bridge.probes.shapes import float32_gather_mm_on_cpu

        float32_gather_mm_on_cpu()
        spec, model_id = str(path), path.name
        scale = SHAPE_REAL_LAYERS / SHAPE_OVERRIDES["num_hidden_layers"]
    else:
        from engine_bridge.models.demo import ensure_demo_model

        ensure_demo_model(args.model, root)
        spec = model_id = args.model
    rows = []
    for policy in args.policies.split(","):
        row = run_policy(policy, spec, model_id, root, args)
        row["layer_scale"] = scale
        row["scaled"] = scaled(row)
        if args.shape:
            row["scaled"]["measured_written_x_layers"] = row["ssd_bytes_written"] * scale
            row["scaled"]["measured_ram_x_layers"] = row["ram_bytes"] * scale
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    label = args.label or "run"
    out = root / f"wear-{label}.json"
    out.write_text(
        json.dumps(
            {"model": model_id, "args": vars(args) | {"out": str(root)}, "rows": rows}, indent=1
        )
    )
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


# demo-hybrid, and demo-qwen36: our user's model shape, whose entries are the real layout's.
WEAR_MODELS = ("demo-hybrid", "demo-qwen36")


def scenario(settings, model) -> Any:
    """The bench's `wear` scenario: this module's run on each of WEAR_MODELS (its own
    process, as the engine needs), priced at the qwen3.6-35b-a3b entry sizes."""
    return [_one(settings, hybrid) for hybrid in WEAR_MODELS]


def _one(settings, hybrid: str) -> Any:
    import subprocess

    from ..results import Row, ScenarioResult, ratio

    result = ScenarioResult("wear", hybrid)
    turns = settings.size(12, 50)
    out = settings.out / "wear" / hybrid
    cmd = [sys.executable, "-m", "bench.scenarios.wear", "--model", hybrid, "--turns", str(turns)]
    cmd += ["--out", str(out), "--label", "bench", "--seed", str(settings.seed)]
    settings.progress(f"[wear] {turns}-turn session per write policy on {hybrid}")
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        result.errors.append(f"bench.scenarios.wear exited {proc.returncode}: {proc.stderr[-500:]}")
        return result.finish()
    rows = json.loads((out / "wear-bench.json").read_text())["rows"]
    gb = 1e9
    for r in rows:
        s = r["scaled"]
        files = r["ssd_files"]
        hits = r["restart_cached_tokens"]
        prompts = r["restart_prompt_tokens"]
        result.rows.append(
            Row(
                f"SSD GB written per {turns}-turn session, {r['policy']} (scaled)",
                {"ours": s["written"] / gb},
                {"written / (final KV + 1 checkpoint)": s["written_over_kv_and_checkpoint"]},
                note=f"{files['blocks'][0]} blocks / {files['checkpoints'][0]} checkpoints; "
                f"RAM held {s['ram'] / gb:.2f} GB ({s['ram_live'] / gb:.2f} GB live); after a "
                f"restart {hits[0]:,} of {prompts[0]:,} (next turn), {hits[1]:,} of "
                f"{prompts[1]:,} (2nd session)",
            )
        )
        result.metrics[f"{r['policy']}_ssd_bytes_written_scaled"] = s["written"]
        result.metrics[f"{r['policy']}_restart_hit_ratio"] = r["restart_hit_ratio"]
    s = rows[0]["scaled"]
    result.rows.append(
        Row(
            "target: 1.5 x (final KV + 1 checkpoint), GB",
            {"ours": s["target"] / gb},
            {"through / target": ratio(rows[0]["scaled"]["written"], s["target"])},
        )
    )
    result.notes.append(
        f"Entry counts from {hybrid}, priced at qwen3.6-35b-a3b's sizes: a 64-token block "
        f"{s['final_kv'] // max(1, rows[0]['final_prompt_tokens'] // BLOCK_TOKENS):,} B, "
        f"a checkpoint {s['checkpoint']:,} B (python -m bench.scenarios.wear; README, SSD wear)."
    )
    return result.finish()
