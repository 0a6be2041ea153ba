"""The /openapi.json entries of the routes in proxy/cache_api/inspect.py: requests,
diagnosis, probe, warm."""

from __future__ import annotations

from typing import Any, get_args

from engine_bridge.types import Cause, MissReason

from ..cache_api.inspect import REQUESTS_DEFAULT, REQUESTS_MAX

Schema = dict[str, Any]

_COUNT = {"type": "integer", "minimum": 0}
_STRING = {"type": "string"}
_REASONS = list(get_args(MissReason))  # the request log's reason classes, one source
_CAUSES = list(get_args(Cause))  # the diagnosis's causes, one source
_RATIO = {"type": "number", "minimum": 0, "maximum": 1}


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def _nullable(schema: Schema) -> Schema:
    return {"anyOf": [schema, {"type": "null"}]}


def _obj(properties: dict[str, Schema], description: str = "") -> Schema:
    out: Schema = {"type": "object", "properties": properties, "required": list(properties)}
    if description:
        out["description"] = description
    return out


def schemas() -> dict[str, Schema]:
    alert = _nullable(
        _obj(
            {
                "message": _STRING,
                "hit_ratio": {"type": "number", "minimum": 0, "maximum": 1},
                "threshold": {"type": "number", "minimum": 0, "maximum": 1},
                "window": _COUNT,
            },
            "the hit ratio of the last requests that used the cache is below "
            "[cache] alert_hit_ratio; null when it is not",
        )
    )
    record = _obj(
        {
            "id": _STRING,
            "time": {"type": "number", "description": "unix seconds when it arrived"},
            "model": _STRING,
            "tenant": _STRING,
            "session": _STRING,
            "prompt_tokens": _COUNT,
            "hit_tokens": _COUNT,
            "source": {"enum": ["ram", "ssd", "shared", "none"]},
            "ttft_s": {"type": "number", "minimum": 0},
            "prefill_tok_s": _nullable({"type": "number", "minimum": 0}),
            "diverged_at": _nullable(_COUNT),
            "diverged_message": _nullable(_COUNT),
            "before": _STRING,
            "after": _STRING,
            "reason": {"enum": _REASONS},
        }
    )
    return {
        "CacheAlert": alert,
        "CacheRequest": record,
        "CacheRequests": _obj(
            {"requests": {"type": "array", "items": _ref("CacheRequest")}, "alert": alert}
        ),
        **_diagnosis_schemas(),
        "CacheProbe": _obj(
            {
                "model": _STRING,
                "prompt_tokens": _COUNT,
                "ram_tokens": _COUNT,
                "ssd_tokens": _COUNT,
                "shared_tokens": _COUNT,
                "recompute_tokens": _COUNT,
                "diverged_at": _nullable(_COUNT),
            }
        ),
        "CacheWarm": _obj(
            {
                "model": _STRING,
                "prompt_tokens": _COUNT,
                "cached_tokens": _COUNT,
                "stored_tokens": _COUNT,
                "elapsed_s": {"type": "number", "minimum": 0},
            }
        ),
    }


def _diagnosis_schemas() -> dict[str, Schema]:
    fix = _obj(
        {
            "text": _STRING,
            "key": _nullable(_STRING),
            "value": {
                "description": "the value for key, as JSON (a TOML table is an object); "
                "null when there is no key"
            },
        },
        "what to do: a sentence, and the config key to set and its value when a setting fixes it",
    )
    cause = _obj(
        {
            "cause": {"enum": _CAUSES},
            "tokens": _COUNT,
            "share": {**_RATIO, "description": "of the tokens computed again"},
            "requests": _COUNT,
            "actionable": {"type": "boolean", "description": "whether a setting can help"},
            "fix": _ref("CacheFix"),
        }
    )
    group = _obj(
        {
            "name": _STRING,
            "requests": _COUNT,
            "prompt_tokens": _COUNT,
            "computed_tokens": _COUNT,
            "hit_ratio": _nullable(_RATIO),
            "top_cause": _nullable({"enum": _CAUSES}),
            "top_cause_tokens": _COUNT,
        },
        "one model, tenant or session: its tokens computed again and the cause (new content "
        "aside) that cost the most",
    )
    groups = {"type": "array", "items": _ref("CacheLossGroup")}
    return {
        "CacheFix": fix,
        "CacheLossCause": cause,
        "CacheLossGroup": group,
        "CacheDiagnosis": _obj(
            {
                "window_s": {"type": "number", "exclusiveMinimum": 0},
                "filter": _obj({k: _nullable(_STRING) for k in ("model", "tenant", "session")}),
                "requests": _COUNT,
                "prompt_tokens": _COUNT,
                "cached_tokens": _COUNT,
                "computed_tokens": _COUNT,
                "hit_ratio": _nullable(_RATIO),
                "causes": {
                    "type": "array",
                    "items": _ref("CacheLossCause"),
                    "description": "most tokens first; they add up to computed_tokens",
                },
                "by_model": groups,
                "by_tenant": groups,
                "by_session": {**groups, "description": "those that computed the most"},
            },
            "the window's prompt tokens computed again, ranked by cause, each with its fix",
        ),
    }


