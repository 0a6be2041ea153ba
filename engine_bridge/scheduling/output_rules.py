"""Token rules over one sequence's output, applied to its logits before sampling.

They honour the clients' tool controls as far as a local model allows: `tool_choice: none`
bans the token that opens a call (the tools stay in the prompt, so the cache still hits),
`required` (or a named tool) opens the answer with the call marker and, where the family's
call header is known, the tool's name; one call only ends the turn after the first call.
The test-only forced output (`forced_output.py`) also runs through here: the whole path
from sampler to SSE then sees a real model's markup.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from ..prompting.output_format import OutputFormat
from ..types import ToolChoice

# What follows the call marker before the arguments, by parser family, so a named
# tool_choice can force the name too. Families not listed get the marker alone.
CALL_HEADERS = {
    "json_tools": '{"name": "%s", "arguments": ',
    "qwen3_coder": "\n<function=%s>\n",
    "mistral": "%s[ARGS]",
    "gemma4": "call:%s{",
    "glm47": "%s\n",
}


@dataclass(slots=True)
class OutputRule:
    """Forced and banned tokens for one sequence; `out` is its output so far (shared)."""

    eos: int
    out: list[int] = field(default_factory=list)
    # The whole output, forced token by token, then eos (the test hook).
    script: list[int] | None = None
    banned: tuple[int, ...] = ()
    # Forced once the answer begins: after `think_end`, when the prompt opened reasoning.
    opening: list[int] = field(default_factory=list)
    think_end: tuple[int, ...] = ()
    in_reasoning: bool = False
    # Force eos once the output ends with these (the end of the first call).
    stop_after: tuple[int, ...] = ()
    _queue: deque[int] = field(default_factory=deque)
    _opened: bool = False

    def next_forced(self) -> int | None:
        """The token this step must take, if any; updates the rule's own state."""
        out = self.out
        if self.script is not None:
            return self.script[len(out)] if len(out) < len(self.script) else self.eos
        if self._queue:
            return self._queue.popleft()
        if self.in_reasoning and self.think_end and _ends_with(out, self.think_end):
            self.in_reasoning = False
        if self.opening and not self._opened and not self.in_reasoning:
            self._opened = True
            self._queue.extend(self.opening)
            return self._queue.popleft()
        if self.stop_after and _ends_with(out, self.stop_after):
            return self.eos
        return None

    def apply(self, logits: mx.array) -> mx.array:
        """[1, V] logits with this step's rule applied."""
        forced = self.next_forced()
        if forced is not None:
            ids = mx.arange(logits.shape[-1])
            # `logits * 0`, not `zeros_like`: the token must still depend on the model's
            # pass, or a plain step evaluates nothing and its forward pass (and the cache
            # update in it) piles up lazily until something else forces it.
            return mx.where(ids == forced, logits * 0.0, -mx.inf)
        return self.without_banned(logits)

    def without_banned(self, logits: mx.array) -> mx.array:
        """[N, V] logits with the banned tokens at -inf (unchanged when none are)."""
        if not self.banned:
            return logits
        ids = mx.arange(logits.shape[-1])
        mask = mx.zeros(logits.shape[-1], dtype=mx.bool_)
        for t in self.banned:
            mask = mask | (ids == t)
        return mx.where(mask, -mx.inf, logits)


def _ends_with(out: Sequence[int], tail: Sequence[int]) -> bool:
    n = len(tail)
    return n > 0 and len(out) >= n and list(out[-n:]) == list(tail)


def output_rule(
    tokenizer: Any,
    fmt: OutputFormat,
    choice: ToolChoice,
    *,
    has_tools: bool,
    opens_in_reasoning: bool,
    forced_text: str | None = None,
) -> OutputRule | None:
    """The rule a request needs, or None when it needs none (the sampler's fast path)."""
    eos = _eos(tokenizer)
    if forced_text is not None:
        return OutputRule(eos, script=_encode(tokenizer, forced_text))
    start = fmt.tool_call_start
    if not has_tools or not start:
        return None
    start_ids = _encode(tokenizer, start)
    rule = OutputRule(eos)
    if choice.mode == "none":
        if len(start_ids) != 1:
            return None  # the engine renders without tools instead (call_marker_is_token)
        rule.banned = (start_ids[0],)
    elif choice.mode == "required":
        header = CALL_HEADERS.get(fmt.family or "")
        rule.opening = start_ids + (
            _encode(tokenizer, header % choice.name) if choice.name and header else []
        )
        rule.in_reasoning = opens_in_reasoning
        if opens_in_reasoning and fmt.think_end:
            rule.think_end = tuple(_encode(tokenizer, fmt.think_end))
    if not choice.parallel and fmt.tool_call_end:
        rule.stop_after = tuple(_encode(tokenizer, fmt.tool_call_end))
    if not (rule.banned or rule.opening or rule.stop_after):
        return None
    return rule


def call_marker_is_token(tokenizer: Any, fmt: OutputFormat) -> bool:
    """Whether the call marker is one token, so `tool_choice: none` can ban it."""
    return bool(fmt.tool_call_start) and len(_encode(tokenizer, fmt.tool_call_start)) == 1


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _eos(tokenizer: Any) -> int:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        eos = min(tokenizer.eos_token_ids)
    return int(eos)
