"""Anthropic dialect: /v1/messages and count_tokens, from the body to a started generation.

The answer, whole or as its event stream, is written by anthropic_output.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from aiohttp import web

from engine_bridge.types import (
    GenerationRequest,
    ImageInput,
    Message,
    Sampling,
    ToolCall,
    ToolChoice,
)

from .. import fields as f
from ..errors import ApiError
from ..generation import Given, apply_model_settings, request_options, session_id, start
from ..state import ENGINE
from . import images
from .anthropic_output import MessageWriter, message_json, new_id
from .output import merge
from .sse import SSEWriter

# Tool types Anthropic runs server-side (web search, …); a local model cannot call them.
_CUSTOM_TOOL_TYPES = {None, "custom"}
# The sampling fields Messages has; [model."…"] settings fill the others, and max_tokens is
# required, so a configured one never applies.
SAMPLING = ("temperature", "top_p", "top_k")


def given(body: dict) -> Given:
    """What the body set of the fields a model's settings could fill."""
    return Given.of(body, SAMPLING, ("max_tokens",))


def thinking_kwargs(body: dict) -> dict[str, Any]:
    """`thinking` as the template's enable_thinking; "adaptive" (Claude Code's default)
    lets the model decide, so it allows thinking."""
    thinking = f.get_dict(body, "thinking")
    if thinking is None:
        return {}
    return {"enable_thinking": thinking.get("type") in ("enabled", "adaptive")}


def _block_text(block: Any, where: str) -> str:
    if isinstance(block, str):
        return block
    if not isinstance(block, dict):
        raise ApiError(400, f"{where}: expected a content block object", param=where)
    kind = block.get("type")
    if kind == "text":
        if not isinstance(block.get("text"), str):
            raise ApiError(400, f"{where}.text: expected a string", param=where)
        return block["text"]
    raise ApiError(400, f"{where}: block type {f.short(kind)} is not supported here", param=where)


def _text_blocks(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}: expected a string or an array of blocks", param=where)
    return "".join(_block_text(b, f"{where}[{i}]") for i, b in enumerate(content))


def _parts(
    content: Any, where: str, skip: Callable[[Any], bool] | None = None
) -> tuple[str, images.Parts | None]:
    """Text and images of a user turn's or tool result's blocks; parts only with an image."""
    if content is None or isinstance(content, str):
        return content or "", None
    if not isinstance(content, list):
        raise ApiError(400, f"{where}: expected a string or an array of blocks", param=where)
    parts: list[str | ImageInput] = []
    for i, b in enumerate(content):
        w = f"{where}[{i}]"
        if skip is not None and skip(b):
            continue
        if isinstance(b, dict) and b.get("type") == "image":
            parts.append(images.anthropic_image(b, w))
        else:
            parts.append(_block_text(b, w))
    return images.text_and_parts(parts)


def parse_system(body: dict) -> str | None:
    system = body.get("system")
    if system is None:
        return None
    return _text_blocks(system, "system")


def parse_messages(body: dict) -> list[Message]:
    messages = f.get_list(body, "messages", nonempty=True)
    out: list[Message] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"{where}: expected an object", param="messages")
        role = m.get("role")
        if role not in ("user", "assistant", "system"):
            raise ApiError(
                400,
                f"{where}.role: unknown role {f.short(role)}; expected 'user', 'assistant' or 'system'",
                param="messages",
            )
        content = m.get("content")
        if role == "system":
            _inline_system(out, _text_blocks(content, f"{where}.content"))
            continue
        if isinstance(content, str):
            out.append(Message(role, content))
            continue
        if not isinstance(content, list):
            raise ApiError(
                400, f"{where}.content: expected a string or an array of blocks", param="messages"
            )
        if role == "assistant":
            out.append(_assistant(content, where))
        else:
            out.extend(_user(content, where))
    return out


def _inline_system(out: list[Message], text: str) -> None:
    """A system message inside the conversation (Claude Code sends these after a user turn).

    Chat templates accept a system message only first, so it joins the user turn before it,
    where it stays at the same place in every later request and so keeps the prefix cached.
    """
    if out and out[-1].role == "user":
        last = out[-1]
        parts = None if last.parts is None else (*last.parts, "\n\n" + text)
        out[-1] = replace(last, content=last.content + "\n\n" + text, parts=parts)
    else:
        out.append(Message("user", text))


def _assistant(blocks: list, where: str) -> Message:
    text, thinking, calls = [], [], []
    for j, b in enumerate(blocks):
        w = f"{where}.content[{j}]"
        if not isinstance(b, dict):
            raise ApiError(400, f"{w}: expected a content block object", param="messages")
        kind = b.get("type")
        if kind == "text":
            text.append(_block_text(b, w))
        elif kind == "thinking":
            value = b.get("thinking") or ""
            if not isinstance(value, str):
                raise ApiError(400, f"{w}.thinking: expected a string", param="messages")
            thinking.append(value)
        elif kind == "redacted_thinking":
            continue
        elif kind in ("tool_use", "server_tool_use"):
            if not isinstance(b.get("name"), str):
                raise ApiError(400, f"{w}.name: expected a string", param="messages")
            args = b.get("input", {})
            if not isinstance(args, dict):
                raise ApiError(400, f"{w}.input: expected an object", param="messages")
            calls.append(ToolCall(b["name"], args, b.get("id", "")))
        else:
            raise ApiError(
                400, f"{w}: block type {f.short(kind)} is not supported", param="messages"
            )
    return Message(
        "assistant",
        "".join(text),
        reasoning="\n".join(thinking) if thinking else None,
        tool_calls=tuple(calls) if calls else None,
    )


