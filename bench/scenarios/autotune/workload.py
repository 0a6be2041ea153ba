"""The autotune scenario's traces: projects whose prompts together outgrow the RAM budget.

A project is a long system prompt and a few tools, shared by its sessions; a session is a
chat that grows by a question and a scripted reply per turn. Three traces, all built from
`corpus` and byte-identical for a seed and checkout:

- `interleaved`: every project's sessions take turns round-robin, so a project's shared
  prefix comes back only after every other project's requests;
- `burst`: the same, with a burst of one-off prompts (long, distinct, never sent again)
  halfway, after which the projects go on: their shared prefixes must outlive it;
- `shift`: the first half of the projects, then the second half: the working set moves.

`blocks` cuts a request into the chained chunks a cache would store (characters standing
in for tokens), so a trace's working set, and what its requests share, can be counted
without a tokenizer or a server.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from typing import Any

from ... import corpus, traces
from ...agent_tools import tool_definitions

INTERLEAVED, BURST, SHIFT = "interleaved", "burst", "shift"
NAMES = (INTERLEAVED, BURST, SHIFT)
PROJECT, ONE_OFF = "project", "one-off"
BLOCK_TOKENS = 64


@dataclass(frozen=True, slots=True)
class Sizes:
    """How big a trace is: `projects` projects of `sessions` sessions of `turns` turns
    (shift: half the projects before the shift, half after), and the burst's prompts."""

    projects: int
    sessions: int
    turns: int
    system_chars: int
    tools: int  # per project, compact schemas
    user_chars: tuple[int, int]  # a question's length, from..to
    reply_chars: tuple[int, int]
    one_offs: int
    one_off_chars: int

    @classmethod
    def of(cls, quick: bool) -> Sizes:
        if quick:  # prefills that fit a 2-core CPU: 30-50 requests a run, 40-70k tokens
            return cls(4, 3, 4, 1500, 3, (100, 250), (100, 200), 7, 3000)
        return cls(6, 4, 6, 6000, 8, (200, 1000), (200, 800), 14, 8000)


@dataclass(frozen=True, slots=True)
class Call:
    """One request: an OpenAI chat body (messages, and a project's tools) and whose it is."""

    kind: str  # PROJECT or ONE_OFF
    project: int | None  # None for a one-off prompt
    session: int | None  # across the trace: project * sessions + its session
    turn: int
    body: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Trace:
    name: str
    calls: tuple[Call, ...]
    # The first call after the burst (burst) or of the second set of projects (shift);
    # None for interleaved.
    pivot: int | None = None

    def projects(self, calls: tuple[Call, ...] | None = None) -> set[int]:
        """The projects `calls` (default: all of them) belong to."""
        picked = self.calls if calls is None else calls
        return {c.project for c in picked if c.project is not None}

    def one_offs(self) -> list[int]:
        """The indices of the burst's calls."""
        return [i for i, c in enumerate(self.calls) if c.kind == ONE_OFF]


@dataclass(frozen=True, slots=True)
class Project:
    system: str
    tools: list[dict[str, Any]]  # OpenAI function tools
    sessions: tuple[traces.ChatTrace, ...]  # each session's questions and replies


def build(name: str, seed: int, sizes: Sizes) -> Trace:
    """Trace `name` (one of NAMES) for `seed`: the same seed gives the same requests."""
    assert name in NAMES, name
    projects = [_project(seed, p, sizes) for p in range(sizes.projects)]
    half = sizes.projects // 2
    first, second = range(half), range(half, sizes.projects)
    if name == SHIFT:
        # Half the projects, then the other half: what was hot goes cold at once.
        before = _rounds(projects, first, range(sizes.turns), sizes.sessions)
        after = _rounds(projects, second, range(sizes.turns), sizes.sessions)
        return Trace(name, (*before, *after), len(before))
    if name == INTERLEAVED:
        every = range(sizes.projects)
        return Trace(name, _rounds(projects, every, range(sizes.turns), sizes.sessions))
    # Half the projects, which fit the budget: the burst alone is what outgrows it.
    middle = sizes.turns // 2
    before = _rounds(projects, first, range(middle), sizes.sessions)
    burst = _one_offs(seed, sizes)
    after = _rounds(projects, first, range(middle, sizes.turns), sizes.sessions)
    return Trace(name, (*before, *burst, *after), len(before) + len(burst))


