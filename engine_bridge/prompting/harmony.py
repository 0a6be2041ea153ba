"""gpt-oss's harmony channels, which mlx-lm 0.32.2 has no parser for.

A harmony answer is a run of messages, `<|start|>ROLE<|channel|>HEADER<|message|>BODY`
ended by `<|end|>`, `<|call|>` or `<|return|>` (the last two are end-of-sequence tokens, so
the final body may end with the output). The header's first word is the channel:
`analysis` is reasoning, `final` the answer; a recipient `to=functions.NAME` in the role or
the header makes the body a call's JSON arguments. The generation prompt ends with
`<|start|>assistant`, so the output opens in the role.
"""

from __future__ import annotations

import re
from typing import Literal

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")

# State -> [(marker, next state)], in mlx-lm's TextStateMachine shape.
TRANSITIONS: dict[str, list[tuple[str, str]]] = {
    "normal": [(START, "role"), (CHANNEL, "header"), (MESSAGE, "body")],
    "role": [(CHANNEL, "header"), (MESSAGE, "body")],
    "header": [(MESSAGE, "body")],
    "body": [(end, "normal") for end in ENDS],
}

_RECIPIENT = re.compile(r"\bto=(?:functions\.)?([^\s<]+)")

BodyKind = Literal["text", "reasoning", "call"]


def is_harmony_vocab(vocab: dict[str, int]) -> bool:
    return all(t in vocab for t in (START, CHANNEL, MESSAGE, "<|call|>", "<|return|>"))


def initial_state(prompt_text: str) -> str:
    return "role" if prompt_text.rstrip().endswith(START + "assistant") else "normal"


class Channels:
    """Which kind of part the current message body is, from the header before it."""

    def __init__(self, tools: bool = True):
        self._tools = tools
        self._role = ""
        self._header = ""
        self._kind: BodyKind | None = None
        self._name = ""
        self._args = ""

    @property
    def in_call(self) -> bool:
        return self._kind == "call"

    @property
    def in_reasoning(self) -> bool:
        return self._kind == "reasoning"

    def feed(self, state: str, text: str) -> Literal["text", "reasoning"] | None:
        """The kind of part `text` (read in `state`) is, or None when it is not shown."""
        if state == "normal":
            return "text" if text.strip() else None
        if state == "role":
            self._role += text
            return None
        if state == "header":
            self._header += text
            return None
        if self._kind is None:
            self._kind = self._decide()
        if self._kind == "call":
            self._args += text
            return None
        return self._kind

    def close(self, state: str) -> None:
        if state == "body":
            self._kind = None

    def take_call(self) -> tuple[str, str]:
        name, args = self._name, self._args
        self._kind, self._name, self._args = None, "", ""
        return name, args

    def _decide(self) -> BodyKind:
        role, header = self._role, self._header
        self._role = self._header = ""
        if (m := _RECIPIENT.search(role + " " + header)) and self._tools:
            self._name = m.group(1)
            return "call"
        channel = header.strip().split(maxsplit=1)
        return "reasoning" if channel and channel[0] == "analysis" else "text"
