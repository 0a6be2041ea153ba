"""A scripted coding-agent session, driven through the official SDKs as a client drives it.

Three questions; each is answered in two tool steps and a final answer (question → the
model reasons and calls a tool; its result → reasons and calls another; that result →
reasons and answers). The server runs with the test-only forced-output hook
(engine_bridge/scheduling/forced_output.py), so the model writes the family's real markup,
reasoning first, as the model of a real chat template writes it
(engine_bridge/models/demo/real_templates.py). The assistant turns sent back are what the SDK parsed from the server's
answer (content, tool calls, reasoning), not the script's, with the reasoning either sent
back (OpenAI `reasoning_content`, Anthropic thinking blocks) or dropped, as clients do.

Used by tests/prompting/test_agent_templates.py and the bench's agent-templates scenario.
It never imports mlx: the markup writers are plain string code.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from engine_bridge.models.demo import families, real_templates

from . import corpus

Dialect = Literal["openai", "anthropic"]
Kind = Literal["question", "tool"]

TOOLS_OPENAI = families.TOOLS
TOOLS_ANTHROPIC = families.TOOLS_ANTHROPIC
# What comes between the reasoning and a final answer where it is more than nothing:
# harmony answers on the final channel.
FINAL_OPENERS = {"harmony": "<|start|>assistant<|channel|>final<|message|>"}


@dataclass(frozen=True, slots=True)
class Turn:
    """One forced answer: the prompt text that selects it, the markup, what it means."""

    match: str
    text: str
    reasoning: str
    calls: tuple[dict[str, Any], ...]
    answer: str  # the final answer's text; "" on a tool step


@dataclass(frozen=True, slots=True)
class Task:
    question: str
    turns: tuple[Turn, Turn, Turn]
    results: tuple[str, str]  # the two tool results, in order


@dataclass(frozen=True, slots=True)
class Script:
    template: str  # the real template's file name (real_templates.REAL)
    system: str
    tasks: tuple[Task, ...]

    def forced(self) -> list[dict[str, str]]:
        """The entries of MLX_PROMPT_CACHE_FORCE_OUTPUT's file that play this script."""
        return [{"match": t.match, "text": t.text} for task in self.tasks for t in task.turns]


def forced_text(
    template: str, reasoning: str, calls: tuple[dict[str, Any], ...], answer: str
) -> str:
    """What the model of real template `template` writes after its generation prompt:
    reasoning (where it reasons), then calls or a final answer, in its real markup."""
    real = real_templates.REAL[template]
    head = real.head(reasoning) if real.head is not None else ""
    return head + (real.write(calls) if calls else FINAL_OPENERS.get(real.family, "") + answer)


def _cut(text: str, chars: int) -> str:
    """`text` to at most `chars` characters, ending at a word (prose runs past its ask)."""
    return text if len(text) <= chars else text[:chars].rsplit(" ", 1)[0].rstrip(" ,;:")


def script(
    template: str,
    seed: int = 0,
    system_chars: int = 28_000,
    result_chars: int = 300,
    reasoning_chars: int = 600,
    tasks: int = 3,
) -> Script:
    """A deterministic session on `template`'s model: a long system prompt (an agent's
    instructions and project notes), then `tasks` questions about this repository's cache."""
    rng = random.Random(seed)
    system = corpus.GUIDE + "\n\n" + corpus.prose(rng, max(0, system_chars - len(corpus.GUIDE)))
    # The cache's own sources: plain Python, no chat markup a tool result could carry in.
    paths = [f.path for f in corpus.source_files() if f.path.startswith("engine_bridge/cache/")]
    case = template.removesuffix(".jinja")
    reasons = real_templates.REAL[template].head is not None
    out = []
    for t in range(tasks):
        path = rng.choice(paths)
        mark = [f"[agent session {case} task {t + 1} step {s + 1}]" for s in range(3)]
        _, read = corpus.excerpt(rng, result_chars, path)
        _, grep = corpus.excerpt(rng, result_chars, path)
        read_call = {"name": "Read", "arguments": {"file_path": path, "limit": 200}}
        grep_call = {"name": "Bash", "arguments": {"command": f"grep -n 'def ' {path}", "timeout": 30}}  # fmt: skip
        answer = f"{path} keeps one job per function; the second call site is the one to change (task {t + 1})."  # fmt: skip
        # Real reasoning runs to hundreds of tokens: it is what a template drops.
        steps = (
            (f"Task {t + 1}: first I read {path}.", (read_call,), ""),
            ("Now I look for where its functions are defined.", (grep_call,), ""),
            ("I have what I need to answer.", (), answer),
        )
        steps = tuple((f"{r} {_cut(corpus.prose(rng, reasoning_chars), reasoning_chars)}", c, a)
                      for r, c, a in steps)  # fmt: skip
        turns = tuple(
            Turn(m, forced_text(template, r, calls, a), r if reasons else "", calls, a)
            for m, (r, calls, a) in zip(mark, steps, strict=True)
        )
        question = f"{mark[0]} {corpus.QUESTIONS[t % len(corpus.QUESTIONS)].format(path=path)}"
        results = (f"{mark[1]}\n{corpus.numbered(read)}", f"{mark[2]}\n{corpus.numbered(grep)}")
        out.append(Task(question, turns, results))  # type: ignore[arg-type]
    return Script(template, system, tuple(out))


