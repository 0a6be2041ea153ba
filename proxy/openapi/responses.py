"""The /openapi.json schemas of the Responses dialect (proxy/dialects/responses.py): the
request with its input items and tools, the `response` object and its output items."""

from __future__ import annotations

from .schema import ANY_OBJECT, BOOL, COUNT, INT, STRING, Schema, nullable, obj, ref


def schemas() -> dict[str, Schema]:
    text_part = obj(
        {
            "type": {
                "enum": ["input_text", "output_text", "text", "summary_text", "reasoning_text"]
            },
            "text": STRING,
        },
        ["type", "text"],
    )
    image_part = obj(
        {
            "type": {"const": "input_image"},
            "image_url": {**STRING, "description": "a data: URL (no fetching)"},
        },
        ["type", "image_url"],
    )
    refusal = obj({"type": {"const": "refusal"}, "refusal": STRING}, ["type", "refusal"])
    content = {
        "description": "a string or content parts; images from the user and tool outputs",
        "anyOf": [STRING, {"type": "array", "items": {"anyOf": [text_part, image_part, refusal]}}],
    }
    message = obj(
        {
            "type": {"const": "message"},
            "role": {
                "description": "developer and system text opens the prompt as its one system "
                "message; later ones join the user turn before them",
                "enum": ["user", "assistant", "system", "developer"],
            },
            "content": content,
        },
        ["role"],
    )
    call = obj(
        {
            "type": {"const": "function_call"},
            "call_id": {**STRING, "minLength": 1},
            "name": {**STRING, "minLength": 1},
            "namespace": STRING,
            "arguments": {"description": "JSON text", "type": "string"},
            "id": STRING,
        },
        ["type", "call_id", "name"],
    )
    call_output = obj(
        {
            "type": {"const": "function_call_output"},
            "call_id": {**STRING, "minLength": 1},
            "output": content,
        },
        ["type", "call_id", "output"],
    )
    summary = {"type": "array", "items": text_part}
    reasoning = obj(
        {
            "type": {"const": "reasoning"},
            "summary": summary,
            "content": nullable(summary),
            "encrypted_content": nullable(STRING),
        },
        ["type"],
        description="its text becomes the next assistant turn's reasoning",
    )
    function = obj(
        {
            "type": {"const": "function"},
            "name": {**STRING, "minLength": 1},
            "description": STRING,
            "parameters": nullable(ANY_OBJECT),
            "strict": nullable(BOOL),
        },
        ["type", "name"],
    )
    namespace = obj(
        {
            "type": {"const": "namespace"},
            "name": {**STRING, "minLength": 1},
            "description": STRING,
            "tools": {"type": "array", "items": function},
        },
        ["type", "name", "tools"],
        description="its functions join the tool list under their own names (namespace__name "
        "when that name is taken)",
    )
    hosted = obj(
        {"type": {**STRING, "not": {"enum": ["function", "namespace"]}}},
        ["type"],
        description="a hosted tool (web_search, ...): left out, a local model cannot run it",
    )
    max_tokens = nullable({"type": "integer", "minimum": 1})
    request = obj(
        {
            "model": ref("LocalModel"),
            "input": {
                "description": "a user message, or items (an empty array is fine with "
                "previous_response_id)",
                "anyOf": [
                    STRING,
                    {"type": "array", "items": {"anyOf": [message, call, call_output, reasoning]}},
                ],
            },
            "instructions": nullable(STRING),
            "previous_response_id": nullable(
                {**STRING, "description": "a stored response (in memory, the last 256)"}
            ),
            "tools": nullable({"type": "array", "items": {"anyOf": [function, namespace, hosted]}}),
            "tool_choice": {
                "anyOf": [
                    {"enum": ["auto", "none", "required"]},
                    obj({"type": {"const": "function"}, "name": STRING}, ["type", "name"]),
                    {"type": "null"},
                ]
            },
            "parallel_tool_calls": nullable(BOOL),
            "reasoning": nullable(
                obj(
                    {
                        "effort": nullable(
                            {"enum": ["none", "minimal", "low", "medium", "high", "xhigh"]}
                        ),
                        "summary": {"description": "accepted; reasoning is always a summary"},
                    },
                    description="effort none/minimal turns the template's thinking off",
                )
            ),
            "chat_template_kwargs": nullable(ANY_OBJECT),
            "max_output_tokens": max_tokens,
            "max_tokens": {**max_tokens, "description": "used when max_output_tokens is absent"},
            "temperature": nullable({"type": "number", "minimum": 0, "maximum": 2}),
            "top_p": nullable({"type": "number", "minimum": 0, "maximum": 1}),
            "stream": nullable(BOOL),
            "store": nullable({**BOOL, "description": "false: not kept for previous_response_id"}),
            "include": nullable({"type": "array", "items": STRING}),
            "prompt_cache_key": nullable(
                {**STRING, "description": "the session, without a header"}
            ),
            "metadata": nullable(ANY_OBJECT),
            "text": nullable(ANY_OBJECT),
            "user": nullable(STRING),
        },
        ["model", "input"],
    )
    out_text = obj(
        {"type": {"const": "output_text"}, "text": STRING, "annotations": {"type": "array"}},
        ["type", "text"],
    )
    output_item = {
        "anyOf": [
            obj(
                {
                    "id": STRING,
                    "type": {"const": "message"},
                    "role": {"const": "assistant"},
                    "status": {"enum": ["in_progress", "completed", "incomplete"]},
                    "content": {"type": "array", "items": out_text},
                },
                ["id", "type", "role", "status", "content"],
            ),
            obj(
                {
                    "id": STRING,
                    "type": {"const": "reasoning"},
                    "summary": {"type": "array", "items": text_part},
                },
                ["id", "type", "summary"],
            ),
            obj(
                {
                    "id": STRING,
                    "type": {"const": "function_call"},
                    "status": STRING,
                    "call_id": STRING,
                    "name": STRING,
                    "namespace": STRING,
                    "arguments": STRING,
                },
                ["id", "type", "call_id", "name", "arguments"],
            ),
        ]
    }
    usage = obj(
        {
            "input_tokens": COUNT,
            "input_tokens_details": obj({"cached_tokens": COUNT}, ["cached_tokens"]),
            "output_tokens": COUNT,
            "output_tokens_details": obj({"reasoning_tokens": COUNT}, ["reasoning_tokens"]),
            "total_tokens": COUNT,
        },
        ["input_tokens", "input_tokens_details", "output_tokens", "total_tokens"],
    )
    response = obj(
        {
            "id": STRING,
            "object": {"const": "response"},
            "created_at": INT,
            "status": {"enum": ["completed", "incomplete", "in_progress", "failed"]},
            "model": STRING,
            "output": {"type": "array", "items": output_item},
            "incomplete_details": nullable(
                obj({"reason": {"const": "max_output_tokens"}}, ["reason"])
            ),
            "previous_response_id": nullable(STRING),
            "usage": nullable(ref("ResponsesUsage")),
        },
        ["id", "object", "created_at", "status", "model", "output"],
        description="the request's settings (tools, tool_choice, reasoning, ...) are echoed",
    )
    return {"ResponsesRequest": request, "ResponsesUsage": usage, "Response": response}
