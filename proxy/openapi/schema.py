"""JSON Schema building blocks that the /openapi.json modules share."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Schema = dict[str, Any]


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
