"""The overhead scenario: what the proxy adds on a miss, and what lookups cost.

Each prompt is sent once to our proxy with the cache on (a miss: every prompt starts with
its own line, so no block is shared), to the --no-cache server, and to bare mlx-lm in a
process of its own with the same model and the same rendered tokens.
"""

from __future__ import annotations

import json

from .. import traces
from ..harness import Harness, Settings, chars_per_token, probe
from ..results import Row, Sample, ScenarioResult, median, ratio
from ..servers import ModelSpec


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
            Row(metric, {"ours": lookup[key] * 1e3}, note="engine_bridge.probes.lookup")
        )
    _render_rows(measured["render"], result)
    _cold_series(settings, model, result)
    tokens_ours = [s.prompt_tokens for s in result.of("ours")]
    result.metrics["prompt_tokens_equal_ours_vs_bare"] = float(
        tokens_ours == [b["prompt_tokens"] for b in bare]
    )
    return result.finish()


def _render_rows(render: dict, result: ScenarioResult) -> None:
    """Chat template to token ids and message starts, on a 201-message agent session."""
    n = int(render["messages"])
    one = render["template_s"]
    tokenized = render["template_tokenized_s"]
    result.metrics |= {f"render_{k}": v for k, v in render.items()}
    note = "engine_bridge.probes.render; ratios against one apply_chat_template call"
    for metric, key in (
        ("one apply_chat_template, text only", "template_s"),
        ("one apply_chat_template, tokenized (its default)", "template_tokenized_s"),
        ("render_chat, cold: token ids and message starts", "render_chat_cold_s"),
        ("render_chat, the next turn (prefix memo warm)", "render_chat_next_turn_s"),
        ("before: one render per message prefix", "per_prefix_renders_s"),
    ):
        t = render[key]
        result.rows.append(
            Row(
                f"{metric}, {n} messages with tools (ms)",
                {"ours": t * 1e3},
                {"/ text only": ratio(t, one), "/ tokenized": ratio(t, tokenized)},
                note=note,
            )
        )


def _cold_series(settings: Settings, model: ModelSpec, result: ScenarioResult) -> None:
    """Fresh long prompts in a row, each a full miss, while the cache fills with the earlier
    ones: the miss path must not slow down as the cache grows.

    Both servers run at once and take each prompt in turn, alternating which goes first, so
    drift on a shared machine falls on both alike.
    """
    n = 5
    tokens = settings.size(1500, 20_000)
    cpt = chars_per_token(model)
    # The corpus starts every document alike: a first line of its own makes each prompt
    # share nothing past a few tokens, with our block chain or mlx_lm.server's token prefix.
    prompts = []
    for k in range(n):
        system, user = traces.chat_trace(settings.seed + 100 + k, 1, tokens, cpt).session(0)
        system = {**system, "content": f"{k * 7919 % 1000:03d} cold series\n{system['content']}"}
        prompts.append([system, user])
    with Harness(settings, result, model) as h, h.serve("ours") as ours, h.serve("mlx_lm") as base:
        for k, messages in enumerate(prompts):
            for server in (ours, base) if k % 2 == 0 else (base, ours):
                sample = h.send(
                    server, "openai", {"messages": messages, "max_tokens": 1}, k, "cold"
                )
                h.progress(f"cold prompt {k + 1}/{n}", server, sample)
    ttft = {kind: [s.ttft_s for s in result.of(kind, "cold")] for kind in ("ours", "mlx_lm")}
    per_prompt = [ratio(a, b) for a, b in zip(ttft["ours"], ttft["mlx_lm"], strict=True)]
    result.metrics |= {f"cold_{k + 1}_ours_over_mlx_lm": r for k, r in enumerate(per_prompt)}
    prompt_tokens = result.of("ours", "cold")[-1].prompt_tokens
    result.rows.append(
        Row(
            f"TTFT of the fifth fresh {prompt_tokens}-token prompt in a row, cache holding "
            "the first four (s)",
            {"ours": ttft["ours"][-1], "mlx_lm": ttft["mlx_lm"][-1]},
            {
                "ours / mlx_lm, fifth": per_prompt[-1],
                "ours / mlx_lm, first": per_prompt[0],
            },
            note="per prompt: " + ", ".join(f"{r:.3f}" for r in per_prompt if r is not None),
        )
    )


def _bare_samples(k: int, bare: dict) -> list[Sample]:
    """Every timed run of bare mlx-lm on prompt `k`, as samples of the "bare" server."""
    return [
        Sample("bare", k, t, t, bare["prompt_tokens"], 0, 1, None, ok=True, label="turn")
        for t in bare["ttft_s"]
    ]
