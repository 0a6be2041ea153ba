"""A raw HTTP/1.1 client: each request written byte for byte on a socket.

Clients (httpx, aiohttp, the SDKs) set Host and Content-Type themselves; what a browser
or an attacker can send (no Host, two Hosts, a foreign Origin, HTTP/1.0) needs this.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import orjson

JSON = "application/json"


@dataclass
class Reply:
    status: int
    headers: dict[str, str]  # lower-case names; the last value of a repeated header
    body: bytes

    def json(self):
        return orjson.loads(self.body)


async def raw_request(
    port: int,
    method: str,
    path: str,
    headers: list[tuple[str, str]],
    body: bytes = b"",
    version: str = "HTTP/1.1",
) -> Reply:
    """One request exactly as given (no Host or Content-Type added), and its response."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    lines = [f"{method} {path} {version}", *(f"{k}: {v}" for k, v in headers)]
    if body:
        lines.append(f"Content-Length: {len(body)}")
    if not any(k.lower() == "connection" for k, _ in headers):
        lines.append("Connection: close")
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
    await writer.drain()
    try:
        return await asyncio.wait_for(_read_response(reader), 120)
    finally:
        writer.close()


async def _read_response(reader: asyncio.StreamReader) -> Reply:
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").strip().split("\r\n")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    status = int(status_line.split()[1])
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding") == "chunked":
        body = b""
        while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
            body += (await reader.readexactly(size + 2))[:-2]
        await reader.readuntil(b"\r\n")
    elif status in (101, 204, 304):
        body = b""
    else:
        body = await reader.read()
    return Reply(status, headers, body)


@dataclass
class Local:
    port: int

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def get(self, path: str, *headers: tuple[str, str], host: str | None = None) -> Reply:
        return await raw_request(self.port, "GET", path, [("Host", host or self.host), *headers])

    async def post(
        self,
        path: str,
        body: dict | bytes,
        *headers: tuple[str, str],
        content_type: str | None = JSON,
        host: str | None = None,
    ) -> Reply:
        raw = body if isinstance(body, bytes) else orjson.dumps(body)
        sent = [("Host", host or self.host), *headers]
        if content_type is not None:
            sent.append(("Content-Type", content_type))
        return await raw_request(self.port, "POST", path, sent, raw)
