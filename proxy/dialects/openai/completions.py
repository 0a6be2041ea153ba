"""OpenAI completions: POST /v1/completions, a raw prompt (text or token ids) continued as
it is, whole or as its chunk stream."""

from __future__ import annotations

import time
import uuid
from typing import Any

from aiohttp import web

from engine_bridge.types import GenerationRequest

from ... import fields as f
from ...errors import ApiError
from ...generation import Given, start
from ...state import ENGINE
from ..sse import SSEWriter
from .shared import lmstudio_extras, request_fields, usage


def completion_request(body: dict, request: web.Request) -> GenerationRequest:
    common = request_fields(body, request)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        return GenerationRequest(prompt=prompt, **common)
    return GenerationRequest(prompt_tokens=parse_token_prompt(prompt), **common)


def parse_token_prompt(prompt: Any) -> list[int]:
    """A prompt given as token ids, which the engine uses as they are."""
    if not isinstance(prompt, list):
        raise ApiError(
            400,
            f"prompt: expected a string or an array of token ids, got {type(prompt).__name__}",
            param="prompt",
        )
    if not prompt:
        raise ApiError(400, "prompt: the token array is empty", param="prompt")
    if len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
        raise ApiError(
            400, f"prompt: one prompt per request is supported, got {len(prompt)}", param="prompt"
        )
    for i, token in enumerate(prompt):
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ApiError(
                400,
                f"prompt[{i}]: a token id must be a non-negative integer, got {f.short(token)}",
                param="prompt",
            )
    return prompt


async def completions(
    request: web.Request, body: dict, lmstudio: bool = False
) -> web.StreamResponse:
    req = completion_request(body, request)
    stream = f.get_bool(body, "stream")
    options = f.get_dict(body, "stream_options", {}) or {}
    gen = await start(request.app[ENGINE], req, request, Given.of(body), raw=True)
    rid = "cmpl-" + uuid.uuid4().hex[:24]
    created = int(time.time())

    def finish() -> str:
        return "length" if gen.result and gen.result.finish_reason == "length" else "stop"

    if not stream:
        try:
            text = "".join([p.text async for p in gen.parts()])
        finally:
            await gen.aclose()
        return web.json_response(
            {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": req.model,
                "choices": [
                    {"index": 0, "text": text, "finish_reason": finish(), "logprobs": None}
                ],
                "usage": usage(gen),
                **(lmstudio_extras(gen) if lmstudio else {}),
            },
            headers=gen.headers,
        )
    sse = SSEWriter(request, gen.headers)
    await sse.prepare()

    def chunk(text: str, reason: str | None = None) -> dict[str, Any]:
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": req.model,
            "choices": [{"index": 0, "text": text, "finish_reason": reason, "logprobs": None}],
        }

    try:
        async for p in sse.kept_alive(gen.parts()):
            await sse.data(chunk(p.text))
        last = chunk("", finish())
        if lmstudio:
            last.update(lmstudio_extras(gen))
        await sse.data(last)
        if options.get("include_usage"):
            final = chunk("")
            final["choices"] = []
            final["usage"] = usage(gen)
            await sse.data(final)
        await sse.done()
    finally:
        await gen.aclose()
    return sse.response
