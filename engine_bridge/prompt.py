"""Request → token ids, plus where each message starts in tokens, plus client-noise rules.

Message starts matter to the cache: snapshot models (SSM, sliding window) can only resume
where a checkpoint was taken, and the start of a message is where the next turn of the
same conversation is most likely to diverge from the last one.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .types import EngineError, Message


@dataclass(frozen=True, slots=True)
class NormalizationRule:
    """A regex applied to message text before tokenization, to drop per-session noise."""

    name: str
    pattern: re.Pattern[str]
    replacement: str = ""
    roles: tuple[str, ...] = ("system",)


# Claude Code puts `x-anthropic-billing-header: cc_version=…; cc_entrypoint=…; …` first in
# the system prompt, with a suffix that differs per session. Left alone, every new session
# diverges from the cached 30k-token agent prompt at token ~15. The header is a system block
# of its own, and joined blocks put the real prompt on the same line, so the rule takes
# `key=value;` fields (the last may end the line instead), never the rest of the line.
CLAUDE_CODE_BILLING_HEADER = NormalizationRule(
    name="claude_code_billing_header",
    pattern=re.compile(
        r"^x-anthropic-billing-header:(?:[ \t]*[\w.-]+=[^;\n]*(?:;|$))*[ \t]*\n?", re.MULTILINE
    ),
    replacement="",
)


@dataclass(slots=True)
class RenderedPrompt:
    tokens: list[int]
    text: str
    # Token index where message i starts, for the messages whose start falls on a token
    # boundary of the full prompt (templates that rewrite history leave gaps).
    message_starts: list[int] = field(default_factory=list)
    # Which message each entry of message_starts belongs to.
    message_index: list[int] = field(default_factory=list)

    def message_at(self, token_index: int) -> int | None:
        """The index of the message that contains `token_index`, if known."""
        i = bisect.bisect_right(self.message_starts, token_index) - 1
        return self.message_index[i] if i >= 0 else None


def normalize_messages(
    messages: Sequence[Message], rules: Sequence[NormalizationRule]
) -> list[Message]:
    """Apply the rules to the contents of the roles they name."""
    out = []
    for message in messages:
        content = message.content
        for rule in rules:
            if message.role in rule.roles:
                content = rule.pattern.sub(rule.replacement, content)
        out.append(message if content == message.content else replace(message, content=content))
    return out


def render_chat(
    tokenizer: Any,
    messages: Sequence[Message],
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    rules: Sequence[NormalizationRule] = (),
) -> RenderedPrompt:
    """Render with the model's chat template and find each message's first token."""
    chat = [m.to_template() for m in normalize_messages(messages, rules)]
    kwargs = dict(template_kwargs or {})
    text = _apply_template(tokenizer, chat, tools, True, kwargs)
    tokens, ends = _encode_with_offsets(tokenizer, text)
    starts: list[int] = [0] if chat else []
    index: list[int] = [0] if chat else []
    for i in range(1, len(chat)):
        try:
            prefix = _apply_template(tokenizer, chat[:i], tools, False, kwargs)
        except EngineError:
            continue
        # Templates that rewrite earlier turns (e.g. drop old thinking) make the prefix
        # render differently from the same span of the full prompt: no boundary there.
        if not text.startswith(prefix):
            continue
        t = bisect.bisect_right(ends, len(prefix))
        if t > 0 and ends[t - 1] == len(prefix) and t > starts[-1]:
            starts.append(t)
            index.append(i)
    return RenderedPrompt(tokens, text, starts, index)


def render_completion(tokenizer: Any, prompt: str) -> RenderedPrompt:
    tokens = list(tokenizer.encode(prompt))
    return RenderedPrompt(tokens, prompt, [0], [0])


def _apply_template(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
    kwargs: dict[str, Any],
) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **kwargs,
        )
    except Exception as e:  # jinja raises TemplateError, TypeError, … on bad messages
        raise EngineError(
            f"the model's chat template rejected the messages: {e}", field="messages"
        ) from None


def _encode_with_offsets(tokenizer: Any, text: str) -> tuple[list[int], list[int]]:
    """Token ids and each token's end offset in characters."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    enc = hf(text, add_special_tokens=False, return_offsets_mapping=True)
    ends = [end for _, end in enc["offset_mapping"]]
    # Byte-level tokens inside one multi-byte char can report ends out of order.
    for i in range(1, len(ends)):
        if ends[i] < ends[i - 1]:
            ends[i] = ends[i - 1]
    return list(enc["input_ids"]), ends
