"""Dialect-neutral glue: start a generation, learn the cache hit, then stream parts."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from engine_bridge.engine import Engine
from engine_bridge.stream import GenerationStream, OutputParser
from engine_bridge.types import (
    GenerationRequest,
    GenerationResult,
    PromptInfo,
    TokenEvent,
    conversation_id,
)

from . import fields as f
from .config.model_settings import SAMPLING_FIELDS
from .dialects.output import Part
from .errors import ApiError
from .security import api_key
from .state import ENGINE, REQUEST_ID, SETTINGS

BYPASS_HEADER = "x-prompt-cache"
# `x-speculative: off` decodes this request without speculation, for comparisons.
SPECULATIVE_HEADER = "x-speculative"


@dataclass(slots=True)
class Generation:
    """A started generation, parsed into the parts a dialect writes out."""

    stream: GenerationStream
    parser: OutputParser
    # Output tokens of the reasoning block, its markers included: each token read while
    # the parser was inside it, before or after its text. Counted per token, not per event:
    # an event carries every token since the last (a multi-byte character's pieces).
    reasoning_tokens: int = 0

    @property
    def info(self) -> PromptInfo:
        return self.stream.info

    @property
    def result(self) -> GenerationResult | None:
        return self.stream.result

    @property
    def use_cache(self) -> bool:
        return self.stream.use_cache

    @property
    def context_length(self) -> int:
        return self.stream.context_length

    async def parts(self) -> AsyncIterator[Part]:
        async for event in self.stream:
            if isinstance(event, TokenEvent):
                before = self.parser.in_reasoning
                parts = self.parser.feed(event.text)
                if before or self.parser.in_reasoning:
                    self.reasoning_tokens += event.tokens
                for part in parts:
                    yield part
        result = self.stream.result
        for part in self.parser.finish(result.finish_reason if result else "stop"):
            yield part

    async def aclose(self) -> None:
        await self.stream.aclose()

    @property
    def headers(self) -> dict[str, str]:
        return cache_headers(self.info)


def cache_headers(info: PromptInfo) -> dict[str, str]:
    headers = {
        "x-prompt-cache-hit-tokens": str(info.cached_tokens),
        "x-prompt-cache-source": info.source,
    }
    if info.diverged_at is not None:
        # Where the prompt left a sequence the cache holds: GET /v1/cache/requests says why.
        headers["x-prompt-cache-diverged-at"] = str(info.diverged_at)
    return headers


def request_options(request: web.Request) -> tuple[str, bool]:
    """The tenant and whether the cache may be used, from the request's headers."""
    settings = request.app[SETTINGS]
    tenant = settings.default_tenant
    header = f.header(request, settings.tenant_header)
    key = api_key(request)
    if key and key in settings.tenant_api_keys:
        # A key's tenant is who the caller is: a header must not pick another tenant's cache.
        tenant = settings.tenant_api_keys[key]
    elif header:
        tenant = header
    bypass = request.headers.get(BYPASS_HEADER, "").strip().lower() == "bypass"
    return tenant, not bypass and settings.cache_enabled


# Who is asking, for fair scheduling and the sessions of /v1/cache/sessions; the body's
# own id comes after these.
SESSION_HEADERS = ("X-Claude-Code-Session-Id", "x-session-id")
# Longer ids are kept as a hash: the registry and its listing stay small whatever a client
# sends (ids are data only, never part of a file path).
SESSION_ID_MAX = 256


def session_id(request: web.Request, from_body: str | None) -> str:
    """The client's session: a session header, else the dialect's user field, else ""
    (`start` then names the session after the conversation's first user message)."""
    for name in SESSION_HEADERS:
        if value := f.header(request, name).strip():
            return bounded_id(value)
    return bounded_id(from_body or "")


