"""OpenAPI documents of the session routes and DELETE /v1/cache (see proxy/cache_api/admin.py);
openapi.document merges `paths()` and `schemas()` into the whole."""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]

_STRING = {"type": "string"}
_COUNT = {"type": "integer", "minimum": 0}


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def schemas() -> dict[str, Schema]:
    session = {
        "type": "object",
        "properties": {
            "id": _STRING,
            "tenant": _STRING,
            "model": _STRING,
            "last_used": {"type": "number", "description": "unix seconds"},
            "tokens": {**_COUNT, "description": "leading tokens still cached, RAM or SSD"},
            "ram_bytes": {**_COUNT, "description": "RAM held by entries only it references"},
            "ssd_bytes": {**_COUNT, "description": "SSD held by entries only it references"},
            "shared_bytes": {**_COUNT, "description": "RAM + SSD of entries it shares"},
            "pinned": {"type": "boolean"},
        },
        "required": [
            "id", "tenant", "model", "last_used", "tokens", "ram_bytes", "ssd_bytes",
            "shared_bytes", "pinned",
        ],
    }  # fmt: skip
    return {
        "Session": session,
        "SessionList": {
            "type": "object",
            "properties": {"sessions": {"type": "array", "items": _ref("Session")}},
            "required": ["sessions"],
        },
        "SessionDeleted": {
            "type": "object",
            "properties": {"id": _STRING, "deleted": {"const": True}, "freed_bytes": _COUNT},
            "required": ["id", "deleted", "freed_bytes"],
        },
        "SessionPinned": {
            "type": "object",
            "properties": {"id": _STRING, "pinned": {"type": "boolean"}},
            "required": ["id", "pinned"],
        },
        "CacheCleared": {
            "type": "object",
            "properties": {"deleted_entries": _COUNT, "freed_bytes": _COUNT},
            "required": ["deleted_entries", "freed_bytes"],
        },
    }


def _op(summary: str, schema: str, errors: dict[str, str], params: list[Schema]) -> Schema:
    responses: Schema = {
        "200": {"description": summary, "content": {"application/json": {"schema": _ref(schema)}}}
    }
    common = {
        "401": "missing or unknown API key (a server reachable from the network)",
        "403": "a Host or Origin not allowed, or another tenant named",
    }
    for status, why in {**common, **errors}.items():
        responses[status] = {
            "description": why,
            "content": {"application/json": {"schema": _ref("OpenAIError")}},
        }
    return {"summary": summary, "tags": ["cache"], "parameters": params, "responses": responses}


def _query(name: str, description: str) -> Schema:
    return {"name": name, "in": "query", "required": False, "description": description,
            "schema": _STRING}  # fmt: skip


_ID = {
    "name": "id",
    "in": "path",
    "required": True,
    "description": "the session id as listed (any characters, URL-encoded)",
    "schema": _STRING,
}
_TENANT = _query("tenant", "only this tenant (with API keys: the caller's own only)")


def paths() -> dict[str, Schema]:
    unknown = {"404": "no session with this id (for this tenant)"}
    return {
        "/v1/cache/sessions": {
            "get": _op(
                "cached client sessions, most recently used first", "SessionList", {}, [_TENANT]
            )
        },
        "/v1/cache/sessions/{id}": {
            "delete": _op(
                "drop what only this session cached, from RAM and SSD, once its running "
                "generations end; what it shares with other sessions stays",
                "SessionDeleted",
                unknown,
                [_ID, _TENANT],
            )
        },
        "/v1/cache/sessions/{id}/pin": {
            "post": _op(
                "keep this session's RAM entries from eviction",
                "SessionPinned",
                {**unknown, "409": "pinning it would pass [cache] pin_max"},
                [_ID, _TENANT],
            )
        },
        "/v1/cache/sessions/{id}/unpin": {
            "post": _op(
                "let this session be evicted again", "SessionPinned", unknown, [_ID, _TENANT]
            )
        },
        "/v1/cache": {
            "delete": _op(
                "drop every cached entry no request is using, optionally of one model or tenant",
                "CacheCleared",
                {"400": "model is given but empty", "404": "the model is not served here"},
                [_query("model", "a served model id"), _TENANT],
            )
        },
    }
