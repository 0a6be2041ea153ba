"""Server-sent events over an aiohttp StreamResponse."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web


class SSEWriter:
    def __init__(self, request: web.Request, headers: dict[str, str] | None = None):
        self.request = request
        self.response = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
                **(headers or {}),
            },
        )

    async def prepare(self) -> None:
        await self.response.prepare(self.request)

    async def data(self, payload: dict[str, Any]) -> None:
        await self.response.write(b"data: " + orjson.dumps(payload) + b"\n\n")

    async def event(self, name: str, payload: dict[str, Any]) -> None:
        await self.response.write(
            b"event: " + name.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"
        )

    async def done(self) -> None:
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
