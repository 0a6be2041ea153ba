"""The /openapi.json schemas of the Anthropic dialect (proxy/dialects/anthropic.py):
Messages and count_tokens requests, their answers and the error shape; openapi.document
merges `schemas()`."""

from __future__ import annotations

from .schema import ANY_OBJECT, BOOL, COUNT, INT, STRING, Schema, nullable, obj, ref


def schemas() -> dict[str, Schema]:
    text = obj({"type": {"const": "text"}, "text": STRING}, ["type", "text"])
    text_content = {"anyOf": [STRING, {"type": "array", "items": ref("TextBlock")}]}
    tool_use = obj(
        {
            "type": {"enum": ["tool_use", "server_tool_use"]},
            "id": STRING,
            "name": STRING,
            "input": ANY_OBJECT,
        },
        ["type", "name"],
    )
    image = obj(
        {
            "type": {"const": "image"},
            "source": obj(
                {
                    "type": {
                        "description": "base64 only: a url source gets a 400 (no fetching)",
                        "const": "base64",
                    },
                    "media_type": STRING,
                    "data": STRING,
                },
                ["type", "media_type", "data"],
            ),
        },
        ["type", "source"],
        description="for models that can see ([vision] limits apply); others answer 400",
    )
    tool_content = {
        "anyOf": [STRING, {"type": "array", "items": {"anyOf": [ref("TextBlock"), image]}}]
    }
    user_blocks = {
        "anyOf": [
            ref("TextBlock"),
            image,
            obj(
                {
                    "type": {"const": "tool_result"},
                    "tool_use_id": STRING,
                    "content": nullable(tool_content),
                    "is_error": BOOL,
                },
                ["type"],
            ),
        ]
    }
    assistant_blocks = {
        "anyOf": [
            ref("TextBlock"),
            obj({"type": {"const": "thinking"}, "thinking": STRING, "signature": STRING}, ["type"]),
            obj({"type": {"const": "redacted_thinking"}, "data": STRING}, ["type"]),
            tool_use,
        ]
    }

    def message(role: str, blocks: Schema) -> Schema:
        return obj(
            {
                "role": {"const": role},
                "content": {"anyOf": [STRING, {"type": "array", "items": blocks}]},
            },
            ["role", "content"],
        )

    tool = obj(
        {
            "name": STRING,
            "description": STRING,
            "type": {
                "description": "absent or custom; server tool types (web search, ...) are skipped",
                "type": ["string", "null"],
            },
            "input_schema": ANY_OBJECT,
        },
        ["name"],
    )
    conversation = {
        "model": ref("LocalModel"),
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {
                "description": "a system message joins the user turn before it",
                "oneOf": [
                    message("user", user_blocks),
                    message("assistant", assistant_blocks),
                    message("system", ref("TextBlock")),
                ],
            },
        },
        "system": nullable(text_content),
        "tools": nullable({"type": "array", "items": ref("AnthropicTool")}),
        "tool_choice": obj(
            {
                "type": {"enum": ["auto", "any", "tool", "none"]},
                "name": STRING,
                "disable_parallel_tool_use": BOOL,
            },
            ["type"],
        ),
    }
    block = {
        "anyOf": [
            text,
            obj({"type": {"const": "thinking"}, "thinking": STRING, "signature": STRING}),
            obj({"type": {"const": "tool_use"}, "id": STRING, "name": STRING, "input": {}}),
        ]
    }
    return {
        "TextBlock": text,
        "AnthropicTool": tool,
        "MessagesRequest": obj(
            {
                **conversation,
                "max_tokens": {"type": "integer", "minimum": 1},
                "metadata": nullable(obj({"user_id": nullable(STRING)})),
                "stop_sequences": nullable({"type": "array", "items": STRING}),
                "stream": nullable(BOOL),
                "temperature": nullable({"type": "number", "minimum": 0, "maximum": 1}),
                "top_p": nullable({"type": "number", "minimum": 0, "maximum": 1}),
                "top_k": nullable({"type": "integer", "minimum": 0}),
                "thinking": nullable(
                    obj(
                        {
                            "type": {"enum": ["enabled", "disabled", "adaptive"]},
                            "budget_tokens": INT,
                        }
                    )
                ),
            },
            ["model", "messages", "max_tokens"],
        ),
        "CountTokensRequest": obj(conversation, ["model", "messages"]),
        "Message": obj(
            {
                "id": STRING,
                "type": {"const": "message"},
                "role": {"const": "assistant"},
                "model": STRING,
                "content": {"type": "array", "items": block},
                "stop_reason": {"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"]},
                "stop_sequence": {"type": ["string", "null"]},
                "usage": obj(
                    {
                        "input_tokens": COUNT,
                        "output_tokens": COUNT,
                        "cache_read_input_tokens": COUNT,
                        "cache_creation_input_tokens": COUNT,
                    },
                    [
                        "input_tokens",
                        "output_tokens",
                        "cache_read_input_tokens",
                        "cache_creation_input_tokens",
                    ],
                ),
            },
            ["id", "type", "role", "model", "content", "stop_reason", "stop_sequence", "usage"],
        ),
        "TokenCount": obj({"input_tokens": COUNT}, ["input_tokens"]),
        "AnthropicError": obj(
            {
                "type": {"const": "error"},
                "error": obj({"type": STRING, "message": STRING}, ["type", "message"]),
            },
            ["type", "error"],
        ),
    }
