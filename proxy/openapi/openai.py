"""The /openapi.json schemas of the OpenAI dialect (proxy/dialects/openai/): chat and
legacy completion requests, their answers and the error shape; openapi.document merges
`schemas()`."""

from __future__ import annotations

from .schema import ANY_OBJECT, BOOL, COUNT, INT, STRING, Schema, nullable, obj, ref


def schemas() -> dict[str, Schema]:
    text_part = obj({"type": {"enum": ["text", "input_text"]}, "text": STRING}, ["type", "text"])
    image_part = obj(
        {
            "type": {"const": "image_url"},
            "image_url": {
                "description": "a data: URL (base64); a remote URL gets a 400 (no fetching)",
                "anyOf": [STRING, obj({"url": STRING, "detail": STRING}, ["url"])],
            },
        },
        ["type", "image_url"],
    )
    content = {
        "description": "A string, or text parts; image_url parts in user and tool messages "
        "for models that can see ([vision] limits apply); audio parts get a 400",
        "anyOf": [
            STRING,
            {"type": "array", "items": {"anyOf": [text_part, image_part]}},
            {"type": "null"},
        ],
    }
    tool_call = obj(
        {
            "id": STRING,
            "type": {"const": "function"},
            "function": obj(
                {
                    "name": STRING,
                    "arguments": {
                        "description": "JSON text (as OpenAI sends it) or an object",
                        "anyOf": [STRING, ANY_OBJECT],
                    },
                },
                ["name"],
            ),
        },
        ["function"],
    )
    message = obj(
        {
            "role": {"enum": ["system", "developer", "user", "assistant", "tool", "function"]},
            "content": content,
            "name": STRING,
            "reasoning_content": nullable(STRING),
            "reasoning": nullable(STRING),
            "tool_calls": nullable({"type": "array", "items": tool_call}),
            "tool_call_id": nullable(STRING),
        },
        ["role"],
    )
    tool = obj(
        {
            "type": {"const": "function"},
            "function": obj(
                {"name": STRING, "description": STRING, "parameters": ANY_OBJECT}, ["name"]
            ),
        },
        ["function"],
    )
    common = {
        "max_tokens": nullable({"type": "integer", "minimum": 1}),
        "max_completion_tokens": nullable({"type": "integer", "minimum": 1}),
        "temperature": nullable({"type": "number", "minimum": 0, "maximum": 2}),
        "top_p": nullable({"type": "number", "minimum": 0, "maximum": 1}),
        "top_k": nullable({"type": "integer", "minimum": 0}),
        "min_p": nullable({"type": "number", "minimum": 0, "maximum": 1}),
        "repetition_penalty": nullable({"type": "number", "minimum": 0.01, "maximum": 10}),
        "seed": nullable({"type": "integer", "description": "taken modulo 2**64"}),
        "n": nullable({"const": 1, "description": "only 1 is supported"}),
        "stop": nullable({"anyOf": [STRING, {"type": "array", "items": STRING}]}),
        "stream": nullable(BOOL),
        "stream_options": nullable(obj({"include_usage": BOOL})),
        "user": nullable({**STRING, "description": "session id when no session header"}),
    }
    usage = obj(
        {
            "prompt_tokens": COUNT,
            "completion_tokens": COUNT,
            "total_tokens": COUNT,
            "prompt_tokens_details": obj({"cached_tokens": COUNT}, ["cached_tokens"]),
            "completion_tokens_details": obj({"reasoning_tokens": COUNT}, ["reasoning_tokens"]),
        },
        [
            "prompt_tokens",
            "completion_tokens",
            "total_tokens",
            "prompt_tokens_details",
            "completion_tokens_details",
        ],
    )
    finish = {"enum": ["stop", "length", "tool_calls"]}
    return {
        "ChatMessage": message,
        "ChatTool": tool,
        "ChatCompletionRequest": obj(
            {
                "model": ref("LocalModel"),
                "messages": {"type": "array", "items": ref("ChatMessage"), "minItems": 1},
                "tools": nullable({"type": "array", "items": ref("ChatTool")}),
                "tool_choice": nullable(
                    {
                        "description": "auto; none (no call; the tools stay in the prompt); "
                        "required (the answer opens with a call); or a named function",
                        "anyOf": [
                            {"enum": ["auto", "none", "required"]},
                            obj(
                                {
                                    "type": {"const": "function"},
                                    "function": obj({"name": STRING}, ["name"]),
                                },
                                ["type", "function"],
                            ),
                        ],
                    }
                ),
                "parallel_tool_calls": nullable(
                    {"type": "boolean", "description": "false: the turn ends after its first call"}
                ),
                "reasoning_effort": nullable(
                    {
                        "enum": ["none", "minimal", "low", "medium", "high", "xhigh"],
                        "description": "none and minimal pass enable_thinking=false to the template",
                    }
                ),
                "chat_template_kwargs": nullable(ANY_OBJECT),
                **common,
            },
            ["model", "messages"],
        ),
        "CompletionRequest": obj(
            {
                "model": ref("LocalModel"),
                "prompt": {
                    "description": "text, token ids, or a batch of exactly one of those",
                    "anyOf": [
                        STRING,
                        {"type": "array", "items": COUNT, "minItems": 1},
                        {"type": "array", "items": STRING, "minItems": 1, "maxItems": 1},
                    ],
                },
                **common,
            },
            ["model", "prompt"],
        ),
        "Usage": usage,
        "ChatCompletion": obj(
            {
                "id": STRING,
                "object": {"const": "chat.completion"},
                "created": INT,
                "model": STRING,
                "choices": {
                    "type": "array",
                    "items": obj(
                        {
                            "index": INT,
                            "message": obj(
                                {
                                    "role": {"const": "assistant"},
                                    "content": nullable(STRING),
                                    "reasoning_content": STRING,
                                    "tool_calls": {"type": "array", "items": tool_call},
                                },
                                ["role", "content"],
                            ),
                            "finish_reason": finish,
                        },
                        ["index", "message", "finish_reason"],
                    ),
                },
                "usage": ref("Usage"),
            },
            ["id", "object", "created", "model", "choices", "usage"],
        ),
        "Completion": obj(
            {
                "id": STRING,
                "object": {"const": "text_completion"},
                "created": INT,
                "model": STRING,
                "choices": {
                    "type": "array",
                    "items": obj(
                        {"index": INT, "text": STRING, "finish_reason": finish},
                        ["index", "text", "finish_reason"],
                    ),
                },
                "usage": ref("Usage"),
            },
            ["id", "object", "created", "model", "choices", "usage"],
        ),
        "OpenAIError": obj(
            {
                "error": obj(
                    {
                        "message": STRING,
                        "type": STRING,
                        "param": {
                            "description": "the field at fault, when there is one",
                            "type": ["string", "null"],
                        },
                        "code": {"type": ["string", "integer", "null"]},
                    },
                    ["message", "type"],
                )
            },
            ["error"],
        ),
    }
