"""The overhead scenario: what the proxy adds on a miss, and what lookups cost.

Each prompt is sent once to our proxy with the cache on (a miss: every prompt starts with
its own line, so no block is shared), to the --no-cache server, and to bare mlx-lm in a
process of its own with the same model and the same rendered tokens.
"""

from __future__ import annotations

import json

from . import traces
from .harness import Harness, Settings, chars_per_token, probe
from .results import Row, Sample, ScenarioResult, median, ratio
from .servers import ModelSpec


def overhead(settings: Settings, model: ModelSpec) -> ScenarioResult:
    result = ScenarioResult("overhead", model.id)
    n = settings.size(5, 8)
    tokens = settings.size(1000, 4000)
    trace = traces.chat_trace(settings.seed + 3, n, tokens, chars_per_token(model))
    prompts = []
    for k in range(n):
        messages = trace.session(k)
        messages[0] = {**messages[0], "content": f"Overhead probe {k}.\n" + messages[0]["content"]}
        prompts.append(messages)
    with Harness(settings, result, model) as h:
        for kind in ("ours", "nocache"):
            with h.serve(kind) as server:
                for k, messages in enumerate(prompts):
                    sample = h.send(server, "openai", {"messages": messages}, k)
                    h.progress(f"prompt {k + 1}/{n}", server, sample)
    # The servers are down before bare mlx-lm runs: nothing else competes for the CPU.
    h.progress("bare mlx-lm and lookup timing", "in-process")
    prompt_file = h.work / "overhead-prompts.json"
    prompt_file.parent.mkdir(parents=True, exist_ok=True)
    prompt_file.write_text(json.dumps(prompts))
    repeats = 3
    lookup_tokens = 32_768
    measured = probe(
        "overhead", str(model.path), str(prompt_file), "--repeats", str(repeats),
        "--lookup-tokens", str(lookup_tokens),
    )  # fmt: skip
    bare = measured["bare"]
    for k, b in enumerate(bare):
        result.samples += _bare_samples(k, b)
    ours = median(s.ttft_s for s in result.of("ours"))
    plain = median(s.ttft_s for s in result.of("nocache"))
    bare_ttft = median(b["median_s"] for b in bare)
    result.rows.append(
        Row(
            "median miss-path TTFT (s)",
            {"ours": ours, "nocache": plain, "bare": bare_ttft},
            {
                "ours / bare mlx-lm": ratio(ours, bare_ttft),
                "no-cache / bare": ratio(plain, bare_ttft),
            },
            note="bare = mlx_lm.stream_generate in-process, same model and tokens, median of "
            f"{repeats} runs per prompt after one warm-up; it prefills in 2048-token steps, "
            "the proxy in 512-token steps",
        )
    )
    lookup = measured["lookup"]
    result.metrics |= {f"lookup_{k}": v for k, v in lookup.items()}
    per = f"{lookup_tokens // 1024}k tokens (ms)"
    for metric, key in (
        (f"hash the chain, {per}", "hash_chain_s"),
        (f"cold miss: hash + lookup over RAM and SSD, {per}", "lookup_miss_s"),
        (f"full RAM hit: hash + lookup + pin, {per}", "lookup_hit_s"),
        (f"full SSD hit: hash + lookup (index only), {per}", "lookup_ssd_s"),
        (f"full SSD hit: hash + lookup + promote (file reads), {per}", "promote_ssd_s"),
    ):
        result.rows.append(
            Row(metric, {"ours": lookup[key] * 1e3}, note="engine_bridge.lookup_probe")
        )
    tokens_ours = [s.prompt_tokens for s in result.of("ours")]
    result.metrics["prompt_tokens_equal_ours_vs_bare"] = float(
        tokens_ours == [b["prompt_tokens"] for b in bare]
    )
    return result.finish()


def _bare_samples(k: int, bare: dict) -> list[Sample]:
    """Every timed run of bare mlx-lm on prompt `k`, as samples of the "bare" server."""
    return [
        Sample("bare", k, t, t, bare["prompt_tokens"], 0, 1, None, ok=True, label="turn")
        for t in bare["ttft_s"]
    ]
