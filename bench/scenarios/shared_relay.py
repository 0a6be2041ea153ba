"""A TCP relay that adds a fixed one-way delay to every byte: a LAN between us and Redis.

Each direction is a thread that stamps what it reads and forwards it once `delay_s` has
passed, so a request/response round trip costs 2 × delay_s more, and throughput stays
the loopback's (a pipeline of a hundred commands pays the delay once, as on a real LAN).
Used by the shared-tier bench and by the tests that need a slow store (`delay_s` above
the client's timeout).
"""

from __future__ import annotations

import socket
import threading
import time
from collections import deque


class DelayRelay:
    """Listen on 127.0.0.1:`port` (0: any free port), forward to `target`."""

    def __init__(self, target: tuple[str, int], delay_s: float, port: int = 0) -> None:
        self.target = target
        self.delay_s = delay_s
        self._listener = socket.create_server(("127.0.0.1", port))
        self.port = self._listener.getsockname()[1]
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, name="delay-relay", daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def close(self) -> None:
        self._closed.set()
        for s in [self._listener, *self._sockets]:
            try:
                s.close()
            except OSError:
                pass

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
                upstream = socket.create_connection(self.target)
            except OSError:
                continue
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sockets += [client, upstream]
            self._pipe(client, upstream)
            self._pipe(upstream, client)

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        chunks: deque[tuple[float, bytes | None]] = deque()
        ready = threading.Condition()

        def read() -> None:
            while True:
                try:
                    data = src.recv(1 << 20)
                except OSError:
                    data = b""
                with ready:
                    chunks.append((time.monotonic() + self.delay_s, data or None))
                    ready.notify()
                if not data:
                    return

        def write() -> None:
            while True:
                with ready:
                    while not chunks:
                        ready.wait()
                    due, data = chunks.popleft()
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                try:
                    if data is None:
                        dst.shutdown(socket.SHUT_WR)
                        return
                    dst.sendall(data)
                except OSError:
                    return

        threading.Thread(target=read, daemon=True).start()
        threading.Thread(target=write, daemon=True).start()
