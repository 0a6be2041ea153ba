"""Responses API bodies → the neutral request: input items to Messages, tools, tool_choice.

Codex CLI re-sends its whole history as items each turn: messages, `function_call` and
`function_call_output` pairs, and `reasoning`. They become chat Messages in the shape the
chat templates know, so a turn renders exactly as the same conversation sent to
/v1/chat/completions would, and the prompt prefix (and its cache) stays the same.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from engine_bridge.types import ImageInput, Message, ToolCall, ToolChoice

from .. import fields as f
from ..errors import ApiError
from . import images
from .openai.chat import _parse_arguments

log = logging.getLogger("proxy.dialects.responses_items")

ROLES = ("user", "assistant", "system", "developer")
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
# Separator of a namespace and a nested function's name, used only when that name is
# already taken (OpenAI function names allow [a-zA-Z0-9_-], so no dot).
NAMESPACE_SEP = "__"

Where = Callable[[int], str]


@dataclass(slots=True)
class ToolSet:
    """The function tools in the chat-template shape, and how their names map back.

    Namespace tools (`{"type": "namespace", "name": ns, "tools": [...]}`) are flattened:
    each nested function keeps its own name, unless a function before it has that name;
    then it is `ns__name`. `origin` maps a flat name to (namespace, name) for the calls the
    model makes; `flat` is the inverse, for calls in the history.
    """

    template: list[dict[str, Any]] = field(default_factory=list)
    origin: dict[str, tuple[str | None, str]] = field(default_factory=dict)
    flat: dict[tuple[str | None, str], str] = field(default_factory=dict)

    def add(self, tool: dict[str, Any], where: str, namespace: str | None = None) -> None:
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise ApiError(400, f"{where}.name: expected a non-empty string", param=f"{where}.name")
        if (namespace, name) in self.flat:
            raise ApiError(
                400, f"{where}.name: the tool {name!r} is defined twice", param=f"{where}.name"
            )
        flat = name
        if name in self.origin:
            if namespace is None:
                raise ApiError(
                    400, f"{where}.name: the tool {name!r} is defined twice", param=f"{where}.name"
                )
            flat = namespace + NAMESPACE_SEP + name
            if flat in self.origin:
                raise ApiError(
                    400,
                    f"{where}.name: {name!r} of namespace {namespace!r} collides with {flat!r}",
                    param=f"{where}.name",
                )
        params = tool.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ApiError(
                400, f"{where}.parameters: expected an object", param=f"{where}.parameters"
            )
        description = tool.get("description") or ""
        if not isinstance(description, str):
            raise ApiError(
                400, f"{where}.description: expected a string", param=f"{where}.description"
            )
        self.template.append(
            {
                "type": "function",
                "function": {"name": flat, "description": description, "parameters": params},
            }
        )
        self.origin[flat] = (namespace, name)
        self.flat[(namespace, name)] = flat

    def call_name(self, name: str, namespace: Any) -> str:
        """The flat name a call in the history renders with (what the model sees)."""
        ns = namespace if isinstance(namespace, str) and namespace else None
        return self.flat.get((ns, name), name)


def parse_tools(body: dict) -> ToolSet:
    """Function and namespace tools; hosted tools (web_search, ...) are left out, logged once."""
    tools = f.get_list(body, "tools") or []
    out = ToolSet()
    hosted: list[str] = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        kind = t.get("type") if isinstance(t, dict) else None
        if not isinstance(kind, str):
            raise ApiError(400, f"{where}.type: expected a string", param=f"{where}.type")
        if kind == "function":
            out.add(t, where)
        elif kind == "namespace":
            ns = t.get("name")
            if not isinstance(ns, str) or not ns:
                raise ApiError(
                    400, f"{where}.name: expected a non-empty string", param=f"{where}.name"
                )
            nested = t.get("tools")
            if not isinstance(nested, list):
                raise ApiError(400, f"{where}.tools: expected an array", param=f"{where}.tools")
            for j, n in enumerate(nested):
                w = f"{where}.tools[{j}]"
                if isinstance(n, dict) and n.get("type", "function") == "function":
                    out.add(n, w, namespace=ns)
                elif not isinstance(n, dict):
                    raise ApiError(400, f"{w}: expected an object", param=w)
                else:
                    hosted.append(f"{ns}.{n.get('type')}")
        else:
            hosted.append(kind)
    if hosted:
        # A local model cannot run the provider's hosted tools; the rest of the turn can.
        log.info("tools left out (hosted, not run here): %s", ", ".join(hosted))
    return out


def parse_tool_choice(body: dict, tools: ToolSet) -> ToolChoice:
    parallel = f.get_bool(body, "parallel_tool_calls", True)
    choice = body.get("tool_choice")
    if choice is None or choice == "auto":
        return ToolChoice("auto", parallel=parallel)
    if choice in ("none", "required"):
        if choice == "required" and not tools.template:
            raise ApiError(
                400, "tool_choice: 'required' but no function tools", param="tool_choice"
            )
        return ToolChoice(choice, parallel=parallel)
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if not isinstance(name, str):
            raise ApiError(400, "tool_choice.name: expected a string", param="tool_choice.name")
        flat = tools.call_name(name, choice.get("namespace"))
        if flat not in tools.origin:
            raise ApiError(
                400, f"tool_choice.name: no function tool named {name!r}", param="tool_choice.name"
            )
        return ToolChoice("required", flat, parallel=parallel)
    raise ApiError(
        400,
        f"tool_choice: expected 'auto', 'none', 'required' or "
        f"{{type: function, name}}, got {f.short(choice)}",
        param="tool_choice",
    )


def input_items(body: dict, required: bool) -> list:
    """`input` as a list of items (a string is one user message)."""
    value = body.get("input")
    if value is None:
        if required:
            raise ApiError(400, "input: field required", param="input")
        return []
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list):
        raise ApiError(
            400,
            f"input: expected a string or an array of items, got {type(value).__name__}",
            param="input",
        )
    return value


def _content(content: Any, where: str) -> tuple[str, images.Parts | None]:
    """The text of string content or a content list, and its parts when it has images."""
    if content is None:
        return "", None
    if isinstance(content, str):
        return content, None
    if not isinstance(content, list):
        raise ApiError(400, f"{where}: expected a string or an array of content parts", param=where)
    out = [_part(part, f"{where}[{i}]") for i, part in enumerate(content)]
    return images.text_and_parts(out)


def _part(part: Any, where: str) -> str | ImageInput:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in TEXT_PARTS:
        if not isinstance(part.get("text"), str):
            raise ApiError(400, f"{where}.text: expected a string", param=f"{where}.text")
        return part["text"]
    if kind == "refusal":
        if not isinstance(part.get("refusal"), str):
            raise ApiError(400, f"{where}.refusal: expected a string", param=f"{where}.refusal")
        return part["refusal"]
    if kind == "input_image":
        return _image(part, where)
    raise ApiError(
        400,
        f"{where}.type: content type {f.short(kind)} is not supported; expected one of "
        f"{[*TEXT_PARTS, 'refusal', 'input_image']}",
        param=f"{where}.type",
    )


def _image(part: dict, where: str) -> ImageInput:
    """`{"type": "input_image", "image_url": "data:..."}`: the URL is the field itself."""
    try:
        image = images.openai_image(part, where)
    except ApiError as e:
        e.param = f"{where}.image_url"
        e.message = e.message.replace(f"{where}.image_url.url", e.param)
        raise
    return replace(image, field=f"{where}.image_url")


def _text(content: Any, where: str) -> str:
    text, parts = _content(content, where)
    if parts is not None:
        first = next(p for p in parts if isinstance(p, ImageInput))
        raise ApiError(
            400,
            f"{first.field}: images are accepted in user messages and tool outputs only",
            param=where,
        )
    return text


def _reasoning_text(item: dict, where: str) -> str:
    """The reasoning's own text when sent, else its summary (Codex re-sends only summaries)."""
    for name in ("content", "summary"):
        value = item.get(name)
        if value is None:
            continue
        if not isinstance(value, list):
            raise ApiError(400, f"{where}.{name}: expected an array", param=f"{where}.{name}")
        texts = [_part(p, f"{where}.{name}[{i}]") for i, p in enumerate(value)]
        if any(isinstance(t, ImageInput) for t in texts):
            raise ApiError(400, f"{where}.{name}: expected text parts", param=f"{where}.{name}")
        text = "\n".join(t for t in texts if t)
        if text:
            return text
    return ""


