"""How a model's template wants a turn's reasoning sent back to render what the model wrote.

mlx-lm's reasoning markers do not always hold the layout around them: Gemma 4's
`think_start` is `<|channel>thought` and the model writes a newline after it, which the
template writes again before the reasoning; MiniMax M2's template writes a newline before
`</think>` and does not trim the one the model wrote. Sent back as the client read it, such
a turn renders one newline off and the next tool step leaves the cache there. The first
turn that shows edge newlines tells, by rendering it each way, which way reproduces the
tokens the model generated; every later turn of that model is sent to the template so.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from ..types import Message
from .render import NormalizationRule, render_plain

log = logging.getLogger(__name__)

# The ways tried, in order: as the client read it first (most templates trim themselves).
EDGES = ("as_sent", "strip", "lstrip", "rstrip")


def apply(edge: str, reasoning: str) -> str:
    if edge == "as_sent":
        return reasoning
    return getattr(reasoning, edge)("\n")


def has_edges(reasoning: str | None) -> bool:
    return bool(reasoning) and reasoning != reasoning.strip("\n")


def learn(
    tokenizer: Any,
    messages: Sequence[Message],
    reply: Message,
    written: Sequence[int],
    tools: list[dict[str, Any]] | None,
    template_kwargs: dict[str, Any] | None,
    rules: Sequence[NormalizationRule] = (),
) -> str | None:
    """The first edge whose render of `messages` plus `reply` starts with `written` (the
    prompt plus what the model generated, its stop token left out); None if none does."""
    assert reply.reasoning is not None, "a reply without reasoning has no layout to learn"
    tried: set[str] = set()
    for edge in EDGES:
        reasoning = apply(edge, reply.reasoning)
        if reasoning in tried:
            continue
        tried.add(reasoning)
        chat = [*messages, replace(reply, reasoning=reasoning)]
        tokens = render_plain(tokenizer, chat, tools, template_kwargs, rules).tokens
        if tokens[: len(written)] == list(written):
            return edge
    return None


def send_back(edge: str, messages: Sequence[Message]) -> list[Message]:
    """`messages` with each assistant turn's reasoning laid out as `edge` says."""
    if edge == "as_sent":
        return list(messages)
    return [
        replace(m, reasoning=apply(edge, m.reasoning))
        if m.role == "assistant" and has_edges(m.reasoning)
        else m
        for m in messages
    ]
