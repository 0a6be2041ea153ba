"""Every test module that runs demo-hybrid runs demo-qwen36 too, or says here why not.

demo-qwen36 is our user's model at toy size: experts, the real 248k vocabulary, an MTP
head with experts. A module that names demo-hybrid but not demo-qwen36 (by id, `QWEN36`
or `HYBRID_IDS`) must appear in WHY_NOT with its reason; a module listed there that now
runs demo-qwen36, or no longer exists, must leave the list.
"""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
RUNS_HYBRID = re.compile(r"demo-hybrid|\bHYBRID\b")
RUNS_QWEN36 = re.compile(r"demo-qwen36|\bQWEN36\b|\bHYBRID_IDS\b")
SAME_KINDS = (
    "cache-kind mechanics: demo-qwen36's caches are demo-hybrid's (ArraysCache + KVCache), "
    "and test_cache_equivalence.py runs it through the same engine paths"
)

WHY_NOT: dict[str, str] = {
    "cache/test_cache_http.py": SAME_KINDS + " (RAM budget, eviction, SSD spill over HTTP)",
    "cache/test_pin_faults.py": SAME_KINDS + " (a fault between a pin and its release)",
    "cache/test_cache_probe.py": SAME_KINDS + " (the probe's tier arithmetic)",
    "cache/test_tiers_reads.py": SAME_KINDS + " (reads across RAM and SSD)",
    "cache/test_warm_ahead.py": "warming ahead is the template's doing, and demo-qwen36 has "
    "demo-hybrid's template; the real templates' sessions run in test_agent_templates.py",
    "cache_api/test_bounds_and_small_items.py": "the proxy's stores, logs and routes; its "
    "reasoning-token count needs a character split across tokens, which demo-hybrid's small "
    "byte-level vocabulary gives and Qwen3.6's, with whole characters as tokens, seldom does",
    "distributed/test_serve_ranks.py": "the served split's HTTP path, cache agreement and "
    "failures on demo-hybrid's layer kinds; demo-qwen36 split by heads and by layers runs in "
    "test_lockstep.py and test_sharded_load.py, and two 130 MB ranks here would double its time",
    "distributed/test_bench_distributed.py": "the bench scenario's own parts (command lines, "
    "rows, the weight index mlx_lm.server's pipeline needs, no process left behind); the "
    "scenario itself splits demo-hybrid, whose layer kinds are Qwen3.6's",
    "distributed/test_ranks_shared.py": "the shared tier's keys under a split (each rank's "
    "layout); the split itself of Qwen3.6's shape runs in test_lockstep.py",
    "config/test_config.py": "config parsing names demo ids as strings; no model runs",
    "config/test_model_settings.py": "per-model settings matching; no model runs",
    "config/test_model_settings_http.py": "settings reach the template and sampler the same "
    "for any model; test_tool_controls.py runs the template switches on demo-qwen36",
    "dialects/test_anthropic_api.py": "the Messages API's shape over demo-hybrid's template, "
    "which demo-qwen36 shares; its calls and thinking run in test_tool_formats.py and "
    "test_real_clients.py",
    "dialects/test_openai_api.py": "the chat API's shape, as above",
    "dialects/test_responses_api.py": "the Responses API's shape, as above; Codex runs "
    "demo-qwen36 in test_real_clients.py",
    "dialects/test_responses_codex.py": "Codex's request shapes replayed; the real Codex CLI "
    "runs demo-qwen36 in test_real_clients.py",
    "dialects/test_stream_keepalive.py": "what a stream sends while its first token is "
    "computed does not depend on the model; real Claude Code and Codex run demo-qwen36 in "
    "test_real_clients.py",
    "ops/test_menubar.py": "the menu bar reads a fake server's JSON; no model runs",
    "prompting/test_demo_models.py": "the three default demos' builds; demo-qwen36's build "
    "is test_demo_qwen36.py's",
    "prompting/test_demo_templates.py": "the demo templates' renders; demo-qwen36 ships "
    "demo-hybrid's template file, and test_qwen36_vocab.py renders it through the real "
    "vocabulary",
    "prompting/test_discovery.py": "discovery of the demo and LM Studio folders; "
    "demo-qwen36 in LM Studio's layout is test_lmstudio_folder.py's",
    "prompting/test_prompt_render.py": "renders over the demo tokenizers; demo-qwen36's "
    "tokenizer is test_qwen36_vocab.py's",
    "scheduling/test_scheduler_faults.py": "faults injected into the scheduler are model-"
    "agnostic; demo-hybrid stands for a second model",
    "scheduling/test_lifecycle_races.py": "load and unload races between models: their "
    "shape never enters (demo-qwen36's load is test_lmstudio_folder.py's)",
    "sessions/test_cache_sessions.py": "session listing, pins and deletes; no model "
    "difference past the cache kind",
    "sessions/test_memory_preflight.py": "the preflight on a simulated machine; "
    "demo-qwen36-4bit's preflight is test_lmstudio_folder.py's",
    "ssd/test_cache_folder_faults.py": SAME_KINDS + " (a damaged cache folder)",
    "ssd/test_ssd_damage.py": SAME_KINDS + " (damaged SSD entries)",
    "ssd/test_ssd_wear_server.py": SAME_KINDS + " (SSD write policies); the bench's wear "
    "scenario measures demo-qwen36",
    "vision/test_vision.py": "demo-qwen36 has no vision tower (the real model's is not built)",
}


def _modules() -> dict[str, str]:
    return {
        str(p.relative_to(TESTS)): p.read_text(encoding="utf-8")
        for p in TESTS.rglob("test_*.py")
        if p.name != Path(__file__).name
    }


def test_every_module_that_runs_demo_hybrid_runs_demo_qwen36_or_says_why_not():
    modules = _modules()
    missing = sorted(
        name
        for name, text in modules.items()
        if RUNS_HYBRID.search(text) and not RUNS_QWEN36.search(text) and name not in WHY_NOT
    )
    assert not missing, f"run demo-qwen36 in these, or say why not in WHY_NOT: {missing}"


def test_why_not_lists_only_modules_that_still_leave_demo_qwen36_out():
    modules = _modules()
    stale = sorted(
        name
        for name in WHY_NOT
        if name not in modules
        or RUNS_QWEN36.search(modules[name])
        or not RUNS_HYBRID.search(modules[name])
    )
    assert not stale, f"these no longer belong in WHY_NOT: {stale}"
