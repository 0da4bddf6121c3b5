"""A minimal proxy written directly on ``httptools``: what the protocol costs on one core.

It does what the minimal aiohttp proxy of ``bench/gateway.py`` does and no more: checks that
an ``Authorization`` header is there, reads the JSON body (``json.loads``), sends it to one
upstream over a keep-alive connection from a pool, and passes the answer through: a plain
answer with its length, an SSE stream chunk by chunk as the upstream's reads come. No
framework, no tasks: the server and the upstream client are asyncio protocols whose
callbacks hand each other the bytes.

    python bench/raw_proxy.py PORT UPSTREAM_PORT       # what bench/gateway.py starts

Limits (a benchmark's yardstick, not a server): one request at a time per client connection
(no pipelining: the load client never pipelines), no timeouts, no size limits, and the only
upstream error handled is a lost connection (a 502).
"""

from __future__ import annotations

import asyncio
import json
import sys
from http import HTTPStatus

import httptools

TARGET = b"/v1/chat/completions"
STREAM_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
UNAUTHORIZED = b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\n\r\n"
BAD_REQUEST = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n"
REASONS = {status.value: status.phrase.encode() for status in HTTPStatus}
BAD_GATEWAY = b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class Client(asyncio.Protocol):
    """One connection from a client: parse its requests, relay each to the upstream."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.parser = httptools.HttpRequestParser(self)
        self.authorized = False
        self.body: list[bytes] = []
        self.answer: list[bytes] = []  # a plain answer's body, written whole at its end
        self.streaming = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.write(BAD_REQUEST)
            self.transport.close()

    # --- httptools callbacks for the request -------------------------------------------

    def on_message_begin(self) -> None:
        self.authorized = False
        self.body = []

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"authorization":
            self.authorized = True

    def on_body(self, data: bytes) -> None:
        self.body.append(data)

    def on_message_complete(self) -> None:
        if not self.authorized:
            self.transport.write(UNAUTHORIZED)
            return
        body = b"".join(self.body)
        try:
            json.loads(body)
        except ValueError:
            self.transport.write(BAD_REQUEST)
            return
        self.pool.send(self, body)

    # --- called by the upstream connection -------------------------------------------

    def head(self, status: int, stream: bool) -> None:
        self.streaming = stream
        self.answer = []
        if stream:
            self.transport.write(STREAM_HEAD)

    def chunk(self, data: bytes) -> None:
        if self.streaming:
            self.transport.write(b"%x\r\n%s\r\n" % (len(data), data))
        else:
            self.answer.append(data)

    def end(self, status: int) -> None:
        if self.streaming:
            self.transport.write(b"0\r\n\r\n")
            return
        body = b"".join(self.answer)
        self.transport.write(
            b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (status, REASONS.get(status, b""), len(body), body)
        )

    def failed(self) -> None:
        self.transport.write(BAD_GATEWAY)
        self.transport.close()


class Upstream(asyncio.Protocol):
    """One keep-alive connection to the upstream, back in the pool after each answer."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.parser = httptools.HttpResponseParser(self)
        self.client: Client | None = None
        self.stream = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]

    def send(self, client: Client, request: bytes) -> None:
        self.client = client
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.pool.lost(self)
        if self.client is not None:
            self.client.failed()

    # --- httptools callbacks for the answer ------------------------------------------

    def on_message_begin(self) -> None:
        self.stream = False

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type" and value.startswith(b"text/event-stream"):
            self.stream = True

    def on_headers_complete(self) -> None:
        assert self.client is not None
        self.client.head(self.parser.get_status_code(), self.stream)

    def on_body(self, data: bytes) -> None:
        assert self.client is not None
        self.client.chunk(data)

    def on_message_complete(self) -> None:
        client, self.client = self.client, None
        self.pool.idle.append(self)  # free before the client hears of it: it may send at once
        assert client is not None
        client.end(self.parser.get_status_code())


class Pool:
    """Keep-alive connections to one upstream: an idle one is reused, else one is opened."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.idle: list[Upstream] = []
        self.head = (
            b"POST %s HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
            b"Content-Length: " % (TARGET, port)
        )

    def send(self, client: Client, body: bytes) -> None:
        request = b"%s%d\r\n\r\n%s" % (self.head, len(body), body)
        if self.idle:
            self.idle.pop().send(client, request)
        else:  # only while the pool grows to the clients' concurrency
            asyncio.get_running_loop().create_task(self._open(client, request))

    async def _open(self, client: Client, request: bytes) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, upstream = await loop.create_connection(lambda: Upstream(self), "127.0.0.1", self.port)
        except OSError:
            client.failed()
            return
        upstream.send(client, request)

    def lost(self, upstream: Upstream) -> None:
        if upstream in self.idle:
            self.idle.remove(upstream)


def serve(port: int, upstream: int) -> None:
    async def main() -> None:
        pool = Pool(upstream)
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: Client(pool), "127.0.0.1", port, backlog=2048)
        await server.serve_forever()

    try:  # uvloop where it is installed, as `llmgw gateway run` does by default
        import uvloop  # noqa: PLC0415
    except ImportError:
        asyncio.run(main())
    else:
        uvloop.run(main())


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
