"""Dialect-neutral glue: start a generation, learn the cache hit, then stream parts."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiohttp import web

from engine_bridge.engine import Engine
from engine_bridge.types import (
    EngineError,
    GenerationRequest,
    GenerationResult,
    PromptInfo,
    TokenEvent,
)

from .errors import ApiError
from .output import OutputParser, Part
from .state import REQUEST_ID, SETTINGS

BYPASS_HEADER = "x-prompt-cache"


@dataclass(slots=True)
class Generation:
    """A running generation whose prompt has been prefilled (or at least looked up)."""

    info: PromptInfo
    parser: OutputParser
    _events: AsyncIterator
    use_cache: bool = True
    context_length: int = 0
    result: GenerationResult | None = None

    async def parts(self) -> AsyncIterator[Part]:
        async for event in self._events:
            if isinstance(event, TokenEvent):
                for part in self.parser.feed(event.text):
                    yield part
            elif isinstance(event, GenerationResult):
                self.result = event
        for part in self.parser.finish():
            yield part

    async def aclose(self) -> None:
        await self._events.aclose()

    @property
    def headers(self) -> dict[str, str]:
        return cache_headers(self.info)


def cache_headers(info: PromptInfo) -> dict[str, str]:
    return {
        "x-prompt-cache-hit-tokens": str(info.cached_tokens),
        "x-prompt-cache-source": info.source,
    }


def request_options(request: web.Request) -> tuple[str, bool]:
    """The tenant and whether the cache may be used, from the request's headers."""
    settings = request.app[SETTINGS]
    tenant = settings.default_tenant
    header = request.headers.get(settings.tenant_header)
    key = _api_key(request)
    if header:
        tenant = header
    elif key and key in settings.tenant_api_keys:
        tenant = settings.tenant_api_keys[key]
    bypass = request.headers.get(BYPASS_HEADER, "").strip().lower() == "bypass"
    return tenant, not bypass and settings.cache_enabled


def _api_key(request: web.Request) -> str | None:
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return request.headers.get("x-api-key")


async def start(
    engine: Engine, req: GenerationRequest, request: web.Request, raw: bool = False
) -> Generation:
    """Prepare and queue the request; returns once the cache lookup is done."""
    req.request_id = request.get(REQUEST_ID, "")
    try:
        runner, job = await engine.prepare(req)
    except EngineError as e:
        raise ApiError(e.status, e.message, param=e.field) from None
    events = engine.run(runner, job)
    first = await anext(events)
    assert isinstance(first, PromptInfo), f"runner must report the prompt first, got {first!r}"
    in_reasoning = job.prompt.text.rstrip().endswith("<think>")
    parser = OutputParser(in_reasoning=in_reasoning, parse_tools=bool(req.tools), raw=raw)
    return Generation(
        first,
        parser,
        events,
        use_cache=req.use_cache,
        context_length=runner.loaded.context_length,
    )
