"""Text the benchmark's traces are made of: this project's own files and prose written here.

Nothing here is a captured prompt of another product. Excerpts come from the repository the
benchmark runs in, so a trace is deterministic for a given checkout and seed.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The benchmark's own code is left out so that editing it does not change its traces.
_SOURCE_GLOBS = ("proxy/**/*.py", "engine_bridge/**/*.py", "tests/**/*.py")
_EXCLUDE = ("tests/ops/test_bench.py", "engine_bridge/probes/shapes.py")

# Working notes for an assistant on this project, in the voice of a design document.
GUIDE = """\
You are working on mlx-prompt-cache, a proxy that serves MLX models in-process and keeps a \
tiered prompt cache so that a long conversation pays only for its new tokens.

How the code is laid out. The proxy/ package speaks HTTP: the OpenAI and Anthropic dialects, \
server-sent events, the passthrough to LM Studio, configuration and the command line. It never \
touches arrays. The engine_bridge/ package is the only code that imports mlx or mlx_lm: it \
finds and loads models, renders prompts into token ids, runs one request at a time and moves \
cache state between mlx-lm's cache objects and the blocks the cache stores. The state layer \
in engine_bridge/cache knows nothing about HTTP, chat templates or dialects.

How the cache works. Token sequences are cut into blocks of 64 tokens. Each block's hash \
chains its parent's hash, its token ids and, for the first block, tagged extra keys such as \
the model fingerprint and the tenant. Equal prefixes therefore give equal chains, and one \
physical copy of a block serves every session that shares it. Attention layers are sliced per \
block and can be restored at any prefix length. Recurrent and sliding-window layers are only \
valid where a snapshot was taken, so the runner stores checkpoints at message starts, at the \
end of the prompt and at the end of generation. A hit is the deepest position covered by \
blocks and, when the model needs one, by a checkpoint at exactly that position.

What to keep true. Greedy output with the cache must equal greedy output without it, for \
every cache type. A client's mistake gets a 4xx in its own dialect that names the field at \
fault, never a 500, and never costs cached data. An I/O fault in the SSD tier degrades to a \
miss and is counted. Invariants are asserts that print the offending values.

How to work. Read the module you are about to change and the tests that cover it before \
editing. Keep modules small and named for the one thing they do; when a file passes five \
hundred lines it is two things. Put types at the boundaries: small dataclasses for requests, \
hits and statistics instead of dictionaries of dictionaries. Comments say why, not what. \
Run the focused tests first, then the whole suite with ./scripts/test. Use ruff for lint and \
format. Commit in small, honest steps, each with a message that says what changed and why.

How to answer. Be brief and concrete. Quote the file and line you mean. When a question has \
a measurable answer, measure it instead of guessing, and report the number with its unit \
and the command that produced it. When you are unsure, say what you would check next. Never \
invent an API: if a function is not in the code, say so.

How to use tools. Prefer reading a file over guessing its contents, and searching over \
reading whole directories. Run shell commands that change nothing unless the task asks for \
a change. Before editing, state the plan in one or two sentences. After editing, run the \
tests that cover the change and show their result. Do not run servers on the default port; \
pick a free one. Never delete a cache directory you did not create.
"""

QUESTIONS = (
    "Can you explain what this code in {path} does, and why it is written this way?",
    "I think there is a bug in {path}. Here is the part I mean. What would break if the "
    "input were empty?",
    "How would you test this function from {path}? Sketch the test names first.",
    "Please review this excerpt of {path} for anything that could block the event loop.",
    "Rewrite this part of {path} so it is easier to read, without changing behaviour.",
    "What happens here when two requests share the same prefix? The code is in {path}.",
)
FOLLOW_UPS = (
    "Thanks. And what if the model is a hybrid one, with recurrent layers?",
    "Could you make that shorter?",
    "Does that still hold after a restart, when the blocks come back from the SSD?",
    "Which test would fail first if I got this wrong?",
    "OK. How much memory would that take for a 32k-token prompt?",
)


@dataclass(frozen=True, slots=True)
class SourceFile:
    path: str  # relative to the repository root
    text: str


@lru_cache(maxsize=1)
def source_files() -> tuple[SourceFile, ...]:
    """This checkout's Python sources, sorted by path so every run sees the same order."""
    found: dict[str, SourceFile] = {}
    for pattern in _SOURCE_GLOBS:
        for p in REPO.glob(pattern):
            rel = p.relative_to(REPO).as_posix()
            if any(rel.startswith(x) for x in _EXCLUDE) or rel in found:
                continue
            text = p.read_text(encoding="utf-8", errors="replace")
            if text.strip():
                found[rel] = SourceFile(rel, text)
    assert found, f"no source files under {REPO}"
    return tuple(found[k] for k in sorted(found))


@lru_cache(maxsize=1)
def readme() -> str:
    path = REPO / "README.md"
    return path.read_text(encoding="utf-8") if path.is_file() else GUIDE


def digest() -> str:
    """A short digest of every text a trace can draw from, recorded with the results."""
    h = hashlib.sha256(GUIDE.encode())
    h.update(readme().encode())
    for f in source_files():
        h.update(f.path.encode() + b"\0" + f.text.encode())
    return h.hexdigest()[:16]


def excerpt(rng: random.Random, chars: int, path: str | None = None) -> tuple[str, str]:
    """About `chars` characters of whole lines from one source file: (path, text)."""
    files = source_files()
    src = next((f for f in files if f.path == path), None) or rng.choice(files)
    lines = src.text.splitlines()
    start = rng.randrange(max(1, len(lines) - 20))
    out: list[str] = []
    size = 0
    for line in lines[start:]:
        if size >= chars:
            break
        out.append(line)
        size += len(line) + 1
    return src.path, "\n".join(out)


def numbered(text: str, first_line: int = 1) -> str:
    """Lines prefixed with their number, the way a file-reading tool shows them."""
    return "\n".join(f"{first_line + i:6d}\t{line}" for i, line in enumerate(text.splitlines()))


def prose(rng: random.Random, chars: int) -> str:
    """About `chars` characters of sentences drawn from the guide and the README."""
    sentences = [s.strip() + "." for s in (GUIDE + " " + readme()).split(". ") if len(s) > 40]
    out: list[str] = []
    size = 0
    while size < chars:
        s = rng.choice(sentences).replace("\n", " ")
        out.append(s)
        size += len(s) + 1
    return " ".join(out)


def sized_document(rng: random.Random, chars: int) -> str:
    """A long reference text: the guide, the README, then source excerpts, to `chars`."""
    parts = [GUIDE, "# Project README\n\n" + readme()]
    size = sum(len(p) for p in parts)
    while size < chars:
        path, text = excerpt(rng, min(3000, chars - size + 200))
        parts.append(f"# {path}\n\n```python\n{text}\n```")
        size += len(parts[-1])
    return "\n\n".join(parts)[:chars]
