"""What turning a long conversation into token ids and message starts costs.

Run by the bench's overhead scenario (through `python -m engine_bridge.probes.shapes overhead`) on
a Claude-Code-shaped agent session: a user turn, a tool call, its result and an answer, 50
times over, plus a system prompt and one tool. It times, each as a median:

- one `apply_chat_template` call without tokenizing, and one with (its default: what a
  server that only needs token ids does);
- `render_chat` cold (the plain render, the tagged render that places message starts, and
  the tokenization with offsets);
- `render_chat` for the session's next turn with the model's prefix memo warm;
- the old way, for the record: one render per message prefix.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from ..prompting.prefix_memo import PrefixMemo
from ..prompting.render import render_chat
from ..types import Message, ToolCall
from .lookup import median_s

_TOOL = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file from the workspace.",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string", "description": "Relative path."}},
            "required": ["path"],
        },
    },
}


def agent_session(turns: int) -> list[Message]:
    out = [Message("system", "You are a careful coding agent. Use the tools. " * 20)]
    for t in range(turns):
        out += [
            Message("user", f"Fix bug {t} in the parser, please. " * 5),
            Message("assistant", "", tool_calls=(ToolCall("read_file", {"path": f"f{t}.py"}),)),
            Message("tool", f"def parse_{t}(x):\n    return x\n" * 20, tool_call_id=f"c{t}"),
            Message("assistant", f"Fixed bug {t}: the parser now returns early. " * 3),
        ]
    return out


def render_costs(tokenizer: Any, turns: int = 50, repeats: int = 5) -> dict[str, float]:
    messages = agent_session(turns)
    chat = [m.to_template() for m in messages]
    tools = [_TOOL]

    def template(tokenize: bool) -> Any:
        return tokenizer.apply_chat_template(
            chat, tools=tools, add_generation_prompt=True, tokenize=tokenize
        )

    def next_turn() -> None:
        # The previous turn's request warmed the memo; this one adds the last four messages.
        memo = PrefixMemo()
        render_chat(tokenizer, messages[:-4], tools, memo=memo)
        start = time.perf_counter()
        render_chat(tokenizer, messages, tools, memo=memo)
        spent.append(time.perf_counter() - start)

    def per_prefix() -> None:
        for i in range(1, len(chat)):
            tokenizer.apply_chat_template(
                chat[:i], tools=tools, add_generation_prompt=False, tokenize=False
            )

    spent: list[float] = []
    for _ in range(repeats):
        next_turn()
    return {
        "messages": float(len(messages)),
        "template_s": median_s(lambda: template(False), repeats),
        "template_tokenized_s": median_s(lambda: template(True), repeats),
        "render_chat_cold_s": median_s(lambda: render_chat(tokenizer, messages, tools), repeats),
        "render_chat_next_turn_s": statistics.median(spent),
        "per_prefix_renders_s": median_s(per_prefix, 1) + median_s(lambda: template(True), 1),
    }
