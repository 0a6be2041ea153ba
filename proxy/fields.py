"""Reading request bodies and typed fields, with errors that name the field at fault."""

from __future__ import annotations

import json
import reprlib
from typing import Any

import orjson
from aiohttp import web

from .errors import ApiError

_MISSING = object()


async def read_body(request: web.Request, max_bytes: int) -> bytes:
    if request.content_length is not None and request.content_length > max_bytes:
        raise _too_large(request.content_length, max_bytes)
    data = bytearray()
    async for chunk in request.content.iter_chunked(1 << 16):
        data += chunk
        if len(data) > max_bytes:
            raise _too_large(len(data), max_bytes)
    return bytes(data)


def header(request: web.Request, name: str) -> str:
    """A request header as text ("" when absent). aiohttp decodes header bytes that are not
    UTF-8 as lone surrogates, which every encoder below (hashing, SQLite) refuses with a
    500, so such a header is the client's mistake: a 400 naming it."""
    value = request.headers.get(name, "")
    if not _encodes(value):
        raise ApiError(400, f"{name}: header is not valid UTF-8", param=name, code="invalid_header")
    return value


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(
        413,
        f"request body is larger than the limit of {limit} bytes "
        f"(server.max_body_bytes); got at least {size} bytes",
        code="request_too_large",
    )


def parse_json_object(body: bytes) -> dict[str, Any]:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"request body is not valid UTF-8: {e}", code="invalid_utf8") from None
    if not text.strip():
        raise ApiError(400, "request body is empty; expected a JSON object", code="invalid_json")
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError as e:
        raise _not_json(text, e) from None
    if not isinstance(value, dict):
        raise ApiError(
            400,
            f"request body must be a JSON object, got {type(value).__name__}",
            code="invalid_json",
        )
    _check_depth(value)
    return value


def _not_json(text: str, error: orjson.JSONDecodeError) -> ApiError:
    """The 400 for a body orjson refuses; a lone surrogate escape ("\\udcff", valid JSON
    syntax but no character, so no UTF-8 text holds it) is named by the field it is in."""
    found = _lone_surrogate(text) if "surrogate" in str(error) else None
    if found is None:
        return ApiError(400, f"request body is not valid JSON: {error}", code="invalid_json")
    where, what = found
    return ApiError(
        400,
        f"{where}: {what} holds a lone surrogate escape (\\ud800-\\udfff without its "
        "pair), which is not a character (I-JSON, RFC 7493)",
        param=where,
        code="invalid_json",
    )


def _lone_surrogate(text: str) -> tuple[str, str] | None:
    """Where the first string in `text` that holds a lone surrogate is (a key: its object)
    and whether it is a value or a key; stdlib json keeps lone surrogates where orjson
    refuses them. Only for naming the field."""
    try:
        body = json.loads(text)
    except (ValueError, RecursionError):
        return None
    stack: list[tuple[Any, tuple | None]] = [(body, None)]
    while stack:
        value, trail = stack.pop()
        if isinstance(value, str):
            if not _encodes(value):
                return _path(trail) or "request body", "the string"
        elif isinstance(value, dict):
            if not all(_encodes(k) for k in value):
                return _path(trail) or "request body", "a key"
            stack.extend((v, (trail, k)) for k, v in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend((v, (trail, i)) for i, v in reversed(list(enumerate(value))))
    return None


def _encodes(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# JSON nests up to 1024 levels before orjson.loads refuses it, but chat templates,
# json.dumps and repr() recurse on Python's stack and fail near 1000 (a template fed a tool
# schema 500 deep blamed "messages"; the prefix hash raised RecursionError, a 500). This is
# orjson.dumps' own limit, so a C-speed dumps is the check, ~4 ms for a 4 MB body where a
# walk in Python takes 80; the walk runs only to name the field. Real bodies, JSON Schemas
# of tools included, nest a few dozen levels.
MAX_DEPTH = 254


def _check_depth(body: dict) -> None:
    try:
        orjson.dumps(body)
    except orjson.JSONEncodeError:
        where = _too_deep(body) or "request body"
        raise ApiError(
            400, f"{where}: nested deeper than {MAX_DEPTH} levels", param=where
        ) from None


def _too_deep(body: dict) -> str | None:
    """The path of the first container nested MAX_DEPTH levels inside the body, if any."""
    containers = (dict, list)
    stack: list[tuple[Any, int, tuple | None]] = [(body, 0, None)]
    while stack:
        value, depth, trail = stack.pop()
        if depth >= MAX_DEPTH:
            return _path(trail)
        items = value.items() if isinstance(value, dict) else enumerate(value)
        # Only containers go on the stack: a long list of token ids costs one pass.
        stack.extend((v, depth + 1, (trail, k)) for k, v in items if isinstance(v, containers))
    return None


def _path(trail: tuple | None) -> str:
    keys = []
    while trail is not None:
        trail, key = trail
        keys.append(key)
    keys.reverse()
    out = ""
    for key in keys[:8]:  # enough to find the field; the rest is the same nesting
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return out + ("..." if len(keys) > 8 else "")


def _type_error(name: str, expected: str, value: Any) -> ApiError:
    return ApiError(
        400,
        f"{name}: expected {expected}, got {type(value).__name__} {short(value)}",
        param=name,
    )


# A client's value shown in an error: bounded in depth as well as length, since plain
# repr() of a value nested a thousand deep raises RecursionError (a 500, not a 400).
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 40, 40


def short(value: Any) -> str:
    text = _REPR.repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def get_str(
    body: dict,
    name: str,
    default: Any = _MISSING,
    *,
    nonempty: bool = False,
    where: str | None = None,
) -> Any:
    """`where` names a nested field in errors (`metadata.user_id` for `user_id`)."""
    where = where or name
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        if default is _MISSING:
            raise ApiError(400, f"{where}: field required", param=where)
        return default
    if not isinstance(value, str):
        raise _type_error(where, "a string", value)
    if nonempty and not value:
        raise ApiError(400, f"{where}: must not be empty", param=where)
    return value


def get_int(
    body: dict, name: str, default: Any = None, *, lo: int | None = None, hi: int | None = None
) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise _type_error(name, "an integer", value)
    _check_range(name, value, lo, hi)
    return value


def get_float(
    body: dict, name: str, default: Any = None, *, lo: float | None = None, hi: float | None = None
) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _type_error(name, "a number", value)
    _check_range(name, value, lo, hi)
    return float(value)


def get_bool(body: dict, name: str, default: bool = False, *, where: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _type_error(where or name, "a boolean", value)
    return value


def get_list(body: dict, name: str, default: Any = None, *, nonempty: bool = False) -> Any:
    value = body.get(name)
    if value is None:
        if default is None and nonempty:
            raise ApiError(400, f"{name}: field required", param=name)
        return default
    if not isinstance(value, list):
        raise _type_error(name, "an array", value)
    if nonempty and not value:
        raise ApiError(400, f"{name}: must contain at least one item", param=name)
    return value


def get_dict(body: dict, name: str, default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, dict):
        raise _type_error(name, "an object", value)
    return value


def get_stop(body: dict, name: str) -> list[str]:
    value = body.get(name)
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise _type_error(name, "a string or an array of strings", value)


def _check_range(name: str, value: float, lo: float | None, hi: float | None) -> None:
    if lo is not None and value < lo:
        raise ApiError(400, f"{name}: must be >= {lo}, got {value}", param=name)
    if hi is not None and value > hi:
        raise ApiError(400, f"{name}: must be <= {hi}, got {value}", param=name)