def _rounds(projects: list[Project], which: range, turns: range, sessions: int) -> tuple[Call, ...]:
    """Turn by turn, each project's j-th session before any project's (j+1)-th: a project's
    prefix comes back only after every other project's request."""
    calls = []
    for t in turns:
        for j in range(sessions):
            for p in which:
                chat = projects[p].sessions[j]
                body = {"messages": chat.messages(t), "tools": projects[p].tools}
                calls.append(Call(PROJECT, p, p * sessions + j, t, body))
    return tuple(calls)


def _project(seed: int, p: int, sizes: Sizes) -> Project:
    rng = random.Random(f"autotune/{seed}/project/{p}")
    system = (
        f"You are the coding assistant of project {p + 1} ({_codename(rng)}). Answer from "
        "the reference below, which is this project's documentation and code.\n\n"
        + _document(rng, sizes.system_chars)
    )
    picked = rng.sample(tool_definitions([], compact=True), sizes.tools)
    tools = traces.to_openai({"model": "", "messages": [], "tools": picked})["tools"]
    chats = []
    for _ in range(sizes.sessions):
        users = tuple(_question(rng, rng.randint(*sizes.user_chars)) for _ in range(sizes.turns))
        replies = tuple(corpus.prose(rng, rng.randint(*sizes.reply_chars))
                        for _ in range(sizes.turns))  # fmt: skip
        chats.append(traces.ChatTrace(system, users, replies))
    return Project(system, tools, tuple(chats))


def _one_offs(seed: int, sizes: Sizes) -> tuple[Call, ...]:
    """Long prompts sent once each: a numbered request first, so no two share a block."""
    rng = random.Random(f"autotune/{seed}/one-offs")
    calls = []
    for i in range(sizes.one_offs):
        text = (
            f"One-off request {i + 1} ({rng.getrandbits(64):016x}): summarize the document "
            "below in three sentences.\n\n" + _document(rng, sizes.one_off_chars)
        )
        calls.append(
            Call(ONE_OFF, None, None, 0, {"messages": [{"role": "user", "content": text}]})
        )
    return tuple(calls)


def _codename(rng: random.Random) -> str:
    words = [w for w in corpus.GUIDE.split() if w.isalpha() and len(w) > 5]
    return "-".join(rng.sample(words, 2)).lower()


def _document(rng: random.Random, chars: int) -> str:
    """Excerpts of this repository's sources to `chars`, each under its path."""
    parts: list[str] = []
    size = 0
    while size < chars:
        path, text = corpus.excerpt(rng, min(2000, chars - size + 100))
        parts.append(f"# {path}\n\n{text}")
        size += len(parts[-1]) + 2
    return "\n\n".join(parts)[:chars]


def _question(rng: random.Random, chars: int) -> str:
    path, code = corpus.excerpt(rng, chars)
    return f"{rng.choice(corpus.QUESTIONS).format(path=path)}\n\n```python\n{code}\n```"


# ---- blocks: what a cache would store --------------------------------------------------


def text(body: dict[str, Any]) -> str:
    """The request as one string in a chat template's order: the system, the tools, then
    every message (close enough to the rendered prompt to count its blocks)."""
    messages = body["messages"]
    system = [m for m in messages[:1] if m["role"] == "system"]
    head = [f"system\n{m['content']}" for m in system]
    head += [f"tool\n{json.dumps(t['function'])}" for t in body.get("tools") or []]
    rest = [f"{m['role']}\n{m['content']}" for m in messages[len(system) :]]
    return "\n".join(head + rest)


def blocks(body: dict[str, Any], chars_per_token: float) -> list[bytes]:
    """The chained hashes of the request's whole blocks (BLOCK_TOKENS tokens, counted in
    characters): equal prefixes give equal hashes, as the cache's chain does."""
    chunk = max(1, round(BLOCK_TOKENS * chars_per_token))
    whole = text(body)
    out, parent = [], b""
    for start in range(0, len(whole) - chunk + 1, chunk):
        parent = hashlib.sha256(parent + whole[start : start + chunk].encode()).digest()
        out.append(parent)
    return out


def working_set(calls: tuple[Call, ...], chars_per_token: float) -> int:
    """Distinct blocks over `calls`: what a cache must hold to miss nothing but first sights."""
    return len({b for c in calls for b in blocks(c.body, chars_per_token)})
