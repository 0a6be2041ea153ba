"""A TCP front before a real upstream that misbehaves on cue, for test_upstream_faults.py:
no real server can be made to hang, babble or drop a stream when a test asks. GETs pass
through untouched; the next POSTs get the fault."""

from __future__ import annotations

import json
import socket
import socketserver
import threading
from dataclasses import dataclass

HELD_S = 30  # how long a hanging or stalled front holds a connection at most


@dataclass(frozen=True, slots=True)
class Fault:
    """What the front does with the next POSTs.

    ``reply``: write these bytes and hang up (b"" hangs up without a word). ``hang``: read
    the request, never answer. ``cut``/``stall``: relay the real answer's head and body up
    to ``events`` whole SSE events plus ``extra`` bytes, then hang up / go silent.
    """

    kind: str
    reply: bytes = b""
    events: int = 0
    extra: int = 0


class FaultyFront(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, target: str):
        super().__init__(("127.0.0.1", 0), _FrontHandler)
        host, port = target.removeprefix("http://").split(":")
        self.target = (host, int(port))
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.fault: Fault | None = None
        self.release = threading.Event()
        self.full_body = b""  # the real upstream's whole body, for the last cut or stall
        self.forwarded = b""  # the part of it the proxy was given

    def reset(self) -> None:
        self.fault = None
        self.release.set()  # lets held connections go
        self.release = threading.Event()


class _FrontHandler(socketserver.StreamRequestHandler):
    server: FaultyFront

    def handle(self) -> None:
        request = self._read_request()
        fault = self.server.fault if request.startswith(b"POST ") else None
        release = self.server.release
        if fault is None:
            self._relay(request)
        elif fault.kind == "reply":
            self.wfile.write(fault.reply)
        elif fault.kind == "hang":
            release.wait(HELD_S)
        else:
            head, body = self._answer(request)
            cut = event_end(body, fault.events) + fault.extra
            self.server.full_body, self.server.forwarded = body, body[:cut]
            self.wfile.write(head + body[:cut])
            if fault.kind == "stall":
                release.wait(HELD_S)
        # Returning closes the connection: a FIN, as from an upstream process that exits.

    def _read_request(self) -> bytes:
        head = b""
        while not head.endswith(b"\r\n\r\n"):
            line = self.rfile.readline()
            if not line:
                return head
            head += line
        length = 0
        for line in head.split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return head + self.rfile.read(length)

    def _relay(self, request: bytes) -> None:
        with socket.create_connection(self.server.target) as up:
            up.sendall(request)
            while chunk := up.recv(65536):
                self.wfile.write(chunk)

    def _answer(self, request: bytes) -> tuple[bytes, bytes]:
        """The real upstream's whole answer (mlx_lm.server closes after each one)."""
        data = b""
        with socket.create_connection(self.server.target) as up:
            up.sendall(request)
            while chunk := up.recv(65536):
                data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        return head + b"\r\n\r\n", body


def event_end(body: bytes, events: int) -> int:
    end = 0
    for _ in range(events):
        end = body.index(b"\n\n", end) + 2
    return end


def data_before_cut(front: FaultyFront) -> list[dict]:
    """The JSON of the whole data events the front let through (not its keepalive comments)."""
    events = front.full_body[: event_end(front.full_body, front.fault.events)].split(b"\n\n")
    return [json.loads(e.removeprefix(b"data: ")) for e in events if e.startswith(b"data: ")]
