"""What a long prefill holds in memory on demo-qwen36, whose vocabulary is the real one.

Qwen3.6's head scores 248,320 rows, so logits for every position of a 2,048-token chunk are
~1 GB in bf16 (2 GB in the demo's float32): a prefill that evaluated them would hold that
at once. This probe measures, each in a fresh child process so peaks do not mix:

- `bare`: mlx-lm's own `stream_generate` (prefill_step_size 2048, max_tokens 1);
- `engine`: an in-process `Engine` generating 1 token for the same prompt, cache on: with
  its default prefill chunk, with mlx-lm's 2048 (and that once more with the cache off),
  and priming the MTP head along the prompt (`speculative = "mtp"`, what "auto" takes on
  a Mac);
- `control`: one 2,048-token forward from an empty cache, once with only the cache's
  state evaluated (what a prefill chunk evaluates) and once with its logits too.

Each reports `mx.get_peak_memory()` (MLX's allocator: active bytes, weights included;
reset once the model is loaded; it counts on the CPU backend too), the weights' bytes, how
far the process's peak RSS rose (`getrusage`, a cross-check that sees host memory too)
and the seconds it took. Run as
`python -m engine_bridge.probes.prefill_memory --json-out FILE [--tokens N]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

MODEL = "demo-qwen36"
REPO = Path(__file__).resolve().parents[2]
STEP = 2048  # mlx-lm's default prefill_step_size, and the control's chunk


def prompt_tokens(tokenizer: Any, n: int) -> list[int]:
    """`n` token ids of this repository's README, repeated as prose until long enough."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    once = len(tokenizer.encode(text))
    ids = tokenizer.encode("\n\n".join([text] * (n // once + 2)))
    assert len(ids) >= n, (len(ids), n)
    return ids[:n]


def weight_bytes(model: Any) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def _max_rss() -> int:
    """The process's peak resident set so far, in bytes (Linux counts KiB, macOS bytes)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def _start() -> tuple[float, int]:
    """Reset MLX's peak (the model is loaded by now) and note the time and peak RSS."""
    mx.reset_peak_memory()
    return time.perf_counter(), _max_rss()


def _measured(weights: int, started: tuple[float, int], **extra: Any) -> dict[str, Any]:
    """MLX's peak since `_start` (active bytes, weights included) and, as a cross-check
    that also sees host memory, how far the process's peak RSS rose past what loading left."""
    peak, rss = mx.get_peak_memory(), _max_rss()
    return {
        "weights_bytes": weights,
        "peak_bytes": peak,
        "peak_above_weights_bytes": peak - weights,
        "rss_peak_bytes": rss,
        "rss_peak_rise_bytes": rss - started[1],
        "seconds": time.perf_counter() - started[0],
        **extra,
    }


def bare(model_dir: Path, n: int, step: int) -> dict[str, Any]:
    """mlx-lm alone: `stream_generate` with `prefill_step_size=step`, one token."""
    from mlx_lm import load, stream_generate

    model, tokenizer = load(str(model_dir))
    tokens = prompt_tokens(tokenizer, n)
    weights = weight_bytes(model)
    start = _start()
    out = [r.token for r in stream_generate(model, tokenizer, tokens, max_tokens=1,
                                            prefill_step_size=step)]  # fmt: skip
    return _measured(weights, start, prompt_tokens=len(tokens), prefill_step=step, out=out)


def engine(model_dir: Path, n: int, chunk: int | None, mtp: bool, cache: bool) -> dict[str, Any]:
    """Our engine, in process: the prompt as token ids, greedy, one token; `cache`: the
    request stores its prompt in the RAM and SSD tiers (what the RAM tier then holds is
    `ram_tier_bytes`, MLX memory that bare mlx-lm frees)."""
    from ..engine import Engine, EngineSettings
    from ..scheduling.speculation.control import Mode, SpeculativeSettings
    from ..types import GenerationRequest, Sampling

    with tempfile.TemporaryDirectory(prefix="prefill-memory-") as tmp:
        cache_dir = Path(tmp)
        (cache_dir / "models").mkdir()
        (cache_dir / "models" / MODEL).symlink_to(model_dir, target_is_directory=True)
        settings = EngineSettings(cache_dir=cache_dir, model_specs=[MODEL])
        if chunk is not None:
            settings.prefill_chunk = chunk
        if mtp:
            settings.speculation = SpeculativeSettings(mode=Mode.MTP)

        async def run() -> dict[str, Any]:
            e = Engine(settings)
            try:
                loaded = await e.load(MODEL)
                tokens = prompt_tokens(loaded.tokenizer, n)
                weights = weight_bytes(loaded.model)
                greedy = Sampling(temperature=0.0)
                req = GenerationRequest(model=MODEL, prompt_tokens=tokens, max_tokens=1,
                                        sampling=greedy, use_cache=cache)  # fmt: skip
                start = _start()
                stream = await e.start(req)
                async for _ in stream:
                    pass
                assert stream.result is not None
                return _measured(weights, start, prompt_tokens=len(tokens),
                                 prefill_chunk=settings.prefill_chunk, mtp_primed=mtp,
                                 cache=cache, ram_tier_bytes=e.stats()["ram"]["bytes"],
                                 completion_tokens=stream.result.completion_tokens)  # fmt: skip
            finally:
                await e.close()

        return asyncio.run(run())


def control(model_dir: Path, step: int) -> dict[str, Any]:
    """One `step`-token forward from an empty cache: the cache state alone evaluated, then
    the same forward with its logits evaluated too (the bytes a prefill avoids)."""
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = load(str(model_dir))
    ids = mx.array(prompt_tokens(tokenizer, step))[None]
    weights = weight_bytes(model)
    out: dict[str, Any] = {"chunk_tokens": step, "weights_bytes": weights}
    for name, with_logits in (("states_only", False), ("with_logits", True)):
        cache = make_prompt_cache(model)
        mx.clear_cache()
        start = _start()
        logits = model(ids, cache=cache)
        mx.eval([c.state for c in cache], logits if with_logits else [])
        out[name] = _measured(weights, start)
        if with_logits:
            out["logits_shape"] = list(logits.shape)
            out["logits_dtype"] = str(logits.dtype)
            out["logits_bytes"] = logits.nbytes
        del logits, cache
    out["logits_bytes_bf16"] = step * out["logits_shape"][-1] * 2
    return out


def _child(args: list[str]) -> dict[str, Any]:
    """Run one measurement in a fresh interpreter and read back its JSON."""
    with tempfile.TemporaryDirectory(prefix="prefill-memory-") as tmp:
        out = Path(tmp) / "one.json"
        cmd = [sys.executable, "-m", __spec__.name, "--json-out", str(out), *args]
        subprocess.run(cmd, check=True, cwd=REPO)
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine_bridge.probes.prefill_memory")
    p.add_argument("--json-out", type=Path, required=True)
    p.add_argument("--root", type=Path, default=None, help="where demo-qwen36 is built")
    p.add_argument("--tokens", type=int, default=16_384, help="prompt tokens")
    # One measurement, run in a child process by the default run.
    p.add_argument("--only", choices=("bare", "engine", "control"), help=argparse.SUPPRESS)
    p.add_argument("--chunk", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--mtp", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--no-cache", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    from ..models.demo import ensure_demo_model

    if args.only is None:
        with tempfile.TemporaryDirectory(prefix="prefill-memory-root-") as tmp:
            root = args.root or Path(tmp)
            model_dir = ensure_demo_model(MODEL, root)
            common = ["--root", str(root), "--tokens", str(args.tokens)]
            ours = [*common, "--only", "engine"]
            result: dict[str, Any] = {
                "model": MODEL,
                "bare": _child([*common, "--only", "bare"]),
                "engine": _child(ours),
                "engine_chunk_2048": _child([*ours, "--chunk", str(STEP)]),
                "engine_chunk_2048_no_cache": _child([*ours, "--chunk", str(STEP), "--no-cache"]),
                "engine_mtp": _child([*ours, "--mtp"]),
                "control": _child([*common, "--only", "control"]),
            }
    else:
        model_dir = ensure_demo_model(MODEL, args.root)
        if args.only == "bare":
            result = bare(model_dir, args.tokens, STEP)
        elif args.only == "engine":
            result = engine(model_dir, args.tokens, args.chunk, args.mtp, not args.no_cache)
        else:
            result = control(model_dir, STEP)
    args.json_out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
