"""Server-sent events over an aiohttp StreamResponse."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import orjson
from aiohttp import web

from ..errors import ApiError, Dialect, error_body
from ..state import SETTINGS

log = logging.getLogger("proxy.dialects.sse")

T = TypeVar("T")
Beat = Callable[[], Awaitable[None]]
_END = object()


async def keepalive(items: AsyncIterator[T], interval: float, beat: Beat) -> AsyncIterator[T]:
    """`items` as they come, and `await beat()` each `interval` seconds that pass without one
    (a long prompt's prefill before the first token); `interval` <= 0: no beats."""
    if interval <= 0:
        async for item in items:
            yield item
        return
    while True:
        # The next item is awaited in a task of its own: a timeout that cancelled `__anext__`
        # would end the generation.
        step = asyncio.create_task(_next(items))
        try:
            while not (await asyncio.wait({step}, timeout=interval))[0]:
                await beat()
        except BaseException:
            # The consumer stopped (the client gone, its handler cancelled, a beat that could
            # not be written): the wait is cancelled and awaited, which releases the
            # generation and leaves no task behind.
            step.cancel()
            await asyncio.wait({step})
            if not step.cancelled():
                step.exception()  # retrieved: the consumer's own error is the one that counts
            raise
        item = step.result()
        if item is _END:
            return
        yield item


async def _next(items: AsyncIterator[Any]) -> Any:
    return await anext(items, _END)


class SSEWriter:
    def __init__(
        self,
        request: web.Request,
        headers: dict[str, str] | None = None,
        response: web.StreamResponse | None = None,
    ):
        """``response`` is an event stream already under way (a passthrough) to end in-band."""
        self.request = request
        # A StreamResponse is a mapping, so an empty one is falsy: test for None.
        if response is not None:
            self.response = response
        else:
            self.response = web.StreamResponse(
                status=200,
                headers={
                    "Content-Type": "text/event-stream; charset=utf-8",
                    "Cache-Control": "no-cache",
                    "X-Accel-Buffering": "no",
                    **(headers or {}),
                },
            )
        self.ended = False

    async def prepare(self) -> None:
        await self.response.prepare(self.request)
        # From here on the status is sent: a failure must end this stream, not answer anew.
        self.request[STREAM] = self

    def kept_alive(self, items: AsyncIterator[T], beat: Beat | None = None) -> AsyncIterator[T]:
        """`items`, with `beat` (an SSE comment unless given) each `[server] stream_keepalive`
        that passes without one, so a client's read or idle timeout outlasts a long prefill."""
        return keepalive(items, self.request.app[SETTINGS].stream_keepalive_s, beat or self.comment)

    async def comment(self) -> None:
        """An SSE comment line: every SSE parser skips it, and it is bytes on the wire."""
        await self.response.write(b": keepalive\n\n")

    async def data(self, payload: dict[str, Any]) -> None:
        await self.response.write(b"data: " + orjson.dumps(payload) + b"\n\n")

    async def event(self, name: str, payload: dict[str, Any]) -> None:
        await self.response.write(
            b"event: " + name.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"
        )

    async def done(self) -> None:
        """End an OpenAI stream: its last line, then the end of the body."""
        await self.response.write(b"data: [DONE]\n\n")
        await self.end()

    async def end(self) -> None:
        self.ended = True
        await self.response.write_eof()

    async def fail(self, err: ApiError, dialect: Dialect) -> None:
        """End a started stream with the dialect's own mid-stream error.

        Anthropic has an `error` event; OpenAI-compatible servers (vLLM, SGLang) send a
        data line holding `{"error": {...}}`, which the openai SDK raises, then `[DONE]`.
        """
        if self.ended:
            return
        try:
            if dialect == "anthropic":
                await self.event("error", error_body(err, dialect))
                await self.end()
            else:
                await self.data(error_body(err, dialect))
                await self.done()
        except ConnectionError as e:  # the client is gone; nobody is left to tell
            self.ended = True
            log.info("stream ended by the client before its error was sent: %s", e)

    async def fail_response(self, err: ApiError, response_id: str | None, sequence: int) -> None:
        """End a started Responses stream with `response.failed`, the event its clients
        (Codex CLI, the openai SDK) wait for; there is no [DONE] in that dialect. For a
        relayed stream: the response's id and numbering carry on from the upstream's."""
        if self.ended:
            return
        response = {
            "id": response_id or f"resp_{uuid.uuid4().hex[:24]}",
            "object": "response",
            "created_at": int(time.time()),
            "status": "failed",
            "error": {"code": err.code or "server_error", "message": err.message},
            "incomplete_details": None,
            "output": [],
            "usage": None,
        }
        payload = {"type": "response.failed", "sequence_number": sequence, "response": response}
        try:
            await self.event("response.failed", payload)
            await self.end()
        except ConnectionError as e:
            self.ended = True
            log.info("stream ended by the client before response.failed was sent: %s", e)


STREAM = web.RequestKey("stream", SSEWriter)
