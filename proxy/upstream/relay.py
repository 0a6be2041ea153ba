"""An upstream's answer passed on to the client (`mirror`), and its event stream whole
events at a time (`EventStream`).

Holding an event back until its blank line arrives costs nothing in practice (servers
write whole events) and means that when the upstream fails, the client is left on an event
boundary where the proxy's error event can follow, never with half an event whose cut-off
JSON would make its SDK fail on a parse error instead of naming the cause.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from proxy.upstream.headers import HOP_BY_HOP, filtered


async def mirror(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    copy: Callable[[web.StreamResponse], Awaitable[bool]],
) -> web.StreamResponse:
    """A response with the upstream's status and headers (Content-Length and
    Content-Encoding stay: the bytes pass untouched), its body written by `copy`, which
    says whether it read the upstream's body to its end. A drained connection goes back
    to the pool (`release`); any other is dropped (`close`), and the upstream sees the
    client's disconnect and stops generating."""
    drained = False
    try:
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        response.headers.extend(filtered(upstream.headers, HOP_BY_HOP))
        await response.prepare(request)
        drained = await copy(response)
        return response
    finally:
        if drained:
            upstream.release()
        else:
            upstream.close()


# One event larger than this is passed on unfinished rather than held in memory.
HELD_MAX = 1 << 20

# The dialects' last events: OpenAI's "data: [DONE]", Anthropic's message_stop, the
# Responses API's response.completed / incomplete / failed (no [DONE] follows them), or an
# error event (after which nothing comes). Event and [DONE] lines are matched whole, so
# never inside JSON; a Responses server that sends data lines only is known by the type
# in them, whose quotes a string inside the JSON would have escaped.
_FINAL_EVENT = re.compile(
    rb"^(?:data: ?\[DONE\]"
    rb"|event: ?(?:message_stop|error|response\.(?:completed|incomplete|failed))"
    rb'|data: ?\{.*"type": ?"response\.(?:completed|incomplete|failed)".*)\r?$',
    re.M,
)


# A Responses stream's numbering and its response's id, so a failure the proxy appends
# carries on from them (top-level keys: the first "id" of response.created is the response's).
_SEQUENCE = re.compile(rb'"sequence_number": ?(\d+)')
_RESPONSE_ID = re.compile(rb'"id": ?"(resp_[A-Za-z0-9_-]{1,200})"')


@dataclass(slots=True)
class EventStream:
    """``held`` is the unfinished event; ``at_boundary`` says what was passed on ended on a
    blank line; ``finished`` says a dialect's final event went by. For a Responses stream
    (``responses``), ``next_sequence`` and ``response_id`` are read from what was passed on;
    other streams are not scanned for them."""

    held: bytearray = field(default_factory=bytearray)
    at_boundary: bool = True
    finished: bool = False
    responses: bool = False
    next_sequence: int = 0
    response_id: str | None = None

    def feed(self, chunk: bytes) -> bytes:
        """The bytes up to the last complete event so far; the rest waits for more."""
        self.held += chunk
        end = _events_end(self.held)
        if end == 0 and len(self.held) <= HELD_MAX:
            return b""
        self.at_boundary = end > 0
        end = end or len(self.held)
        out = bytes(self.held[:end])
        del self.held[:end]
        self.finished = self.finished or _FINAL_EVENT.search(out) is not None
        if self.responses:
            self._track(out)
        return out

    def _track(self, out: bytes) -> None:
        numbers = _SEQUENCE.findall(out)
        if numbers:
            self.next_sequence = max(self.next_sequence, max(int(n) for n in numbers) + 1)
        if self.response_id is None and (found := _RESPONSE_ID.search(out)):
            self.response_id = found[1].decode()


def _events_end(buf: bytearray) -> int:
    """Where the last blank line in ``buf`` ends (0 if none): an SSE event ends there."""
    end = 0
    for blank in (b"\n\n", b"\r\n\r\n", b"\r\r"):
        at = buf.rfind(blank)
        if at >= 0:
            end = max(end, at + len(blank))
    return end
