"""A small client for LM Studio's own REST API: which models it holds, and unloading one.

LM Studio 0.4+ serves the v1 API (https://lmstudio.ai/docs/developer/rest/list and
/unload): ``GET /api/v1/models`` answers ``{"models": [{"key", "publisher", "type",
"format", "size_bytes", "loaded_instances": [{"id", "config"}], ...}]}`` and
``POST /api/v1/models/unload`` takes ``{"instance_id": ...}``. Older versions (0.3.x)
only have the v0 API (https://lmstudio.ai/docs/api/rest-api): ``GET /api/v0/models``
answers ``{"data": [{"id", "publisher", "state": "loaded"|"not-loaded", ...}]}`` and has
no unload. Both send ``Authorization: Bearer <token>`` when LM Studio requires a token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
import orjson

# Listing and unloading are quick; a hung LM Studio must not hold a model load for long.
REST_TIMEOUT_S = 5.0


class LmStudioError(Exception):
    """LM Studio could not be asked: unreachable, no REST API there, or a bad answer."""


class UnloadRefused(LmStudioError):
    """LM Studio answered an unload with a non-2xx status."""

    def __init__(self, instance_id: str, status: int, body: str):
        super().__init__(f"HTTP {status}: {body[:200]}" if body else f"HTTP {status}")
        self.instance_id = instance_id
        self.status = status


@dataclass(frozen=True, slots=True)
class LmsModel:
    """One model LM Studio knows, with the ids of its loaded instances."""

    key: str  # v1 `key`, v0 `id`
    publisher: str | None
    type: str | None  # "llm", "vlm", "embedding(s)"
    format: str | None  # "mlx", "gguf"
    size_bytes: int | None  # v1 only
    instances: tuple[str, ...]  # v1: loaded_instances[].id; v0: (id,) when state is loaded


@dataclass(frozen=True, slots=True)
class Listing:
    api: Literal["v1", "v0"]
    models: list[LmsModel]

    @property
    def can_unload(self) -> bool:
        return self.api == "v1"  # v0 has no unload endpoint

    @property
    def loaded(self) -> list[LmsModel]:
        return [m for m in self.models if m.instances]


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _v1_model(raw: Any) -> LmsModel | None:
    if not isinstance(raw, dict) or _text(raw.get("key")) is None:
        return None
    instances = raw.get("loaded_instances")
    ids = tuple(
        i["id"]
        for i in (instances if isinstance(instances, list) else [])
        if isinstance(i, dict) and _text(i.get("id"))
    )
    size = raw.get("size_bytes")
    return LmsModel(
        key=raw["key"],
        publisher=_text(raw.get("publisher")),
        type=_text(raw.get("type")),
        format=_text(raw.get("format")),
        size_bytes=size if isinstance(size, int) and not isinstance(size, bool) else None,
        instances=ids,
    )


def _v0_model(raw: Any) -> LmsModel | None:
    if not isinstance(raw, dict) or _text(raw.get("id")) is None:
        return None
    return LmsModel(
        key=raw["id"],
        publisher=_text(raw.get("publisher")),
        type=_text(raw.get("type")),
        format=_text(raw.get("compatibility_type")),
        size_bytes=None,
        instances=(raw["id"],) if raw.get("state") == "loaded" else (),
    )


class LmStudioRest:
    """``async with LmStudioRest(url, token) as lms: await lms.models()``; one session each."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        timeout_s: float = REST_TIMEOUT_S,
        connect_timeout_s: float = 2.0,
    ):
        self.url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> LmStudioRest:
        self._session = aiohttp.ClientSession(timeout=self._timeout, headers=self._headers)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _request(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        assert self._session is not None, "use LmStudioRest as `async with`"
        try:
            async with self._session.request(method, self.url + path, json=body) as r:
                return r.status, await r.read()
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            reason = "timed out" if isinstance(exc, TimeoutError) else str(exc)
            raise LmStudioError(
                f"unreachable at {self.url} ({reason or type(exc).__name__})"
            ) from exc

    def _json(self, path: str, raw: bytes) -> Any:
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise LmStudioError(f"{self.url}{path} answered something that is not JSON") from None

    async def models(self) -> Listing:
        """What LM Studio knows and holds: v1, or v0 where v1 is not there (404)."""
        status, raw = await self._request("GET", "/api/v1/models")
        if status == 200:
            doc = self._json("/api/v1/models", raw)
            items = doc.get("models") if isinstance(doc, dict) else None
            if not isinstance(items, list):
                raise LmStudioError(f"{self.url}/api/v1/models has no models list")
            return Listing("v1", [m for m in map(_v1_model, items) if m is not None])
        if status != 404:
            raise self._refused("/api/v1/models", status, raw)
        status, raw = await self._request("GET", "/api/v0/models")
        if status == 404:
            raise LmStudioError(f"no LM Studio REST API at {self.url} (/api/v1 and /api/v0: 404)")
        if status != 200:
            raise self._refused("/api/v0/models", status, raw)
        doc = self._json("/api/v0/models", raw)
        items = doc.get("data") if isinstance(doc, dict) else None
        if not isinstance(items, list):
            raise LmStudioError(f"{self.url}/api/v0/models has no data list")
        return Listing("v0", [m for m in map(_v0_model, items) if m is not None])

    async def unload(self, instance_id: str) -> None:
        """Unload one loaded instance (v1 only); raises UnloadRefused on a non-2xx answer."""
        status, raw = await self._request(
            "POST", "/api/v1/models/unload", {"instance_id": instance_id}
        )
        if not 200 <= status < 300:
            raise UnloadRefused(instance_id, status, raw.decode("utf-8", "replace").strip())

    def _refused(self, path: str, status: int, raw: bytes) -> LmStudioError:
        hint = (
            " (set [upstream] api_token to LM Studio's API token)" if status in (401, 403) else ""
        )
        body = raw.decode("utf-8", "replace").strip()[:200]
        return LmStudioError(f"{self.url}{path} answered HTTP {status}{hint}: {body}")