@dataclass(slots=True)
class Record:
    """One request of the session: what it cost, what the cache gave, what came back."""

    kind: Kind
    task: int
    step: int  # 0: the question; 1, 2: after the first and second tool result
    prompt_tokens: int | None
    cached_tokens: int | None
    ttft_s: float | None
    total_s: float
    completion_tokens: int | None = None
    text: str = ""
    reasoning: str = ""
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    call_ids: list[str] = field(default_factory=list)
    expected: Turn | None = None
    # The OpenAI request's messages, so another server can be sent the same prompts.
    messages: list[dict[str, Any]] = field(default_factory=list)
    paused_s: float = 0.0

    @property
    def share(self) -> float | None:
        if not self.prompt_tokens or self.cached_tokens is None:
            return None
        return self.cached_tokens / self.prompt_tokens


class SessionError(RuntimeError):
    """The server's answer did not carry what the script forced: the session cannot go on."""


def run_session(
    url: str,
    model: str,
    dialect: Dialect,
    plan: Script,
    *,
    send_back_reasoning: bool,
    session: str = "",
    pause_s: float | Callable[[int], float] = 0.0,
    before_question: Callable[[int], None] | None = None,
    max_tokens: int = 1024,
    timeout: float = 600.0,
) -> list[Record]:
    """Play `plan` against `url` as a client would. `session` makes the first question
    unique, so sessions on one server share the system prompt and nothing after it.
    Before each new question after the first: sleep `pause_s` (seconds, or a function of
    the task's index), then call `before_question(task)`."""
    ask = _ask_openai if dialect == "openai" else _ask_anthropic
    history: list[dict[str, Any]] = []
    records: list[Record] = []
    for t, task in enumerate(plan.tasks):
        paused = 0.0
        if t > 0:
            paused = pause_s(t) if callable(pause_s) else pause_s
            if paused > 0:
                time.sleep(paused)
            if before_question is not None:
                before_question(t)
        question = f"{task.question} ({session})" if session and t == 0 else task.question
        history.append({"role": "user", "content": question})
        for step, turn in enumerate(task.turns):
            rec = ask(url, model, plan.system, history, max_tokens, timeout)
            rec.kind, rec.task, rec.step, rec.expected = (
                "question" if step == 0 else "tool", t, step, turn)  # fmt: skip
            rec.paused_s = paused if step == 0 else 0.0
            records.append(rec)
            got = [(name, args) for name, args in rec.calls]
            want = [(c["name"], c["arguments"]) for c in turn.calls]
            if got != want:
                raise SessionError(f"task {t + 1} step {step + 1}: calls {got}, forced {want}")
            history.append(_assistant(dialect, rec, send_back_reasoning))
            if step < 2:
                history.append(_tool_result(dialect, rec.call_ids[0], task.results[step]))
    return records


def replay(url: str, model: str, records: list[Record], max_tokens: int = 16,
           timeout: float = 600.0) -> list[Record]:  # fmt: skip
    """Send another server the OpenAI requests a session sent (for a server the forced
    output cannot reach): the same prompts, whatever that server writes."""
    out = []
    for r in records:
        rec = _ask_openai(url, model, None, r.messages, max_tokens, timeout, reasoning="reasoning")
        rec.kind, rec.task, rec.step, rec.expected = r.kind, r.task, r.step, r.expected
        out.append(rec)
    return out


