"""A minimal HTTP/1.1 server on asyncio streams, enough for the simulated engines.

Why not an HTTP framework: thirty and more simulated engines share one 2-core machine,
so each must stay a bare Python process (about 20 MB, no threads). Supports keep-alive,
Content-Length request bodies, fixed-length and chunked (SSE) responses.

Concurrency contract: one task per connection, requests on a connection are handled in
order; a handler owns its ``Response`` until it returns, and only that task writes to it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    413: "Payload Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}
MAX_BODY = 16 * 1024 * 1024


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    peer: str

    def json(self) -> Any:
        return json.loads(self.body or b"null")


@dataclass
class Response:
    """Write one response: either ``send`` once, or ``start_stream`` then ``write`` chunks."""

    writer: asyncio.StreamWriter
    status: int = 0
    keep_alive: bool = True
    _streaming: bool = field(default=False, repr=False)

    def _head(self, status: int, headers: dict[str, str]) -> bytes:
        self.status = status
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}", "server: llmgw-lab-engine"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        if not self.keep_alive:
            lines.append("connection: close")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    async def send(self, status: int, body: bytes = b"", content_type: str = "application/json") -> None:
        headers = {"content-length": str(len(body))}
        if body:
            headers["content-type"] = content_type
        self.writer.write(self._head(status, headers) + body)
        await self.writer.drain()

    async def send_json(self, status: int, payload: Any) -> None:
        await self.send(status, json.dumps(payload, separators=(",", ":")).encode())

    async def start_stream(self, content_type: str = "text/event-stream; charset=utf-8") -> None:
        self._streaming = True
        self.writer.write(self._head(200, {"content-type": content_type, "transfer-encoding": "chunked"}))
        await self.writer.drain()

    async def write(self, data: bytes) -> None:
        self.writer.write(b"%x\r\n%s\r\n" % (len(data), data))
        await self.writer.drain()

    async def end_stream(self) -> None:
        self.writer.write(b"0\r\n\r\n")
        await self.writer.drain()


Handler = Callable[[Request, Response], Awaitable[None]]


async def serve_connection(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, handler: Handler
) -> None:
    """Read requests off one connection until the client closes it or asks to."""
    peername = writer.get_extra_info("peername")
    peer = f"{peername[0]}:{peername[1]}" if isinstance(peername, tuple) else "-"
    try:
        while True:
            line = await reader.readline()
            if not line:
                return
            parts = line.decode("latin-1").split()
            if len(parts) != 3:
                return
            method, target, version = parts
            headers: dict[str, str] = {}
            while True:
                raw = await reader.readline()
                if raw in (b"\r\n", b"\n", b""):
                    break
                name, _, value = raw.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            length = int(headers.get("content-length", "0") or "0")
            response = Response(writer)
            if length > MAX_BODY:
                response.keep_alive = False
                await response.send(413)
                return
            body = await reader.readexactly(length) if length else b""
            conn = headers.get("connection", "").lower()
            response.keep_alive = conn != "close" and (version == "HTTP/1.1" or conn == "keep-alive")
            path = target.split("?", 1)[0]
            await handler(Request(method, path, headers, body, peer), response)
            if not response.keep_alive:
                return
    except (ConnectionError, asyncio.IncompleteReadError, ValueError, asyncio.LimitOverrunError):
        return
    finally:
        writer.close()
