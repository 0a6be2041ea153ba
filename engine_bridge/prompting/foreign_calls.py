"""Tool calls written in another family's markup, read by that family's mlx-lm parser.

A model sometimes writes a call the way another family does: Hermes JSON inside the
`<tool_call>` of Qwen3.6's template (whose parser wants `<function=...>`), or MiniMax's
`<minimax:tool_call>` under a Hermes template. Where its own parser finds no call, the
parsers below get a try, in order. What one reads counts only if every call names one of
the request's tools and has a JSON object for arguments, so prose that mentions a tag, or
shows one around text that is not a call, stays text.
"""

from __future__ import annotations

import importlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

# The families whose markup turns up under other templates, most common first. Not GLM 4.7:
# its parser takes any text between `<tool_call>` tags for a call named by its first word,
# so a sentence would become a call. Not Mistral: its calls run to the end of the output
# (no end marker), so a region could not close before the answer does.
CANDIDATES = ("json_tools", "qwen3_coder", "minimax_m2", "gemma4", "kimi_k2", "pythonic")

# The state a foreign region is read in, next to mlx-lm's "normal", "reasoning" and "tool".
STATE_PREFIX = "foreign:"


@dataclass(frozen=True, slots=True)
class Reader:
    """One family's parser and the markers around its calls."""

    family: str
    start: str
    end: str
    parse: Callable[[str, Any], Any]


def _reader(family: str) -> Reader:
    module = importlib.import_module(f"mlx_lm.tool_parsers.{family}")
    return Reader(family, module.tool_call_start, module.tool_call_end, module.parse_tool_call)


READERS = tuple(_reader(family) for family in CANDIDATES)


def regions(taken: tuple[str | None, ...]) -> dict[str, tuple[str, str]]:
    """The other families' call regions a model's answer text is watched for, by state:
    (start, end) markers, leaving out any start among the model's own markers (`taken`)."""
    out: dict[str, tuple[str, str]] = {}
    for r in READERS:
        if r.start not in taken and r.end:
            out.setdefault(STATE_PREFIX + r.start, (r.start, r.end))
    return out


@dataclass(frozen=True, slots=True)
class Read:
    family: str
    # {"name": ..., "arguments": {...}} (and the "id" a family writes), each call checked.
    calls: list[dict[str, Any]]


def read(
    body: str, markers: tuple[str, str], own: Callable | None, tools: list[dict[str, Any]]
) -> Read | None:
    """The calls the first other family with these markers reads in `body`, if every one
    names a tool of `tools` and has an object for arguments; `own` (the model's parser)
    is not tried again."""
    names = tool_names(tools)
    for r in READERS:
        if (r.start, r.end) != markers or r.parse is own:
            continue
        try:
            parsed = r.parse(body, tools)
        except Exception as e:  # each family's parser raises its own errors on other text
            log.debug("foreign tool parser %s: %s: %s", r.family, type(e).__name__, e)
            continue
        items = parsed if isinstance(parsed, list) else [parsed]
        calls = [_checked(item, names) for item in items]
        if calls and None not in calls:
            return Read(r.family, calls)
    return None


_warned: set[str] = set()


def warn_once(model: str, own: str | None, family: str) -> None:
    """One warning per model: its calls come in markup its own parser does not read."""
    if model in _warned:
        return
    _warned.add(model)
    log.warning(
        "model %s wrote a tool call its %s parser did not read; mlx-lm's %s parser read it "
        "(warned once per model)",
        model or "?",
        own,
        family,
    )


def tool_names(tools: list[dict[str, Any]]) -> set[str]:
    fns = (t.get("function") for t in tools if isinstance(t, dict))
    return {fn["name"] for fn in fns if isinstance(fn, dict) and isinstance(fn.get("name"), str)}


def _checked(item: Any, names: set[str]) -> dict[str, Any] | None:
    if not isinstance(item, dict) or item.get("name") not in names:
        return None
    args = item.get("arguments")
    if isinstance(args, str):  # Hermes models sometimes write the object as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {**item, "arguments": args}