class _Builder:
    """Folds items into Messages: a reasoning item waits for the next assistant turn, and an
    assistant message with the function calls right after it is one Message."""

    def __init__(self) -> None:
        self.out: list[Message] = []
        self.reasoning: list[str] = []
        self.open_calls = False  # the last Message is an assistant turn calls may join

    def assistant(self, content: str, call: ToolCall | None) -> None:
        if call is not None and self.open_calls and not self.reasoning:
            last = self.out[-1]
            self.out[-1] = replace(last, tool_calls=(*(last.tool_calls or ()), call))
            return
        reasoning = "\n".join(self.reasoning) if self.reasoning else None
        self.reasoning = []
        calls = None if call is None else (call,)
        self.out.append(Message("assistant", content, reasoning=reasoning, tool_calls=calls))
        self.open_calls = True

    def other(self, message: Message) -> None:
        self.reasoning = []  # reasoning before a non-assistant turn has nowhere to go
        self.out.append(message)
        self.open_calls = False


def parse_items(items: Sequence[Any], tools: ToolSet, where: Where) -> list[Message]:
    """Messages in order; developer and system messages stay "system" Messages here."""
    b = _Builder()
    for i, item in enumerate(items):
        w = where(i)
        if not isinstance(item, dict):
            raise ApiError(400, f"{w}: expected an object", param=w)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise ApiError(
                    400,
                    f"{w}.role: unknown role {f.short(role)}; expected one of {list(ROLES)}",
                    param=f"{w}.role",
                )
            if role == "assistant":
                b.assistant(_text(item.get("content"), f"{w}.content"), None)
            elif role == "user":
                text, parts = _content(item.get("content"), f"{w}.content")
                b.other(Message("user", text, parts=parts))
            else:
                b.other(Message("system", _text(item.get("content"), f"{w}.content")))
        elif kind == "function_call":
            name = f.get_str(item, "name", nonempty=True, where=f"{w}.name")
            call_id = f.get_str(item, "call_id", nonempty=True, where=f"{w}.call_id")
            arguments = _parse_arguments(item.get("arguments", "{}"), f"{w}.arguments")
            flat = tools.call_name(name, item.get("namespace"))
            b.assistant("", ToolCall(flat, arguments, call_id))
        elif kind == "function_call_output":
            call_id = f.get_str(item, "call_id", nonempty=True, where=f"{w}.call_id")
            output = item.get("output")
            if output is None:
                raise ApiError(400, f"{w}.output: field required", param=f"{w}.output")
            text, parts = _content(output, f"{w}.output")
            b.other(Message("tool", text, tool_call_id=call_id, parts=parts))
        elif kind == "reasoning":
            if text := _reasoning_text(item, w):
                b.reasoning.append(text)
        else:
            raise ApiError(
                400,
                f"{w}.type: item type {f.short(kind)} is not supported; expected one of "
                f"{list(ITEM_TYPES)}",
                param=f"{w}.type",
            )
    return b.out


def arrange(instructions: str | None, messages: list[Message]) -> list[Message]:
    """One leading system Message: `instructions`, then the developer and system messages
    that open the input (chat templates take a system message only first).

    A developer message later in the conversation joins the user turn before it (or is a
    user turn of its own), as the Anthropic dialect does, so the prefix before it stays the
    same turn after turn and keeps its cache.
    """
    head = [instructions] if instructions else []
    n = 0
    while n < len(messages) and messages[n].role == "system":
        head.append(messages[n].content)
        n += 1
    out = [Message("system", "\n\n".join(head))] if head else []
    for m in messages[n:]:
        if m.role != "system":
            out.append(m)
        elif out and out[-1].role == "user":
            last = out[-1]
            parts = None if last.parts is None else (*last.parts, "\n\n" + m.content)
            out[-1] = replace(last, content=last.content + "\n\n" + m.content, parts=parts)
        else:
            out.append(Message("user", m.content))
    return out
