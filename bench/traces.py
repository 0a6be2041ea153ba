"""Deterministic request traces: a chat with a long system prompt, and a coding-agent session.

The agent trace has the shape a Claude-Code-style client sends over the Anthropic API: a
system prompt as a list of blocks whose first block (a billing header) changes per session,
two dozen tools with JSON schemas, thinking blocks, tool_use/tool_result rounds, and two
sessions in the same project. All of its text comes from `corpus`; the same seed and checkout
give byte-identical JSON. `to_openai` converts a call for servers that speak only OpenAI.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import random
import string
from dataclasses import dataclass
from typing import Any

from . import corpus
from .agent_tools import tool_definitions

CHARS_PER_TOKEN = 3.2  # the demo tokenizer on this project's text; scenarios measure theirs


@dataclass(frozen=True, slots=True)
class ChatTrace:
    system: str
    users: tuple[str, ...]
    # The scripted assistant reply after each user turn: every server gets the same history.
    replies: tuple[str, ...]

    def messages(self, turn: int) -> list[dict[str, Any]]:
        """OpenAI messages for turn `turn` (0-based): the system, then history, then a user."""
        out: list[dict[str, Any]] = [{"role": "system", "content": self.system}]
        for i in range(turn):
            out += [
                {"role": "user", "content": self.users[i]},
                {"role": "assistant", "content": self.replies[i]},
            ]
        out.append({"role": "user", "content": self.users[turn]})
        return out

    def new_only(self, turn: int) -> list[dict[str, Any]]:
        """Just what turn `turn` adds to turn `turn - 1`'s prompt, as one user message."""
        assert turn >= 1, "turn 0 is all new"
        return [{"role": "user", "content": self.replies[turn - 1] + "\n\n" + self.users[turn]}]

    def session(self, k: int) -> list[dict[str, Any]]:
        """Session `k` of a shared-system-prompt run: the system and user message k."""
        return [
            {"role": "system", "content": self.system},
            {"role": "user", "content": self.users[k]},
        ]


def chat_trace(
    seed: int, turns: int, system_tokens: int, chars_per_token: float = CHARS_PER_TOKEN
) -> ChatTrace:
    rng = random.Random(f"chat/{seed}")
    system = (
        "You are a careful assistant for the mlx-prompt-cache project. The reference below "
        "is the project's own documentation and code.\n\n"
        + corpus.sized_document(rng, int(system_tokens * chars_per_token))
    )
    users, replies = [], []
    for t in range(turns):
        users.append(_user_message(rng, t))
        replies.append(_reply(rng))
    return ChatTrace(system, tuple(users), tuple(replies))


def _user_message(rng: random.Random, turn: int) -> str:
    # Realistic lengths: a short follow-up, a question with a snippet, or a pasted block.
    kind = rng.choices(("short", "snippet", "paste"), weights=(4, 4, 2))[0]
    if kind == "short" and turn > 0:
        return rng.choice(corpus.FOLLOW_UPS)
    chars = {"short": 300, "snippet": rng.randint(400, 1500), "paste": rng.randint(1500, 4000)}
    path, code = corpus.excerpt(rng, chars[kind])
    question = rng.choice(corpus.QUESTIONS).format(path=path)
    return f"{question}\n\n```python\n{code}\n```"


def _reply(rng: random.Random) -> str:
    text = corpus.prose(rng, rng.randint(500, 1500))
    if rng.random() < 0.5:
        path, code = corpus.excerpt(rng, rng.randint(200, 700))
        text += f"\n\nFor example, in `{path}`:\n\n```python\n{code}\n```"
    return text


# ---- the agent trace ------------------------------------------------------------------------

_TASKS = (
    "The second session of a Claude Code run misses the cache although only the first system "
    "block changed. Find where the prompt is normalized, check the billing-header rule, and "
    "add a test that proves two sessions share their prefix.",
    "Add a --json flag to the cache stats command so scripts can read it, with a test.",
    "TTFT on turn 10 is higher than on turn 2 in the chat benchmark. Find out whether the "
    "cache misses or the prefill of the new tokens is slow, and report numbers.",
    "Review the SSD tier's write path for anything that could lose a block on SIGTERM.",
)
_WORK = (
    "read_file",
    "read_file",
    "grep",
    "glob",
    "run_tests",
    "run_shell",
    "git_diff",
    "edit_file",
    "list_dir",
    "todo_write",
    "search_symbols",
    "lint",
)


@dataclass(frozen=True, slots=True)
class AgentCall:
    session: int
    index: int  # within the session
    body: dict[str, Any]  # an Anthropic Messages request without model and stream

    def anthropic(self, model: str, max_tokens: int) -> dict[str, Any]:
        return {"model": model, **self.body, "max_tokens": max_tokens}

    def openai(self, model: str, max_tokens: int) -> dict[str, Any]:
        return to_openai(self.anthropic(model, max_tokens))


