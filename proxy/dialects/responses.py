"""OpenAI Responses dialect: POST /v1/responses (Codex CLI), served in-process and cached.

The body becomes the same neutral request the chat dialect builds (responses_items.py),
so a conversation renders, and hits the cache, as it would through /v1/chat/completions.
The answer is a `response` object, or its event stream: response.created, then each
output item's events (reasoning as a summary, message text, function calls), then
response.completed. A request for a model not served here goes to the upstream
(app.json_route decides, as for the chat routes).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from engine_bridge.types import EngineError, GenerationRequest

from .. import fields as f
from ..errors import ApiError, api_error
from ..generation import Generation, Given, bounded_id, request_options, session_id, start
from ..state import ENGINE
from .openai.chat import thinking_for_effort
from .openai.shared import parse_sampling
from .response_store import Items, ResponseStore
from .responses_items import (
    ToolSet,
    arrange,
    input_items,
    parse_items,
    parse_tool_choice,
    parse_tools,
)
from .responses_output import Emit, Output, new_id, usage
from .sse import SSEWriter

log = logging.getLogger("proxy.dialects.responses")

ROUTE = "/v1/responses"
# Without max_output_tokens a turn may run to the end of the context, as OpenAI's does, but
# the scheduler reserves room for prompt + max_tokens: a 256k context would be reserved
# whole for every turn. Codex's longest turns (a large patch) stay well below this.
DEFAULT_MAX_OUTPUT = 32768
# After the generic session headers: a thread is one conversation (Codex runs sub-agents as
# threads of one session, and the request log compares each session's turns in order).
THREAD_HEADERS = ("thread-id", "conversation_id")
SESSION_HEADERS = ("session-id", "session_id")

STORE = web.AppKey("responses_store", ResponseStore)


@dataclass(slots=True)
class Plan:
    """A parsed body: the neutral request, and what the response object echoes."""

    req: GenerationRequest
    tools: ToolSet
    items: Items  # the whole conversation's input items, the stored ones first
    stream: bool
    store: bool
    echo: dict[str, Any]
    max_field: str | None  # the field max_tokens came from; None: the default
    given: Given  # what the body set, which the model's settings leave alone


def session_of(request: web.Request, body: dict) -> str:
    if found := session_id(request, None):
        return found
    for name in THREAD_HEADERS:
        if value := f.header(request, name).strip():
            return bounded_id(value)
    key = f.get_str(body, "prompt_cache_key", None)
    if key:
        return bounded_id(key)
    for name in SESSION_HEADERS:
        if value := f.header(request, name).strip():
            return bounded_id(value)
    return bounded_id(f.get_str(body, "user", None) or "")


def _template_kwargs(body: dict) -> tuple[dict[str, Any], dict[str, Any] | None]:
    kwargs = dict(f.get_dict(body, "chat_template_kwargs", {}) or {})
    reasoning = f.get_dict(body, "reasoning")
    if reasoning is None:
        return kwargs, None
    effort = f.get_str(reasoning, "effort", None, where="reasoning.effort")
    if effort is not None:
        thinking_for_effort(kwargs, effort, "reasoning.effort")
        if effort in ("low", "medium", "high", "xhigh"):  # gpt-oss's harmony template
            kwargs.setdefault("reasoning_effort", "high" if effort == "xhigh" else effort)
    return kwargs, {"effort": effort, "summary": reasoning.get("summary")}


def _stored(store: ResponseStore, previous: str, tenant: str) -> Items:
    """The stored conversation `previous` ended with, or the 400 OpenAI sends for an id it
    does not have (code previous_response_not_found), saying why it is not here."""
    found = store.get(previous, tenant)
    if found is not None:
        return found
    n = store.max_bytes
    bound = f"{n / (1 << 20):.0f} MB" if n >= 1 << 20 else f"{n} bytes"
    if store.was_evicted(previous, tenant):
        why = (
            f"was evicted: stored responses are kept in memory up to {bound}, the least "
            "recently used dropped first"
        )
    else:
        why = (
            f"is not stored here (responses are kept in memory, up to {bound}, only with "
            "store not false, and not across restarts)"
        )
    raise ApiError(
        400,
        f"previous_response_id: response {f.short(previous)} {why}; send the whole history instead",
        param="previous_response_id",
        code="previous_response_not_found",
    )


def build(request: web.Request, body: dict) -> Plan:
    model = f.get_str(body, "model", nonempty=True)
    if f.get_bool(body, "background"):
        raise ApiError(
            400, "background: background responses are not supported", param="background"
        )
    if body.get("conversation") is not None:
        raise ApiError(
            400,
            "conversation: conversations are not stored here; send previous_response_id "
            "or the whole history",
            param="conversation",
        )
    tenant, use_cache = request_options(request)
    previous = f.get_str(body, "previous_response_id", None)
    prior: Items = ()
    if previous is not None:
        prior = _stored(request.app[STORE], previous, tenant)
    new = input_items(body, required=previous is None)
    items = (*prior, *new)
    tools = parse_tools(body)
    tool_choice = parse_tool_choice(body, tools)

    def where(i: int) -> str:
        return f"input[{i - len(prior)}]" if i >= len(prior) else f"previous_response_id[{i}]"

    instructions = f.get_str(body, "instructions", None)
    messages = arrange(instructions, parse_items(items, tools, where))
    if not messages:
        raise ApiError(400, "input: must contain at least one item", param="input")
    # include (reasoning.encrypted_content, ...) asks for what is never made here.
    if not all(isinstance(v, str) for v in f.get_list(body, "include") or []):
        raise ApiError(400, "include: expected an array of strings", param="include")
    kwargs, reasoning = _template_kwargs(body)
    max_field = next(
        (n for n in ("max_output_tokens", "max_tokens") if body.get(n) is not None), None
    )
    max_tokens = f.get_int(body, max_field, lo=1) if max_field else DEFAULT_MAX_OUTPUT
    store = f.get_bool(body, "store", True)
    req = GenerationRequest(
        model=model,
        messages=messages,
        tools=tools.template or None,
        tool_choice=tool_choice,
        max_tokens=max_tokens,
        sampling=parse_sampling(body),
        tenant=tenant,
        use_cache=use_cache,
        template_kwargs=kwargs,
        session=session_of(request, body),
    )
    echo = {
        "instructions": instructions,
        "max_output_tokens": max_tokens if max_field else None,
        "metadata": f.get_dict(body, "metadata", {}),
        "parallel_tool_calls": tool_choice.parallel,
        "previous_response_id": previous,
        "prompt_cache_key": f.get_str(body, "prompt_cache_key", None),
        "reasoning": reasoning,
        "store": store,
        "text": f.get_dict(body, "text", {"format": {"type": "text"}}),
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "truncation": "disabled",
        "user": f.get_str(body, "user", None),
    }
    given = Given.of(body, max_fields=("max_output_tokens", "max_tokens"))
    return Plan(req, tools, items, f.get_bool(body, "stream"), store, echo, max_field, given)


class Answer:
    """One response being answered: its id and the `response` object at each stage."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.id = new_id("resp")
        self.created = int(time.time())

    def json(self, status: str, output: list, **extra: Any) -> dict[str, Any]:
        # Sampling as the request ran: a model's [model."…"] settings may have filled it.
        sampling = self.plan.req.sampling
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "model": self.plan.req.model,
            "output": output,
            "usage": None,
            **self.plan.echo,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            **extra,
        }

    async def finish(self, request: web.Request, gen: Generation, out: Output) -> dict[str, Any]:
        """Close the last item, store the conversation, and return the final object."""
        cut = gen.result is not None and gen.result.finish_reason == "length"
        await out.close("incomplete" if cut else "completed")
        if self.plan.store:
            request.app[STORE].put(self.id, self.plan.req.tenant, (*self.plan.items, *out.items))
        return self.json(
            "incomplete" if cut else "completed",
            out.items,
            incomplete_details={"reason": "max_output_tokens"} if cut else None,
            usage=usage(gen),
        )


