"""Agent sessions on real chat templates: how much of each request the cache serves.

A scripted session (bench/agent_session.py: three questions, two tool steps each) runs
through the official OpenAI and Anthropic SDKs against one server that serves a family
model per real template, forced to write that model's real markup. The client sends back
what the SDK parsed, with the reasoning sent back or dropped. Qwen3.5/3.6, MiniMax M2,
gpt-oss, Gemma 4 and GLM-4.7 drop earlier reasoning once a new question comes, so the
prompt leaves the cached sequence at the previous task's first assistant turn unless the
engine keeps it (Qwen3.6's `preserve_thinking`, on by default) or warms the next
question's prefix while the person reads the answer (templates without such a flag).

The issue's targets are shares of each prompt (tool steps ≥ 0.98, new questions ≥ 0.95),
which behind an agent's 30k-token system prompt cannot tell a hit from a miss of a whole
task: the bench (`agent-templates`) reports them at that size. Here the system prompt is
short, so the session is quick on the CPU, and each request must miss no more than what it
adds: a tool step all the server saw comes back (its previous prompt and what it wrote), a
new question misses only its own tokens and the template's markup around them.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from bench import agent_session
from engine_bridge.models.demo import real_templates
from tests.conftest import WARM_AHEAD_ON, fresh_cache_dir, start_server

FOLDER = real_templates.templates_dir()
pytestmark = pytest.mark.skipif(
    not FOLDER.is_dir(), reason=f"the real chat templates are not here: {FOLDER.resolve()}"
)
# One reasoning template per family that drops earlier reasoning, and Qwen3.6, which can
# keep it; the other real templates are covered by test_real_template_*.py.
TEMPLATES = (
    "qwen3_6.jinja",
    "qwen3_5.jinja",
    "minimax_m2.jinja",
    "gpt_oss_harmony.jinja",
    "gemma4_31b_it.jinja",
    "glm_4_7_flash.jinja",
)
# Characters: a ~1.3k-token system prompt (the bench runs an agent's 30k), ~120-token tool
# results (more where a template escapes them, as gpt-oss's does), ~60 tokens of reasoning
# per turn (the model writes every token of it: decoding is most of a session's time).
SIZES = {"system_chars": 4_000, "result_chars": 250, "reasoning_chars": 150}
NEW_QUESTION_SHARE = 0.95
# gpt-oss's template writes a call's header and arguments otherwise than the model does
# (test_real_template_rerender.py says how): its tool steps reuse the previous prompt and
# the analysis, and prefill the call again.
CALL_RERENDERED = ("gpt_oss_harmony.jinja",)
# A share alone cannot tell a hit from a miss of one task's turns behind a long system
# prompt, so a new question may also miss no more than its own tokens and the template's
# markup around them (the end of the last turn, the user turn, the generation prompt).
QUESTION_MARKUP_TOKENS = 24
# A turn that ends with an answer is offered for warming at once (a render on a pool); a
# warm-up of the next question's ~11k-token prefix takes seconds on this CPU.
OFFER_DEADLINE_S = 10.0
WARM_DEADLINE_S = 120.0
# [cache.warm_ahead] after_idle: the idle second a person reads for (the default) is a wait
# the test's scripted pause would sit out twice per session; a warm-up still starts only
# once no request runs.
WARM_AFTER_IDLE = {"MLX_PROMPT_CACHE_CACHE_WARM_AHEAD_AFTER_IDLE": "0.2"}


@pytest.fixture(scope="module")
def agent_server(demo_root, tmp_path_factory):
    """One server with a model per real template, forced to play each one's script."""
    from engine_bridge.probes import agent_models

    root = tmp_path_factory.mktemp("agent-templates")
    models = agent_models.write_models(root / "models", TEMPLATES)
    plans = {m["template"]: agent_session.script(m["template"], **SIZES) for m in models}
    forced = root / "forced.json"
    outputs = [e for plan in plans.values() for e in plan.forced()]
    forced.write_text(json.dumps({"outputs": outputs}))
    args = ["--upstream", "http://127.0.0.1:9"]
    for m in models:
        args += ["--model", m["path"]]
    cache_dir = fresh_cache_dir(demo_root, root / "cache")
    # Warming ahead on, as served by default: test servers run without it.
    env = {"MLX_PROMPT_CACHE_FORCE_OUTPUT": str(forced), **WARM_AHEAD_ON, **WARM_AFTER_IDLE}
    server = start_server(cache_dir, *args, env=env)
    data = httpx.get(server.url + "/v1/models", timeout=30).json()["data"]
    ids = {Path(m["id"]).name: m["id"] for m in data}
    cases = {
        m["template"]: (ids[m["case"]], m["flag"], plans[m["template"]], Path(m["path"]))
        for m in models
    }
    yield server, cases
    server.stop()