def _assistant(dialect: Dialect, rec: Record, send_back_reasoning: bool) -> dict[str, Any]:
    if dialect == "openai":
        msg: dict[str, Any] = {"role": "assistant", "content": rec.text or None}
        if rec.calls:
            msg["tool_calls"] = [
                {"id": i, "type": "function",
                 "function": {"name": name, "arguments": _json(args)}}
                for i, (name, args) in zip(rec.call_ids, rec.calls, strict=True)
            ]  # fmt: skip
        if send_back_reasoning and rec.reasoning:
            msg["reasoning_content"] = rec.reasoning
        return msg
    blocks: list[dict[str, Any]] = []
    if send_back_reasoning and rec.reasoning:
        # Our proxy signs nothing; a client sends back the (empty) signature it was given.
        blocks.append({"type": "thinking", "thinking": rec.reasoning, "signature": ""})
    if rec.text:
        blocks.append({"type": "text", "text": rec.text})
    for i, (name, args) in zip(rec.call_ids, rec.calls, strict=True):
        blocks.append({"type": "tool_use", "id": i, "name": name, "input": args})
    return {"role": "assistant", "content": blocks}


def _tool_result(dialect: Dialect, call_id: str, content: str) -> dict[str, Any]:
    if dialect == "openai":
        return {"role": "tool", "tool_call_id": call_id, "content": content}
    block = {"type": "tool_result", "tool_use_id": call_id, "content": content}
    return {"role": "user", "content": [block]}


def _json(value: Any) -> str:
    import json

    return json.dumps(value, ensure_ascii=False)


def _ask_openai(
    url: str,
    model: str,
    system: str | None,
    history: list[dict[str, Any]],
    max_tokens: int,
    timeout: float,
    reasoning: str = "reasoning_content",
) -> Record:
    import json

    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="agent-session", max_retries=0,
                           timeout=timeout)  # fmt: skip
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        dict(m) for m in history
    ]
    rec = Record("tool", 0, 0, None, None, None, 0.0, messages=messages)
    by_index: dict[int, dict[str, str]] = {}
    start = time.perf_counter()
    stream = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS_OPENAI, max_tokens=max_tokens,
        temperature=0.0, stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    for chunk in stream:
        if chunk.usage is not None:
            rec.prompt_tokens = chunk.usage.prompt_tokens
            rec.completion_tokens = chunk.usage.completion_tokens
            details = chunk.usage.prompt_tokens_details
            rec.cached_tokens = details.cached_tokens if details is not None else None
        for choice in chunk.choices:
            d = choice.delta
            # Our proxy says reasoning_content, mlx_lm.server reasoning: both are extras.
            thought = getattr(d, reasoning, None) or getattr(d, "reasoning_content", None) or ""
            rec.text += d.content or ""
            rec.reasoning += thought
            for tc in d.tool_calls or []:
                slot = by_index.setdefault(tc.index, {"id": "", "name": "", "args": ""})
                slot["id"] = tc.id or slot["id"]
                slot["name"] = (tc.function.name if tc.function else None) or slot["name"]
                slot["args"] += (tc.function.arguments if tc.function else None) or ""
            if rec.ttft_s is None and (d.content or thought or d.tool_calls):
                rec.ttft_s = time.perf_counter() - start
    rec.total_s = time.perf_counter() - start
    for i in sorted(by_index):
        slot = by_index[i]
        rec.calls.append((slot["name"], json.loads(slot["args"] or "{}")))
        rec.call_ids.append(slot["id"])
    return rec


def _ask_anthropic(
    url: str,
    model: str,
    system: str | None,
    history: list[dict[str, Any]],
    max_tokens: int,
    timeout: float,
) -> Record:
    import anthropic

    client = anthropic.Anthropic(base_url=url, api_key="agent-session", max_retries=0,
                                 timeout=timeout)  # fmt: skip
    rec = Record("tool", 0, 0, None, None, None, 0.0)
    start = time.perf_counter()
    with client.messages.stream(
        model=model, max_tokens=max_tokens, system=system or "", messages=history,
        tools=TOOLS_ANTHROPIC, thinking={"type": "enabled", "budget_tokens": 1024},
    ) as s:  # fmt: skip
        for event in s:
            if rec.ttft_s is None and event.type == "content_block_delta":
                rec.ttft_s = time.perf_counter() - start
        msg = s.get_final_message()
    rec.total_s = time.perf_counter() - start
    u = msg.usage
    read = u.cache_read_input_tokens or 0
    rec.prompt_tokens = u.input_tokens + read + (u.cache_creation_input_tokens or 0)
    rec.cached_tokens = read
    rec.completion_tokens = u.output_tokens
    for b in msg.content:
        if b.type == "thinking":
            rec.reasoning += b.thinking
        elif b.type == "text":
            rec.text += b.text
        elif b.type == "tool_use":
            rec.calls.append((b.name, dict(b.input)))  # type: ignore[arg-type]
            rec.call_ids.append(b.id)
    return rec