async def _start(request: web.Request, plan: Plan) -> Generation:
    engine = request.app[ENGINE]
    if plan.max_field is None:
        await engine.load(plan.req.model)  # as start would: its context is known
        context = engine.model_info(plan.req.model).context_length
        plan.req.max_tokens = min(DEFAULT_MAX_OUTPUT, context or DEFAULT_MAX_OUTPUT)
    try:
        return await start(engine, plan.req, request, plan.given)
    except EngineError as e:
        # The engine names the neutral request's fields; the client sent these.
        renamed = {"max_tokens": plan.max_field or "max_output_tokens", "messages": "input"}
        e.field = renamed.get(e.field or "", e.field)
        raise


async def responses(request: web.Request, body: dict) -> web.StreamResponse:
    plan = build(request, body)
    gen = await _start(request, plan)
    answer = Answer(plan)
    if not plan.stream:
        out = Output(plan.tools)
        try:
            async for p in gen.parts():
                await out.add(p)
        finally:
            await gen.aclose()
        final = await answer.finish(request, gen, out)
        return web.json_response(
            final, headers=gen.headers, dumps=lambda o: orjson.dumps(o).decode()
        )

    sse = SSEWriter(request, gen.headers)
    await sse.prepare()
    sequence = 0

    async def emit(kind: str, **fields: Any) -> None:
        nonlocal sequence
        await sse.event(kind, {"type": kind, "sequence_number": sequence, **fields})
        sequence += 1

    async def in_progress() -> None:
        await emit("response.in_progress", response=answer.json("in_progress", out.items))

    out = Output(plan.tools, emit)
    try:
        await emit("response.created", response=answer.json("in_progress", []))
        await in_progress()
        # The keepalive beat is that event again, numbered in line: Codex resets its idle
        # timer only on a dispatched event (an SSE comment is none), and ignores this one.
        async for p in sse.kept_alive(gen.parts(), in_progress):
            await out.add(p)
        await emit("response.completed", response=await answer.finish(request, gen, out))
        await sse.end()
    except Exception as e:
        await _fail(sse, emit, answer, out, e)
        raise  # the middleware logs it; the stream is already ended
    finally:
        await gen.aclose()
    return sse.response


async def _fail(sse: SSEWriter, emit: Emit, answer: Answer, out: Output, exc: Exception) -> None:
    """End a started stream with response.failed, the event Responses clients wait for."""
    if sse.ended:
        return
    err = api_error(exc)
    error = {"code": "server_error", "message": err.message}
    try:
        await emit("response.failed", response=answer.json("failed", out.items, error=error))
        await sse.end()
    except ConnectionError as e:  # the client is gone; nobody is left to tell
        log.info("stream ended by the client before response.failed was sent: %s", e)
    sse.ended = True


def add_routes(app: web.Application, json_route: Callable) -> None:
    """The route and its in-memory store (`json_route` reads the body, or forwards it)."""
    app[STORE] = ResponseStore()
    app.router.add_post(ROUTE, json_route(responses))