class WarmWaiter:
    """Before a new question: wait, within a deadline, until the engine has warmed the
    prefix the question will have (/v1/cache/stats → warm_ahead), and note what it did."""

    def __init__(self, url: str):
        self.url = url
        self.log: list[str] = []
        self.warmed: list[int] = []
        self.seen = self._settled()  # a previous session's warm-up must not count as ours

    def _stats(self) -> dict | None:
        return httpx.get(self.url + "/v1/cache/stats", timeout=30).json().get("warm_ahead")

    def _settled(self) -> dict | None:
        deadline = time.monotonic() + WARM_DEADLINE_S
        while (now := self._stats()) is not None and now["pending"] and time.monotonic() < deadline:
            time.sleep(0.05)
        return now

    def __call__(self, task: int) -> None:
        start = time.monotonic()
        if self.seen is None:
            self.log.append(f"task {task + 1}: /v1/cache/stats has no warm_ahead section")
            self.warmed.append(0)
            return
        while True:
            now = self._stats()
            offered = now["offered"] > self.seen["offered"]
            if offered and now["pending"] == 0:
                break
            waited = time.monotonic() - start
            if waited > (WARM_DEADLINE_S if offered else OFFER_DEADLINE_S):
                what = "finished" if offered else "offered"
                self.log.append(f"task {task + 1}: no warm-up {what} in {waited:.0f}s")
                break
            time.sleep(0.05)
        self.warmed.append(now["warmed"] - self.seen["warmed"])
        self.log.append(
            f"task {task + 1}: waited {time.monotonic() - start:.2f}s, warmed "
            f"+{now['warmed'] - self.seen['warmed']}, tokens +{now['tokens'] - self.seen['tokens']}"
        )
        self.seen = now


def describe(records: list[agent_session.Record]) -> str:
    return " ".join(
        f"{'Q' if r.kind == 'question' else 't'}{r.task + 1}.{r.step}="
        f"{r.cached_tokens}/{r.prompt_tokens}({(r.share or 0):.3f},{r.ttft_s or 0:.2f}s,{r.total_s or 0:.2f}s,{r.completion_tokens})"
        for r in records
    )


def _cases():
    """Qwen3.6 and 3.5 (a flag, and none) in both dialects, reasoning sent back and dropped;
    the other families as the clients that meet them most: an OpenAI client that drops
    reasoning, and Claude Code, which sends its thinking blocks back."""
    for template in TEMPLATES:
        full = template in ("qwen3_6.jinja", "qwen3_5.jinja")
        for dialect in ("openai", "anthropic"):
            for sent_back in (True, False):
                if full or sent_back == (dialect == "anthropic"):
                    name = "reasoning-sent-back" if sent_back else "dropped"
                    yield pytest.param(
                        template, dialect, sent_back, id=f"{template}-{dialect}-{name}"
                    )


@pytest.mark.parametrize(("template", "dialect", "sent_back"), list(_cases()))
def test_an_agent_session_on_a_real_template_is_served_from_the_cache(
    agent_server, template, dialect, sent_back
):
    server, cases = agent_server
    if template not in cases:
        pytest.skip(f"{template} is not in {FOLDER.resolve()}")
    model, flag, plan, path = cases[template]
    # A template with a flag that keeps reasoning needs no pause; one without gets the
    # pause warming ahead needs, waited for through the engine's counters.
    waiter = None if flag else WarmWaiter(server.url)
    records = agent_session.run_session(
        server.url, model, dialect, plan, send_back_reasoning=sent_back,
        session=f"{template} {dialect} {'sent back' if sent_back else 'dropped'}",
        before_question=waiter,
    )  # fmt: skip
    summary = f"{template} {dialect} sent_back={sent_back}: {describe(records)}"
    if waiter is not None:
        summary += " | warm-ahead: " + "; ".join(waiter.log)
    print(summary)

    assert_served(records, plan, path, template, summary)
    if waiter is not None:
        assert all(w >= 1 for w in waiter.warmed), summary


def assert_served(records, plan, path: Path, template: str, summary: str) -> None:
    """Each client read what the model wrote; each tool step reused all the server saw, and
    each new question missed no more than its own tokens and their markup."""
    # What each client reads is what the model wrote, cache or not.
    for r in records:
        assert r.expected is not None
        assert r.reasoning.strip() == r.expected.reasoning, (r.task, r.step, r.reasoning)
        if r.expected.answer:
            assert r.text.strip() == r.expected.answer, (r.task, r.step, r.text)

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    low = []
    for prev, r in zip(records, records[1:], strict=False):
        if r.kind == "tool":
            # All the server saw (the previous prompt and what it wrote) comes back.
            seen = prev.prompt_tokens + prev.completion_tokens - 1
            if template in CALL_RERENDERED:
                seen = prev.prompt_tokens
            if r.cached_tokens < seen:
                low.append(f"tool step {r.task + 1}.{r.step}: {r.share:.3f}, {r.cached_tokens} < {seen}")  # fmt: skip
        else:
            question = plan.tasks[r.task].question
            missed = r.prompt_tokens - r.cached_tokens
            most = (
                len(tokenizer.encode(question, add_special_tokens=False)) + QUESTION_MARKUP_TOKENS
            )
            if r.share < NEW_QUESTION_SHARE or missed > most:
                low.append(f"question {r.task + 1}: {r.share:.3f}, {missed} tokens missed > {most}")
    assert low == [], summary
