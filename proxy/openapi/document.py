"""The OpenAPI 3.1 document of the routes the proxy serves itself (GET /openapi.json).

Built in code from what the dialect modules accept (proxy/fields.py and the parsers in
proxy/dialects/openai/ and anthropic.py), so a fuzzer driven by it sends the fields and
types the proxy really reads. Model names are an enum of the models served here: a request
for any other model goes to the upstream, which this document does not describe. Each
dialect's schemas and each group of admin routes live in a module of proxy/openapi/ that
this one merges.
"""

from __future__ import annotations

from collections.abc import Sequence

from aiohttp import web

from ..cache_api import dashboard
from ..generation import BYPASS_HEADER, SESSION_HEADERS
from ..state import ENGINE, SETTINGS
from . import (
    anthropic as openapi_anthropic,
)
from . import (
    inspect as openapi_inspect,
)
from . import (
    metrics as openapi_metrics,
)
from . import (
    openai as openapi_openai,
)
from . import (
    responses as openapi_responses,
)
from . import (
    sessions as openapi_sessions,
)
from .schema import ANY_OBJECT, BOOL, COUNT, INT, STRING, Schema, obj, ref

OPENAPI_VERSION = "3.1.0"
CACHE_SOURCES = ["ram", "ssd", "shared", "none"]


def _other_schemas(model_ids: Sequence[str]) -> dict[str, Schema]:
    settings = {
        "description": "a local model's effective defaults: its [model] settings that are "
        "set, and chat_template_kwargs with the engine's template defaults under them",
        **ANY_OBJECT,
    }
    model_entry = obj(
        {
            "id": STRING,
            "object": {"const": "model"},
            "created": INT,
            "owned_by": STRING,
            "settings": settings,
        },
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
    responses = ("ResponsesRequest", "Response", "OpenAIError")
    paths = {
        "/v1/chat/completions": {"post": _generation_op("OpenAI chat completion", *chat)},
        "/v1/completions": {"post": _generation_op("OpenAI legacy completion", *completion)},
        "/v1/responses": {"post": _generation_op("OpenAI Responses (Codex CLI)", *responses)},
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
                **openapi_openai.schemas(),
                **openapi_responses.schemas(),
                **openapi_anthropic.schemas(),
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