@dataclass(frozen=True, slots=True)
class AgentTrace:
    seed: int
    calls: tuple[AgentCall, ...]

    def to_json(self) -> str:
        data = [{"session": c.session, "index": c.index, "body": c.body} for c in self.calls]
        return json.dumps({"seed": self.seed, "calls": data}, sort_keys=True)


def agent_trace(
    seed: int = 0,
    calls_per_session: tuple[int, ...] = (12, 8),
    system_chars: int = 9000,
    tool_detail_chars: int = 300,
    result_chars: int = 3000,
    compact_tools: bool = False,
) -> AgentTrace:
    """One project, len(calls_per_session) sessions; a call per user message sent."""
    rng = random.Random(f"agent/{seed}")
    details = [corpus.prose(rng, tool_detail_chars) if tool_detail_chars else "" for _ in range(24)]
    tools = tool_definitions(details, compact_tools)
    main = (
        "You are a coding agent working in a terminal on the user's project. Use the tools to "
        "read, search, edit and test code; answer briefly.\n\n"
        + corpus.sized_document(rng, system_chars)
        + "\n\n<env>\nWorking directory: /Users/dev/src/mlx-prompt-cache\nIs a git repository: "
        "true\nPlatform: darwin\nOS Version: Darwin 25.1.0\n</env>"
    )
    version = f"2.1.{rng.randint(10, 40)}.{rng.getrandbits(12):03x}"
    calls: list[AgentCall] = []
    for s, n_calls in enumerate(calls_per_session):
        srng = random.Random(f"agent/{seed}/session/{s}")
        header = (
            f"x-anthropic-billing-header: cc_version={version}; cc_entrypoint=cli; "
            f"cch={srng.getrandbits(20):05x};"
        )
        system = [
            {"type": "text", "text": header},
            {"type": "text", "text": main, "cache_control": {"type": "ephemeral"}},
        ]
        user_id = f"user_{hashlib.sha256(str(seed).encode()).hexdigest()[:32]}_session_{s}"
        messages: list[dict[str, Any]] = []
        index = 0
        for msg in _session_messages(srng, s, n_calls, result_chars):
            messages.append(msg)
            if msg["role"] != "user":
                continue
            snapshot = copy.deepcopy(messages)
            last = snapshot[-1]["content"]
            last[-1]["cache_control"] = {"type": "ephemeral"}
            body = {
                "system": system,
                "messages": snapshot,
                "tools": tools,
                "metadata": {"user_id": user_id},
                "temperature": 0.0,
            }
            calls.append(AgentCall(s, index, body))
            index += 1
    return AgentTrace(seed, tuple(calls))


def _session_messages(rng: random.Random, session: int, n_calls: int, result_chars: int):
    """Yield messages: user, then rounds of assistant tool use and user tool results."""
    notes = corpus.prose(rng, 1200)
    task = _TASKS[session % len(_TASKS)]
    yield {
        "role": "user",
        "content": [
            {
                "type": "text",
                "text": f"<system-reminder>\nProject notes:\n{notes}\n</system-reminder>",
            },
            {"type": "text", "text": task},
        ],
    }
    sent = 1
    while sent < n_calls:
        # A task takes a few tool rounds, then a short answer and the user's next request.
        if sent % 5 == 4:
            yield {
                "role": "assistant",
                "content": [{"type": "text", "text": corpus.prose(rng, 500)}],
            }
            yield {
                "role": "user",
                "content": [{"type": "text", "text": rng.choice(corpus.FOLLOW_UPS)}],
            }
        else:
            uses, results = _tool_round(rng, task, result_chars)
            yield {"role": "assistant", "content": uses}
            yield {"role": "user", "content": results}
        sent += 1


def _tool_round(rng: random.Random, task: str, result_chars: int):
    thinking = f"The task: {task[:80]}... " + corpus.prose(rng, rng.randint(200, 600))
    signature = base64.b64encode(hashlib.sha512(thinking.encode()).digest()).decode()
    content: list[dict[str, Any]] = [
        {"type": "thinking", "thinking": thinking, "signature": signature}
    ]
    results: list[dict[str, Any]] = []
    for _ in range(rng.choice((1, 1, 1, 2))):
        name = rng.choice(_WORK)
        tool_input, output = _tool_call(rng, name, result_chars)
        tid = "toolu_01" + "".join(rng.choices(string.ascii_letters + string.digits, k=22))
        content.append({"type": "tool_use", "id": tid, "name": name, "input": tool_input})
        results.append({"type": "tool_result", "tool_use_id": tid, "content": output})
    return content, results