def _user(blocks: list, where: str) -> list[Message]:
    results, rest = [], []
    for j, b in enumerate(blocks):
        w = f"{where}.content[{j}]"
        if not isinstance(b, dict):
            raise ApiError(400, f"{w}: expected a content block object", param="messages")
        if b.get("type") == "tool_result":
            body, parts = _parts(b.get("content"), f"{w}.content")
            if b.get("is_error"):
                body = "Error: " + body
                parts = None if parts is None else ("Error: ", *parts)
            call_id = b.get("tool_use_id", "")
            results.append(Message("tool", body, tool_call_id=call_id, parts=parts))
        else:
            rest.append(b)
    out = results
    if rest or not results:
        # The other blocks keep their indices in the body, for errors that name them.
        text, parts = _parts(blocks, f"{where}.content", skip=_is_tool_result)
        out.append(Message("user", text, parts=parts))
    return out


def _is_tool_result(block: Any) -> bool:
    return isinstance(block, dict) and block.get("type") == "tool_result"


def parse_tools(body: dict) -> list[dict[str, Any]] | None:
    tools = f.get_list(body, "tools")
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise ApiError(400, f"tools[{i}].name: expected a string", param="tools")
        kind = t.get("type")
        if kind is not None and not isinstance(kind, str):  # a list is unhashable, too
            raise ApiError(400, f"tools[{i}].type: expected a string", param="tools")
        if kind not in _CUSTOM_TOOL_TYPES:
            continue
        schema = t.get("input_schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise ApiError(400, f"tools[{i}].input_schema: expected an object", param="tools")
        out.append(
            {
                "type": "function",
                "function": {
                    "name": t["name"],
                    "description": t.get("description", ""),
                    "parameters": schema,
                },
            }
        )
    return out or None


def build_messages(body: dict) -> list[Message]:
    messages = parse_messages(body)
    system = parse_system(body)
    if system is not None:
        messages.insert(0, Message("system", system))
    return messages


def parse_tool_choice(body: dict, tools: list[dict[str, Any]] | None) -> ToolChoice:
    """`tool_choice` {type: auto|any|tool|none, name, disable_parallel_tool_use}, as the
    engine honours it."""
    choice = f.get_dict(body, "tool_choice")
    if choice is None:
        return ToolChoice()
    kind = choice.get("type")
    parallel = not f.get_bool(
        choice, "disable_parallel_tool_use", False, where="tool_choice.disable_parallel_tool_use"
    )
    if kind == "auto":
        return ToolChoice("auto", parallel=parallel)
    if kind == "none":
        return ToolChoice("none", parallel=parallel)
    if kind == "any":
        return ToolChoice("required", parallel=parallel)
    if kind == "tool":
        name = f.get_str(choice, "name", nonempty=True, where="tool_choice.name")
        if not any(t["function"]["name"] == name for t in tools or ()):
            raise ApiError(400, f"tool_choice.name: no tool named {name!r}", param="tool_choice")
        return ToolChoice("required", name=name, parallel=parallel)
    raise ApiError(400, "tool_choice.type: expected auto, any, tool or none", param="tool_choice")


def messages_request(body: dict, request: web.Request) -> GenerationRequest:
    model = f.get_str(body, "model", nonempty=True)
    max_tokens = f.get_int(body, "max_tokens", None, lo=1)
    if max_tokens is None:
        raise ApiError(400, "max_tokens: field required", param="max_tokens")
    metadata = f.get_dict(body, "metadata") or {}
    user_id = f.get_str(metadata, "user_id", None, where="metadata.user_id")
    tenant, use_cache = request_options(request)
    tools = parse_tools(body)
    return GenerationRequest(
        model=model,
        messages=build_messages(body),
        tools=tools,
        tool_choice=parse_tool_choice(body, tools),
        max_tokens=max_tokens,
        stop=f.get_stop(body, "stop_sequences"),
        sampling=Sampling(
            temperature=f.get_float(body, "temperature", 1.0, lo=0.0, hi=1.0),
            top_p=f.get_float(body, "top_p", 1.0, lo=0.0, hi=1.0),
            top_k=f.get_int(body, "top_k", 0, lo=0),
        ),
        tenant=tenant,
        use_cache=use_cache,
        template_kwargs=thinking_kwargs(body),
        session=session_id(request, user_id),
    )


async def messages(request: web.Request, body: dict) -> web.StreamResponse:
    req = messages_request(body, request)
    stream = f.get_bool(body, "stream")
    gen = await start(request.app[ENGINE], req, request, given(body))
    mid = new_id()
    if not stream:
        try:
            parts = merge([p async for p in gen.parts()])
        finally:
            await gen.aclose()
        return web.json_response(message_json(mid, req.model, gen, parts), headers=gen.headers)

    sse = SSEWriter(request, gen.headers)
    await sse.prepare()
    try:
        await MessageWriter(sse, gen, mid, req.model).write()
    finally:
        await gen.aclose()
    return sse.response


async def count_tokens(request: web.Request, body: dict) -> web.Response:
    model = f.get_str(body, "model", nonempty=True)
    req = GenerationRequest(
        model=model,
        messages=build_messages(body),
        tools=parse_tools(body),
        template_kwargs=thinking_kwargs(body),
    )
    apply_model_settings(req, request, given(body))  # its template kwargs shape the prompt
    n = await request.app[ENGINE].count_tokens(req)
    return web.json_response({"input_tokens": n})