def _errors(*statuses: tuple[str, str]) -> Schema:
    either = {"anyOf": [_ref("OpenAIError"), _ref("AnthropicError")]}
    return {
        status: {"description": why, "content": {"application/json": {"schema": either}}}
        for status, why in statuses
    }


def _body_op(summary: str, answer: str, extra_errors: tuple[tuple[str, str], ...]) -> Schema:
    return {
        "summary": summary,
        "tags": ["admin"],
        "parameters": [
            {
                "name": "dialect",
                "in": "query",
                "description": "how to read the body; by default Anthropic when the request "
                "has an anthropic-version header or the body a field only Anthropic's "
                "Messages API has (system, stop_sequences, metadata, thinking, tool_use or "
                "tool_result blocks), else OpenAI",
                "schema": {"enum": ["openai", "anthropic"]},
            },
            {"$ref": "#/components/parameters/Tenant"},
        ],
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {
                    "schema": {
                        "anyOf": [
                            _ref("ChatCompletionRequest"),
                            _ref("MessagesRequest"),
                            _ref("CompletionRequest"),
                        ]
                    }
                }
            },
        },
        "responses": {
            "200": {
                "description": summary,
                "content": {"application/json": {"schema": _ref(answer)}},
            },
            **_errors(
                ("400", "the body is not one the chat route takes; errors in its dialect's shape"),
                ("403", "a Host or Origin not allowed"),
                ("404", "the model is not served here"),
                ("413", "the body is larger than server.max_body_bytes"),
                ("415", "the body is not sent as JSON"),
                *extra_errors,
            ),
        },
    }


def paths() -> dict[str, Schema]:
    return {
        "/v1/cache/requests": {
            "get": {
                "summary": "the last requests: hit, source, TTFT, divergence and why they missed",
                "tags": ["admin"],
                "parameters": [
                    {
                        "name": "limit",
                        "in": "query",
                        "description": f"how many, newest first (default {REQUESTS_DEFAULT})",
                        "schema": {"type": "integer", "minimum": 1, "maximum": REQUESTS_MAX},
                    }
                ],
                "responses": {
                    "200": {
                        "description": "with [tenants] api_keys, only the caller's tenant's",
                        "content": {"application/json": {"schema": _ref("CacheRequests")}},
                    },
                    **_errors(("400", "limit is not an integer from 1 to 500")),
                },
            }
        },
        "/v1/cache/diagnosis": {"get": _diagnosis_op()},
        "/v1/cache/probe": {
            "post": _body_op(
                "what a chat body would restore from RAM and SSD, without running the model",
                "CacheProbe",
                (),
            )
        },
        "/v1/cache/warm": {
            "post": _body_op(
                "prefill and store a chat body's prompt, generating nothing",
                "CacheWarm",
                (
                    ("409", "the cache is off, bypassed, or the model has none"),
                    ("429", "the engine's queue is full; Retry-After says when to retry"),
                ),
            )
        },
    }


def _diagnosis_op() -> Schema:
    def query(name: str, description: str, schema: Schema = _STRING) -> Schema:
        return {"name": name, "in": "query", "description": description, "schema": schema}

    def error(why: str) -> Schema:
        return {
            "description": why,
            "content": {"application/json": {"schema": _ref("OpenAIError")}},
        }

    return {
        "summary": "the prompt tokens computed again in a window, ranked by cause, each with "
        "the setting (or the sentence) that fixes it",
        "tags": ["admin"],
        "parameters": [
            query(
                "window",
                "how far back: a duration such as 90s, 30m or 1h (default 1h)",
                {"type": "string", "examples": ["90s", "30m", "1h"]},
            ),
            query("model", "only this model's requests"),
            query("tenant", "only this tenant's (with [tenants] api_keys: the caller's own only)"),
            query("session", "only this session's"),
        ],
        "responses": {
            "200": {
                "description": "with [tenants] api_keys, only the caller's tenant's",
                "content": {"application/json": {"schema": _ref("CacheDiagnosis")}},
            },
            "400": error("window is not a duration of more than 0 seconds"),
            "401": error("missing or unknown API key (a server reachable from the network)"),
            "403": error("a Host or Origin not allowed, or another tenant named"),
        },
    }
