"""The OpenAPI 3.1 document of the routes the proxy serves itself (GET /openapi.json).

Built in code from what the dialect modules accept (proxy/fields.py and the parsers in
openai_api.py and anthropic_api.py), so a fuzzer driven by it sends the fields and types the
proxy really reads. Model names are an enum of the models served here: a request for any
other model goes to the upstream, which this document does not describe.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aiohttp import web

from . import dashboard, openapi_inspect, openapi_metrics, openapi_sessions
from .generation import BYPASS_HEADER, SESSION_HEADERS
from .state import ENGINE, SETTINGS

Schema = dict[str, Any]

OPENAPI_VERSION = "3.1.0"
CACHE_SOURCES = ["ram", "ssd", "shared", "none"]


def ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def nullable(schema: Schema) -> Schema:
    """The proxy reads an explicit null as "not given" for every optional field."""
    return {"anyOf": [schema, {"type": "null"}]}


def obj(properties: dict[str, Schema], required: Sequence[str] = (), **extra: Any) -> Schema:
    out: Schema = {"type": "object", "properties": properties, **extra}
    if required:
        out["required"] = list(required)
    return out


STRING = {"type": "string"}
INT = {"type": "integer"}
COUNT = {"type": "integer", "minimum": 0}
BOOL = {"type": "boolean"}
ANY_OBJECT = {"type": "object"}


def _openai_schemas() -> dict[str, Schema]:
    text_part = obj({"type": {"enum": ["text", "input_text"]}, "text": STRING}, ["type", "text"])
    content = {
        "description": "A string, or text parts; image and audio parts get a 400",
        "anyOf": [STRING, {"type": "array", "items": text_part}, {"type": "null"}],
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
        },
        ["prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"],
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
                "tool_choice": {"description": '"none" turns tools off; anything else is auto'},
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


def _anthropic_schemas() -> dict[str, Schema]:
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
    user_blocks = {
        "anyOf": [
            ref("TextBlock"),
            obj(
                {
                    "type": {"const": "tool_result"},
                    "tool_use_id": STRING,
                    "content": nullable(text_content),
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
        "tool_choice": obj({"type": {"enum": ["auto", "any", "tool", "none"]}, "name": STRING}),
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


def _other_schemas(model_ids: Sequence[str]) -> dict[str, Schema]:
    model_entry = obj(
        {"id": STRING, "object": {"const": "model"}, "created": INT, "owned_by": STRING},
        ["id", "object"],
    )
    return {
        "LocalModel": {
            "description": "a model served here; any other name is forwarded to the upstream "
            "when it lists it, else a 404",
            "type": "string",
            "enum": list(model_ids),
        },
        "ModelList": obj(
            {"object": {"const": "list"}, "data": {"type": "array", "items": model_entry}},
            ["object", "data"],
        ),
        "LMStudioModelList": obj(
            {
                "object": {"const": "list"},
                "data": {"type": "array", "items": obj({"id": STRING}, ["id"])},
            },
            ["object", "data"],
        ),
        "Health": obj(
            {
                "status": {"const": "ok"},
                "models": {"type": "array", "items": STRING},
                "loaded": {"type": "array", "items": STRING},
            },
            ["status", "models", "loaded"],
        ),
        "CacheStats": obj(
            {
                "requests": ANY_OBJECT,
                "hits": COUNT,
                "misses": COUNT,
                "hit_ratio": {"type": "number", "minimum": 0, "maximum": 1},
                "cache_enabled": BOOL,
                "scheduler": ANY_OBJECT,
                "models": {"type": "array", "items": STRING},
            },
            ["requests", "hits", "misses", "hit_ratio", "cache_enabled", "models"],
            description="per tier bytes and blocks, SSD spills, reloads and latency follow",
        ),
        "SSEEvent": obj(
            {"event": STRING, "data": STRING},
            ["data"],
            description="one server-sent event; OpenAI streams end with data: [DONE]",
        ),
    }


def _parameters(tenant_header: str) -> dict[str, Schema]:
    def header(name: str, description: str, schema: Schema) -> Schema:
        return {"name": name, "in": "header", "description": description, "schema": schema}

    return {
        "Bypass": header(
            BYPASS_HEADER,
            "bypass: the request neither reads nor writes the prompt cache",
            {"enum": ["bypass"]},
        ),
        "Tenant": header(tenant_header, "the cache namespace of this request", STRING),
        **{
            f"Session{i}": header(
                name, "the client's session: fair scheduling, /v1/cache/sessions", STRING
            )
            for i, name in enumerate(SESSION_HEADERS)
        },
    }


def _generation_op(
    summary: str, request: str, response: str, error: str, *, lmstudio: bool = False
) -> Schema:
    """A POST that runs (or counts) a generation, with every answer it can give."""
    cache_headers = {
        "x-prompt-cache-hit-tokens": {
            "description": "prompt tokens the cache supplied",
            "required": True,
            "schema": COUNT,
        },
        "x-prompt-cache-source": {
            "description": "the tier those tokens came from",
            "required": True,
            "schema": {"enum": CACHE_SOURCES},
        },
        "x-prompt-cache-diverged-at": {
            "description": "the token index where the prompt left a sequence the cache "
            "holds, when it did (GET /v1/cache/requests says why)",
            "schema": COUNT,
        },
    }
    counting = response == "TokenCount"
    ok: Schema = {
        "description": "LM Studio's stats, model_info and runtime objects are added"
        if lmstudio
        else "the answer",
        "content": {"application/json": {"schema": ref(response)}},
    }
    if not counting:
        ok["headers"] = cache_headers
        ok["content"]["text/event-stream"] = {"schema": ref("SSEEvent")}
    refusals = {
        "400": "a field is missing, of the wrong type or out of range; the message names it",
        "403": "a Host or Origin not allowed",
        "404": "the model is served neither here nor by the upstream",
        "413": "the body is larger than server.max_body_bytes",
        "415": "the body is not sent as JSON",
        "429": "the engine's queue is full; Retry-After says when to retry",
        "500": "the model failed while generating",
        "502": "the upstream a request was forwarded to failed",
        "503": "the server is shutting down",
        "504": "the upstream a request was forwarded to did not answer in time",
    }
    responses: Schema = {"200": ok}
    for status, why in refusals.items():
        responses[status] = {
            "description": why,
            "content": {"application/json": {"schema": ref(error)}},
        }
    responses["429"]["headers"] = {"Retry-After": {"schema": {"type": "integer", "minimum": 1}}}
    params = ["Tenant", *(f"Session{i}" for i in range(len(SESSION_HEADERS)))]
    if not counting:
        params.insert(0, "Bypass")
    return {
        "summary": summary,
        "tags": ["anthropic" if error == "AnthropicError" else "openai"],
        "parameters": [{"$ref": f"#/components/parameters/{p}"} for p in params],
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": ref(request)}},
        },
        "responses": responses,
    }


def _get_op(summary: str, schema: str, tag: str) -> Schema:
    return {
        "summary": summary,
        "tags": [tag],
        "responses": {
            "200": {
                "description": summary,
                "content": {"application/json": {"schema": ref(schema)}},
            }
        },
    }


def document(model_ids: Sequence[str], tenant_header: str = "x-tenant") -> Schema:
    """The whole document, with `model_ids` as the models a request may name."""
    chat = ("ChatCompletionRequest", "ChatCompletion", "OpenAIError")
    completion = ("CompletionRequest", "Completion", "OpenAIError")
    paths = {
        "/v1/chat/completions": {"post": _generation_op("OpenAI chat completion", *chat)},
        "/v1/completions": {"post": _generation_op("OpenAI legacy completion", *completion)},
        "/v1/messages": {
            "post": _generation_op(
                "Anthropic Messages", "MessagesRequest", "Message", "AnthropicError"
            )
        },
        "/v1/messages/count_tokens": {
            "post": _generation_op(
                "Anthropic token count", "CountTokensRequest", "TokenCount", "AnthropicError"
            )
        },
        "/api/v0/chat/completions": {
            "post": _generation_op("LM Studio REST chat completion", *chat, lmstudio=True)
        },
        "/api/v0/completions": {
            "post": _generation_op("LM Studio REST completion", *completion, lmstudio=True)
        },
        "/v1/models": {"get": _get_op("local models, then the upstream's", "ModelList", "models")},
        "/api/v0/models": {
            "get": _get_op("local models in LM Studio's shape", "LMStudioModelList", "models")
        },
        "/health": {"get": _get_op("liveness and the models served", "Health", "admin")},
        "/v1/cache/stats": {"get": _get_op("prompt cache counters", "CacheStats", "admin")},
        **openapi_sessions.paths(),
        **dashboard.openapi_paths(),
        **openapi_inspect.paths(),
        **openapi_metrics.paths(),
        "/openapi.json": {
            "get": {
                "summary": "this document",
                "tags": ["admin"],
                "responses": {
                    "200": {
                        "description": "OpenAPI 3.1",
                        "content": {"application/json": {"schema": ANY_OBJECT}},
                    }
                },
            }
        },
    }
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "mlx-prompt-cache",
            "version": "0.1.0",
            "description": "The routes the proxy serves itself. Every other path, and a "
            "request for a model not served here, is forwarded to the LM Studio upstream "
            "unchanged. Client errors are 4xx in the dialect's own error shape, naming the "
            "field at fault.",
        },
        "paths": paths,
        "components": {
            "schemas": {
                **_openai_schemas(),
                **_anthropic_schemas(),
                **_other_schemas(model_ids),
                **openapi_sessions.schemas(),
                **openapi_inspect.schemas(),
            },
            "parameters": _parameters(tenant_header),
        },
    }


async def serve(request: web.Request) -> web.Response:
    settings = request.app[SETTINGS]
    return web.json_response(document(request.app[ENGINE].model_ids, settings.tenant_header))