def _tool_call(rng: random.Random, name: str, chars: int) -> tuple[dict[str, Any], str]:
    files = corpus.source_files()
    root = "/Users/dev/src/mlx-prompt-cache/"
    if name == "read_file":
        path, text = corpus.excerpt(rng, rng.randint(chars // 3, chars))
        return {"path": root + path}, corpus.numbered(text)
    if name == "grep":
        word = rng.choice([w for w in corpus.GUIDE.split() if w.isalpha() and len(w) > 6])
        hits = [
            f"{f.path}:{n + 1}:{line.strip()}"
            for f in files
            for n, line in enumerate(f.text.splitlines())
            if word in line
        ]
        return {"pattern": word, "path": root}, "\n".join(hits)[:chars] or "No matches found."
    if name == "glob":
        return {"pattern": "**/*.py"}, "\n".join(root + f.path for f in files)[:chars]
    if name == "list_dir":
        dirs = sorted({f.path.rsplit("/", 1)[0] for f in files if "/" in f.path})
        d = rng.choice(dirs)
        entries = [f"- {f.path.rsplit('/', 1)[1]}" for f in files if f.path.startswith(d + "/")]
        return {"path": root + d}, f"- {root}{d}/\n" + "\n".join(entries)
    if name == "run_tests":
        tests = [f.path for f in files if f.path.rsplit("/", 1)[-1].startswith("test_")]
        picked = rng.sample(tests, min(3, len(tests)))
        lines = [f"{t} {'.' * rng.randint(3, 30)}" for t in picked]
        return {"targets": picked}, "\n".join(
            lines
        ) + f"\n{rng.randint(10, 80)} passed in {rng.uniform(1, 40):.2f}s"
    if name == "run_shell":
        picked = rng.sample(files, 4)
        counts = "\n".join(f"{len(f.text.splitlines()):>6} {f.path}" for f in picked)
        return {"command": "wc -l " + " ".join(f.path for f in picked)}, counts
    if name in ("git_diff", "edit_file"):
        path, text = corpus.excerpt(rng, rng.randint(300, 900))
        lines = text.splitlines() or [""]
        k = rng.randrange(len(lines))
        new = lines[k] + "  # checked"
        if name == "edit_file":
            return {
                "path": root + path,
                "old_text": lines[k],
                "new_text": new,
            }, f"Edited {root}{path}: 1 replacement."
        diff = [f"--- a/{path}", f"+++ b/{path}", f"@@ -1,{len(lines)} +1,{len(lines)} @@"]
        diff += [(" " + ln) if i != k else f"-{ln}\n+{new}" for i, ln in enumerate(lines)]
        return {"path": path}, "\n".join(diff)
    if name == "todo_write":
        todos = [
            {"content": corpus.prose(rng, 60)[:80], "status": s, "id": str(i + 1)}
            for i, s in enumerate(("completed", "in_progress", "pending"))
        ]
        return {"todos": todos}, "Todos have been updated."
    if name == "search_symbols":
        f = rng.choice(files)
        defs = [ln for ln in f.text.splitlines() if ln.startswith(("def ", "class "))] or [
            "def main"
        ]
        sym = defs[0].split()[1].split("(")[0].rstrip(":")
        return {"name": sym, "kind": "both"}, f"{f.path}: {defs[0]}\n" + "\n".join(
            f"{g.path}: uses {sym}" for g in files if sym in g.text and g is not f
        )[:chars]
    assert name == "lint", name
    return {"paths": ["proxy", "engine_bridge"]}, "All checks passed!"


def to_openai(body: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic Messages request as an OpenAI chat request that renders the same prompt."""
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if isinstance(system, str):
        messages.append({"role": "system", "content": system})
    elif system:
        # Text parts, not one joined string: each server joins them as it joins its own.
        messages.append(
            {"role": "system", "content": [{"type": "text", "text": b["text"]} for b in system]}
        )
    for m in body["messages"]:
        content = m["content"]
        if isinstance(content, str):
            messages.append({"role": m["role"], "content": content})
        elif m["role"] == "assistant":
            messages.append(_openai_assistant(content))
        else:
            texts = []
            for b in content:
                if b["type"] == "tool_result":
                    out = b.get("content", "")
                    if isinstance(out, list):
                        out = "".join(x["text"] for x in out if x["type"] == "text")
                    if b.get("is_error"):
                        out = "Error: " + out
                    messages.append(
                        {"role": "tool", "tool_call_id": b["tool_use_id"], "content": out}
                    )
                elif b["type"] == "text":
                    texts.append({"type": "text", "text": b["text"]})
            if texts:
                messages.append({"role": "user", "content": texts})
    out: dict[str, Any] = {"model": body["model"], "messages": messages}
    if body.get("tools"):
        out["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t["name"],
                    "description": t.get("description", ""),
                    "parameters": t["input_schema"],
                },
            }
            for t in body["tools"]
        ]
    for key in ("max_tokens", "temperature"):
        if key in body:
            out[key] = body[key]
    return out


def _openai_assistant(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    text = "".join(b["text"] for b in blocks if b["type"] == "text")
    thinking = [b["thinking"] for b in blocks if b["type"] == "thinking"]
    calls = [
        {
            "id": b["id"],
            "type": "function",
            "function": {"name": b["name"], "arguments": json.dumps(b["input"])},
        }
        for b in blocks
        if b["type"] == "tool_use"
    ]
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    if thinking:
        # Not OpenAI's field, but the one chat templates read (mlx-lm passes it through).
        msg["reasoning_content"] = "\n".join(thinking)
    if calls:
        msg["tool_calls"] = calls
    return msg
