"""One rank of the sharded-load check (tests/distributed/test_sharded_load.py).

Run by `mlx.launch` on every rank: loads each model through the engine's own loader
split across the ranks, and the same model whole, runs one prompt and a few greedy steps
through both, and writes what it saw to `<out>/rank<r>.json`.
    python -m tests.support.distributed_rank OUT CACHE_DIR MODE MODEL...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from engine_bridge.distributed.world import join
from engine_bridge.models import loading
from engine_bridge.types import EngineError

PROMPT = [1, 5, 9, 200, 31, 77, 12, 3, 41, 42, 43, 7, 300, 2, 18, 99]
STEPS = 4


def run(model, tokens: list[int]) -> tuple[list[mx.array], list[int]]:
    """Logits of the prompt's last position and of each greedy step, and the tokens."""
    cache = make_prompt_cache(model)
    logits = model(mx.array([tokens]), cache=cache)[:, -1, :]
    seen, out = [logits], []
    for _ in range(STEPS):
        token = int(mx.argmax(logits, axis=-1).item())
        out.append(token)
        logits = model(mx.array([[token]]), cache=cache)[:, -1, :]
        seen.append(logits)
    return seen, out


def _nbytes(model) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def main() -> None:
    out_dir, cache_dir, mode, models = (
        Path(sys.argv[1]),
        Path(sys.argv[2]),
        sys.argv[3],
        sys.argv[4:],
    )
    world = join(mode)
    report: dict = {"rank": world.rank, "size": world.size, "mode": mode, "models": {}}
    for model_id in models:
        ref = loading.resolve(model_id, cache_dir, [])
        try:
            split = loading.load(ref, world)
        except EngineError as e:
            report["models"][model_id] = {"refused": str(e), "status": e.status}
            continue
        whole = loading.load(ref)
        got, tokens = run(split.model, PROMPT)
        want, want_tokens = run(whole.model, PROMPT)
        diff = max(float(mx.abs(a - b).max()) for a, b in zip(got, want, strict=True))
        report["models"][model_id] = {
            "max_abs_diff": diff,
            "tokens": tokens,
            "whole_tokens": want_tokens,
            "weight_bytes": _nbytes(split.model),
            "fingerprint": split.fingerprint,
            "whole_fingerprint": whole.fingerprint,
            "whole_weight_bytes": _nbytes(whole.model),
        }
    # A collective at the end: both ranks reached it, so neither left the other waiting.
    report["shared"] = world.share({"from": "rank 0", "models": models} if world.leader else None)
    report["least"] = world.least(10 + world.rank)
    # Resume points: rank 1 lost its checkpoint at 128, then every one past 64.
    held = {0: [0, 64, 128, 192], 1: [0, 64, 192]}
    report["common"] = [
        world.deepest_common(held[world.rank]),
        world.deepest_common([0, 64, 128, 192] if world.leader else [0, 64]),
        world.deepest_common([] if world.leader else [64]),
    ]
    (out_dir / f"rank{world.rank}.json").write_text(json.dumps(report), encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
