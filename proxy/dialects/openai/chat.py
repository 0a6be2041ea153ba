"""OpenAI chat completions: POST /v1/chat/completions, from the messages, tools and
reasoning effort in the body to the answer, whole or as its chunk stream."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import orjson
from aiohttp import web

from engine_bridge.types import (
    GenerationRequest,
    ImageInput,
    Message,
    ToolCall,
    ToolChoice,
)

from ... import fields as f
from ...errors import ApiError
from ...generation import Generation, Given, start
from ...state import ENGINE
from .. import images
from ..output import Part, merge
from ..sse import SSEWriter
from .shared import lmstudio_extras, request_fields, usage

ROLES = {"system", "developer", "user", "assistant", "tool", "function"}


def text_of(content: Any, where: str) -> str:
    """String content, or the text parts of a content array."""
    text, parts = content_of(content, where)
    if parts is not None:
        first = next(p for p in parts if isinstance(p, ImageInput))
        raise ApiError(400, f"{first.field}: images are not accepted here", param=first.field)
    return text


def content_of(content: Any, where: str) -> tuple[str, images.Parts | None]:
    """The text of string content or a content array, and its parts when it has images."""
    if content is None:
        return "", None
    if isinstance(content, str):
        return content, None
    if not isinstance(content, list):
        raise ApiError(400, f"{where}: expected a string or an array of content parts", param=where)
    out: list[str | ImageInput] = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise ApiError(
                400, f"{where}[{i}]: expected a content part object with a type", param=where
            )
        if part["type"] in ("text", "input_text"):
            if not isinstance(part.get("text"), str):
                raise ApiError(400, f"{where}[{i}].text: expected a string", param=where)
            out.append(part["text"])
        elif part["type"] == "image_url":
            out.append(images.openai_image(part, f"{where}[{i}]"))
        else:
            raise ApiError(
                400,
                f"{where}[{i}]: content type {part['type']!r} is not supported by this model",
                param=where,
            )
    return images.text_and_parts(out)


def _parse_arguments(raw: Any, where: str) -> Any:
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, str):
        try:
            value = json.loads(raw) if raw.strip() else {}
        except ValueError:
            return raw  # templates render a string as-is; the model saw it that way
        return value
    raise ApiError(400, f"{where}: expected a JSON string or an object", param=where)


def parse_messages(body: dict) -> list[Message]:
    messages = f.get_list(body, "messages", nonempty=True)
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"{where}: expected an object", param="messages")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise ApiError(
                400,
                f"{where}.role: unknown role {f.short(role)}; expected one of {sorted(ROLES)}",
                param="messages",
            )
        role = {"developer": "system", "function": "tool"}.get(role, role)
        if role in ("user", "tool"):
            content, parts = content_of(m.get("content"), f"{where}.content")
        else:
            content, parts = text_of(m.get("content"), f"{where}.content"), None
        if role == "assistant":
            reasoning = m.get("reasoning_content")
            if not isinstance(reasoning, str):  # `reasoning`: the newer name some clients send
                reasoning = m.get("reasoning")
            calls = m.get("tool_calls")
            if calls is not None and not isinstance(calls, list):
                raise ApiError(400, f"{where}.tool_calls: expected an array", param="messages")
            out.append(
                Message(
                    role,
                    content,
                    reasoning=reasoning if isinstance(reasoning, str) else None,
                    tool_calls=None
                    if calls is None
                    else tuple(
                        _parse_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)
                    ),
                )
            )
        elif role == "tool":
            call_id = m.get("tool_call_id") or m.get("name") or ""
            out.append(Message(role, content, tool_call_id=call_id, parts=parts))
        else:
            out.append(Message(role, content, parts=parts))
    return out


def _parse_call(call: Any, where: str) -> ToolCall:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise ApiError(400, f"{where}: expected an object with a function", param="messages")
    fn = call["function"]
    if not isinstance(fn.get("name"), str):
        raise ApiError(400, f"{where}.function.name: expected a string", param="messages")
    arguments = _parse_arguments(fn.get("arguments", {}), where)
    return ToolCall(fn["name"], arguments, call.get("id", ""))


def parse_tools(body: dict) -> list[dict[str, Any]] | None:
    tools = f.get_list(body, "tools")
    if not tools:
        return None
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("function"), dict):
            raise ApiError(
                400, f"tools[{i}]: expected {{type: function, function: {{...}}}}", param="tools"
            )
        if not isinstance(t["function"].get("name"), str):
            raise ApiError(400, f"tools[{i}].function.name: expected a string", param="tools")
    return tools


def parse_tool_choice(body: dict, tools: list[dict[str, Any]] | None) -> ToolChoice:
    """`tool_choice` ("auto", "none", "required" or a named function) and
    `parallel_tool_calls`, as the engine honours them."""
    choice = body.get("tool_choice")
    parallel = f.get_bool(body, "parallel_tool_calls", True)
    if choice is None or choice == "auto":
        return ToolChoice("auto", parallel=parallel)
    if choice in ("none", "required"):
        return ToolChoice(choice, parallel=parallel)
    name = None
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom"):
        fn = choice.get("function") if isinstance(choice.get("function"), dict) else choice
        name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ApiError(
            400,
            'tool_choice: expected "auto", "none", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if not any(t["function"]["name"] == name for t in tools or ()):
        raise ApiError(400, f"tool_choice: no tool named {name!r} in tools", param="tool_choice")
    return ToolChoice("required", name=name, parallel=parallel)


def thinking_kwargs(body: dict) -> dict[str, Any]:
    """`chat_template_kwargs`, with `reasoning_effort` as the template's enable_thinking
    ("none" and "minimal" turn reasoning off; an explicit kwarg wins)."""
    kwargs = dict(f.get_dict(body, "chat_template_kwargs", {}) or {})
    effort = f.get_str(body, "reasoning_effort", None)
    if effort is not None:
        thinking_for_effort(kwargs, effort, "reasoning_effort")
    return kwargs


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def thinking_for_effort(kwargs: dict[str, Any], effort: str, where: str) -> None:
    """A reasoning effort as the template's enable_thinking ("none" and "minimal" turn it
    off), unless `kwargs` (the client's chat_template_kwargs) already say."""
    if effort not in REASONING_EFFORTS:
        raise ApiError(
            400,
            f"{where}: expected one of {list(REASONING_EFFORTS)}, got {f.short(effort)}",
            param=where,
        )
    kwargs.setdefault("enable_thinking", effort not in ("none", "minimal"))


def chat_request(body: dict, request: web.Request) -> GenerationRequest:
    common = request_fields(body, request)
    messages = parse_messages(body)
    tools = parse_tools(body)
    return GenerationRequest(
        messages=messages,
        tools=tools,
        tool_choice=parse_tool_choice(body, tools),
        template_kwargs=thinking_kwargs(body),
        **common,
    )


def finish_reason(gen: Generation, parts: list[Part]) -> str:
    if any(p.kind == "tool_call" for p in parts):
        return "tool_calls"
    if gen.result and gen.result.finish_reason == "length":
        return "length"
    return "stop"


def tool_call_json(p: Part, index: int | None = None) -> dict[str, Any]:
    """A parsed call in the response's shape: the template's, with the arguments as JSON text."""
    assert p.call is not None, f"not a tool call: {p!r}"
    call = p.call.to_template()
    call["function"]["arguments"] = json.dumps(p.call.arguments, ensure_ascii=False)
    if index is not None:
        call["index"] = index
    return call


async def chat_completions(
    request: web.Request, body: dict, lmstudio: bool = False
) -> web.StreamResponse:
    req = chat_request(body, request)
    stream = f.get_bool(body, "stream")
    options = f.get_dict(body, "stream_options", {}) or {}
    gen = await start(request.app[ENGINE], req, request, Given.of(body))
    rid = "chatcmpl-" + uuid.uuid4().hex[:24]
    created = int(time.time())
    if not stream:
        try:
            parts = merge([p async for p in gen.parts()])
        finally:
            await gen.aclose()
        text = "".join(p.text for p in parts if p.kind == "text")
        reasoning = "".join(p.text for p in parts if p.kind == "reasoning")
        calls = [tool_call_json(p) for p in parts if p.kind == "tool_call"]
        content = text if text or not calls else None
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        return web.json_response(
            {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": req.model,
                "choices": [
                    {
                        "index": 0,
                        "message": message,
                        "finish_reason": finish_reason(gen, parts),
                        "logprobs": None,
                    }
                ],
                "usage": usage(gen),
                **(lmstudio_extras(gen) if lmstudio else {}),
            },
            headers=gen.headers,
            dumps=lambda o: orjson.dumps(o).decode(),
        )

    sse = SSEWriter(request, gen.headers)
    await sse.prepare()

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": req.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
        }

    seen: list[Part] = []
    try:
        await sse.data(chunk({"role": "assistant", "content": ""}))
        async for p in sse.kept_alive(gen.parts()):
            seen.append(p)
            if p.kind == "text":
                await sse.data(chunk({"content": p.text}))
            elif p.kind == "reasoning":
                await sse.data(chunk({"reasoning_content": p.text}))
            else:
                # As OpenAI streams a call: index, id and name first, then the arguments
                # (here all at once: the families' parsers read a call whole).
                index = sum(1 for s in seen if s.kind == "tool_call") - 1
                call = tool_call_json(p, index)
                arguments = call["function"]["arguments"]
                call["function"]["arguments"] = ""
                await sse.data(chunk({"tool_calls": [call]}))
                delta = {"index": index, "function": {"arguments": arguments}}
                await sse.data(chunk({"tool_calls": [delta]}))
        last = chunk({}, finish_reason(gen, seen))
        if lmstudio:
            last.update(lmstudio_extras(gen))
        await sse.data(last)
        if options.get("include_usage"):
            final = chunk({})
            final["choices"] = []
            final["usage"] = usage(gen)
            await sse.data(final)
        await sse.done()
    finally:
        await gen.aclose()
    return sse.response
