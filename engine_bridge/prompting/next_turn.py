"""What a finished turn leaves for the next request: the assistant message a client sends
back, and the prompt prefix the next user question will have.

Templates that drop earlier reasoning (Qwen3.5, MiniMax M2, gpt-oss, Gemma 4, GLM-4.7 by
default) render the whole last task differently once a new question comes, so that
question leaves the cached sequence at the task's first assistant turn. Rendering the
conversation as the next question will see it, up to where that question's message
starts, gives a prefix that can be prefilled while the person reads the answer.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..types import Message, ToolCall
from .output_format import OutputFormat
from .prefix_memo import PrefixMemo
from .render import NormalizationRule, RenderedPrompt, render_chat, render_plain

# The next question's text is unknown; any question renders the history before it alike
# (tool results are not questions: a placeholder must not look like one). Two that differ
# from their first character in kind, so no token of the header merges into either.
PLACEHOLDERS = ("What next?", "1) and then")


@dataclass(frozen=True, slots=True)
class Reply:
    """A generated turn as the model's own format reads it."""

    reasoning: str
    content: str
    calls: tuple[ToolCall, ...]

    def message(self) -> Message:
        """The assistant turn as a client sends it back (reasoning included)."""
        return Message(
            "assistant",
            self.content,
            reasoning=self.reasoning or None,
            tool_calls=self.calls or None,
        )


def read_reply(
    fmt: OutputFormat,
    text: str,
    prompt_text: str,
    tools: list[dict[str, Any]] | None,
    finish_reason: str,
    parallel: bool = True,
) -> Reply:
    """Split a finished generation's text as the dialects do (reasoning, text, calls)."""
    parser = fmt.parser(prompt_text=prompt_text, tools=tools, parallel=parallel)
    parts = parser.feed(text) + parser.finish(finish_reason)
    reasoning = "".join(p.text for p in parts if p.kind == "reasoning")
    content = "".join(p.text for p in parts if p.kind == "text")
    calls = tuple(p.call for p in parts if p.kind == "tool_call" and p.call is not None)
    return Reply(reasoning, content, calls)


def next_question_prefix(
    tokenizer: Any,
    messages: Sequence[Message],
    reply: Message,
    tools: list[dict[str, Any]] | None,
    template_kwargs: dict[str, Any] | None,
    rules: Sequence[NormalizationRule] = (),
    memo: PrefixMemo | None = None,
) -> RenderedPrompt | None:
    """The tokens every next question's prompt starts with (its message header included),
    plus one token of the question; None when the template leaves no such prefix.

    The question's message has no start of its own in a rewriting template (the history
    before it renders differently without it), so two questions are rendered and the
    tokens they share are the prefix. The extra token is the one prefill leaves for the
    model to read: a warm-up of this prompt stores its state where the two part.
    """
    history = [*messages, reply]
    first = render_chat(
        tokenizer, [*history, Message("user", PLACEHOLDERS[0])], tools, template_kwargs, rules, memo
    )
    # Only its tokens and text are compared: no message starts to place.
    other = render_plain(
        tokenizer, [*history, Message("user", PLACEHOLDERS[1])], tools, template_kwargs, rules
    )
    shared = len(os.path.commonprefix([first.tokens, other.tokens]))
    # Tokens past the texts' common part depend on the question's first characters.
    text_shared = len(os.path.commonprefix([first.text, other.text]))
    while shared and len(tokenizer.decode(first.tokens[:shared])) > text_shared:
        shared -= 1
    if shared == 0 or shared + 1 > len(first.tokens):
        return None
    keep = [i for i, s in enumerate(first.message_starts) if s <= shared]
    tokens = first.tokens[: shared + 1]
    return RenderedPrompt(
        tokens,
        tokenizer.decode(tokens),
        [first.message_starts[i] for i in keep],
        [first.message_index[i] for i in keep],
        tool_starts=first.tool_starts,
    )