def bounded_id(value: str) -> str:
    """The id as sent, or a hash of it when it is too long, or only dots ("." and ".."
    are path segments that clients resolve away: DELETE /v1/cache/sessions/.. would reach
    DELETE /v1/cache)."""
    if len(value) <= SESSION_ID_MAX and (not value or value.strip(".")):
        return value
    return "id-" + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def speculative(request: web.Request) -> bool:
    """Whether the request lets the engine speculate: anything but `x-speculative: off`."""
    value = request.headers.get(SPECULATIVE_HEADER)
    if value is None:
        return True
    value = value.strip().lower()
    if value not in ("on", "off", "auto"):
        raise ApiError(400, f"{SPECULATIVE_HEADER}: expected on, off or auto, got {value!r}",
                       param=SPECULATIVE_HEADER)  # fmt: skip
    return value != "off"


# Where the OpenAI dialects' bodies name the output limit (chat and legacy completions).
OPENAI_MAX_FIELDS = ("max_completion_tokens", "max_tokens")


@dataclass(frozen=True, slots=True)
class Given:
    """The defaultable fields a body set itself; the model's settings fill only the rest."""

    sampling: frozenset[str] = frozenset()
    max_tokens: bool = False

    @classmethod
    def of(
        cls,
        body: dict,
        sampling: tuple[str, ...] = SAMPLING_FIELDS,
        max_fields: tuple[str, ...] = OPENAI_MAX_FIELDS,
    ) -> Given:
        """`sampling` and `max_fields`: the names the dialect reads; null counts as unset,
        as the field parsers read it."""
        return cls(
            frozenset(n for n in sampling if body.get(n) is not None),
            any(body.get(n) is not None for n in max_fields),
        )


def shown_settings(app: web.Application, model_id: str) -> dict[str, Any]:
    """What a request that sets nothing gets from local model `model_id`, as the model
    lists show it: its [model."<pattern>"] settings over the template's default kwargs."""
    engine = app[ENGINE]
    settings = app[SETTINGS].model_settings.resolve(model_id)
    return settings.effective(engine.template_defaults(model_id))


def apply_model_settings(req: GenerationRequest, request: web.Request, given: Given) -> bool:
    """Fill what the body left unset from the model's `[model."<pattern>"]` settings; the
    template kwargs go under the request's own. True when they chose max_tokens."""
    settings = request.app[SETTINGS].model_settings.resolve(req.model)
    for name in SAMPLING_FIELDS:
        value = getattr(settings, name)
        if value is not None and name not in given.sampling:
            setattr(req.sampling, name, value)
    if settings.restore_reasoning is not None:
        req.restore_reasoning = settings.restore_reasoning
    if settings.chat_template_kwargs:
        # The request's kwargs, reasoning_effort and Anthropic's thinking among them, win.
        req.template_kwargs = {**settings.chat_template_kwargs, **req.template_kwargs}
    if settings.max_tokens is None or given.max_tokens:
        return False
    req.max_tokens = settings.max_tokens
    return True


async def start(
    engine: Engine,
    req: GenerationRequest,
    request: web.Request,
    given: Given,
    raw: bool = False,
) -> Generation:
    """Fill in the model's settings, validate and queue the request; returns once the
    cache lookup is done. `given`: what the body set itself."""
    req.request_id = request.get(REQUEST_ID, "")
    if apply_model_settings(req, request, given):
        # A configured limit is a default, not a demand: past the context it means "up to
        # the context" (one the client sent is checked, and refused, by the engine).
        await engine.load(req.model)
        context = engine.model_info(req.model).context_length
        req.max_tokens = min(req.max_tokens, context or req.max_tokens)
    req.speculative = speculative(request)
    if not req.session:
        req.session = conversation_id(req.messages)
    # EngineError (a 4xx, or 429 when the queue is full) and GenerationFailed propagate:
    # the app's middleware maps every error to the dialect's shape in one place.
    stream = await engine.start(req)
    return Generation(stream, stream.parser(raw=raw))
