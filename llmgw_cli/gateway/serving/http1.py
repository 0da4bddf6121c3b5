"""A lean HTTP/1.1 server for the public listener: ``httptools`` (llhttp) and asyncio protocols.

Why not aiohttp's server: at concurrency 64 on one core it was the gateway's ceiling (a
bare aiohttp proxy serves about an eighth of what a bare proxy written on ``httptools``
serves). The public listener needs a handful of routes, whole request bodies, plain
answers and one streamed answer shape; this module is that and no more.

Contract
--------
``Server(routes, app, limits)`` is an asyncio protocol factory (``loop.create_server``).
Each connection parses requests with ``httptools``; once a request's head is in, its
handler runs (``routes[(method, path)]``; ``HEAD`` runs a ``GET`` route without the body)
while its body keeps arriving. A handler gets a ``Request`` and returns a
``web.Response`` (written as one ``transport.write`` of head and body) or the ``Stream``
it opened with ``Request.open_stream`` (chunked transfer encoding; close-delimited for an
HTTP/1.0 client). Requests on one connection are answered in order (pipelining); reading
pauses while ``PIPELINE`` requests wait.

Bounds, every one a refusal and a closed connection, never a traceback:

- a head (request line and headers) over ``MAX_HEAD`` bytes, or with more than
  ``MAX_HEADERS`` headers: 431; a head llhttp refuses (bad bytes, both Content-Length and
  Transfer-Encoding, a bad chunk size, an unknown method): 400;
- ``header_timeout``: a connection that has not sent a whole head this long after it
  opened or after its previous answer is closed. The deadline is set once, so bytes that
  trickle in do not restart it; one task looks at every connection a few times per timeout;
- a body over ``max_body`` bytes: ``Request.read`` raises ``HTTPRequestEntityTooLarge`` (the
  handler answers 413) and the connection closes after the answer; a handler that answers
  before its body arrived (an over-size Content-Length) closes the connection too;
- a client that goes away cancels its handler (the engine's request is closed with it);
- ``writing_paused`` says the transport's buffer is full: ``Stream.write`` waits for it to
  drain; ``server.WriteWatch`` drops a connection that stays full.

Leaving (``Server.leaving``): answers not begun yet carry ``Connection: close``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections import deque
from collections.abc import Awaitable, Callable
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, cast

import httptools
from aiohttp import web
from multidict import CIMultiDict

log = logging.getLogger("llmgw.http")

MAX_HEAD = 64 * 1024  # bytes of request line and headers
MAX_HEADERS = 100
PIPELINE = 16  # requests parsed ahead of their answers before reading pauses
_RAW_HEAD = 4 * MAX_HEAD  # bytes read while inside one head, whatever llhttp made of them

Handler = Callable[["Request"], Awaitable[object]]  # a web.Response or a Stream
Prepare = Callable[["Request", "CIMultiDict[str]"], None]

_NO_BODY_HEADERS = frozenset(("content-length", "transfer-encoding", "connection"))


class _Date:
    """The Date header, made once a second."""

    second = -1
    value = b""

    @classmethod
    def now(cls) -> bytes:
        t = int(time.time())
        if t != cls.second:
            cls.second, cls.value = t, formatdate(t, usegmt=True).encode()
        return cls.value


def _refusal(status: int) -> bytes:
    """A plain-text refusal that closes its connection (``400: Bad Request``)."""
    reason = _reason(status)
    body = b"%d: %b" % (status, reason)
    return (
        b"HTTP/1.1 %d %b\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: %d\r\n"
        b"Connection: close\r\n\r\n%b" % (status, reason, len(body), body)
    )


class _Body:
    """``Request.content``: what aiohttp's stream offers for a body already in."""

    __slots__ = ("_request",)

    def __init__(self, request: Request) -> None:
        self._request = request

    def is_eof(self) -> bool:
        request = self._request
        return request.complete and not request.too_large and not request.encoding

    def read_nowait(self) -> bytes:
        return self._request.body_bytes()


class Headers:
    """A request's headers, looked up case-insensitively in the parser's list (a request
    has a few; the gateway reads one or two): the first of a name given twice."""

    __slots__ = ("_raw",)

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self._raw = raw

    def get(self, name: str, default: str | None = None) -> str | None:
        key = name.lower().encode("latin-1")
        size = len(key)
        for found, value in self._raw:
            if len(found) == size and found.lower() == key:
                return value.decode("latin-1")
        return default

    def getall(self, name: str) -> list[str]:
        key = name.lower().encode("latin-1")
        return [v.decode("latin-1") for n, v in self._raw if n.lower() == key]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.get(name) is not None

    def __len__(self) -> int:
        return len(self._raw)


class Request:
    """One request: method, path, headers (a case-insensitive lookup made on first use),
    body; and a mapping for what handlers keep on it (its id, its rate headers)."""

    __slots__ = (
        "_chunks",
        "_conn",
        "_store",
        "_waiter",
        "app",
        "complete",
        "content_length",
        "encoding",
        "expect_continue",
        "keep_alive",
        "method",
        "path",
        "query",
        "raw_headers",
        "received",
        "too_large",
        "version",
    )

    def __init__(  # noqa: PLR0917 (what the parser found, in order)
        self,
        conn: Connection,
        method: str,
        url: bytes,
        version: str,
        raw_headers: list[tuple[bytes, bytes]],
        keep_alive: bool,
        app: dict[Any, Any],
    ) -> None:
        self._conn = conn
        self.method = method
        path, _, query = url.partition(b"?")
        self.path = path.decode("latin-1")
        self.query = query.decode("latin-1")
        self.version = version
        self.raw_headers = raw_headers
        self.keep_alive = keep_alive
        self.app = app
        self._store: dict[Any, Any] = {}
        self._chunks: list[bytes] = []
        self._waiter: asyncio.Future[None] | None = None
        self.complete = False
        self.too_large = False
        self.received = 0
        self.content_length: int | None = None
        self.expect_continue = False
        self.encoding = b""  # the body's Content-Encoding: gzip or deflate (else refused)
        for name, value in raw_headers:
            if len(name) == 14 and name.lower() == b"content-length":
                self.content_length = int(value)  # llhttp checked it: digits, given once
            elif len(name) == 6 and name.lower() == b"expect":
                self.expect_continue = value.lower() == b"100-continue"
            elif len(name) == 16 and name.lower() == b"content-encoding":
                coding = value.strip().lower()
                self.encoding = b"" if coding == b"identity" else coding

    @property
    def headers(self) -> Headers:
        return Headers(self.raw_headers)

    @property
    def content(self) -> _Body:
        return _Body(self)

    @property
    def transport(self) -> asyncio.Transport | None:
        return self._conn.transport

    def get(self, key: Any, default: Any = None, /) -> Any:
        return self._store.get(key, default)

    def __getitem__(self, key: Any) -> Any:
        return self._store[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self._store[key] = value

    # --- the body ---------------------------------------------------------------------------

    def feed(self, data: bytes) -> None:
        self.received += len(data)
        if self.received > self._conn.server.max_body:
            if not self.too_large:
                self.too_large = True
                self._chunks.clear()
                self._wake()
            return
        self._chunks.append(data)

    def finish(self) -> None:
        self.complete = True
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def body_bytes(self) -> bytes:
        chunks = self._chunks
        if len(chunks) == 1:
            return chunks[0]
        body = b"".join(chunks)
        self._chunks = [body]
        return body

    async def read(self) -> bytes:
        """The whole body; ``HTTPRequestEntityTooLarge`` past the server's ``max_body``."""
        while not (self.complete or self.too_large):
            self._waiter = asyncio.get_running_loop().create_future()
            self._conn.resume_body()
            await self._waiter
        limit = self._conn.server.max_body
        if self.too_large:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=self.received)
        if self.encoding:
            return _decoded(self.body_bytes(), limit, self.received)
        return self.body_bytes()

    async def open_stream(self, status: int, headers: dict[str, str]) -> Stream:
        """Begin a streamed answer: its head is written now."""
        stream = Stream(self._conn, self, status, CIMultiDict(headers))
        stream.start()
        await self._conn.drained()
        return stream


CODINGS = (b"gzip", b"x-gzip", b"deflate")


def _decoded(body: bytes, limit: int, received: int) -> bytes:
    """A gzip or deflate body, decompressed to at most ``limit`` bytes: a body that would
    grow past it (a compression bomb) is ``HTTPRequestEntityTooLarge`` once ``limit`` + 1
    bytes are out, whatever its full size; one that does not decompress is ``HTTPBadRequest``
    (a plain 400 unless the handler answers it itself, as the gateway's does)."""
    for wbits in (47, -15):  # gzip or zlib (auto-detected); else a raw deflate stream
        decompressor = zlib.decompressobj(wbits)
        try:
            out = decompressor.decompress(body, limit + 1)
        except zlib.error:
            continue
        if len(out) > limit or decompressor.unconsumed_tail:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=received)
        if not decompressor.eof:
            break
        return out
    raise web.HTTPBadRequest(text="The request body does not decompress.")


class Stream:
    """A streamed answer: chunked, or close-delimited for an HTTP/1.0 client."""

    __slots__ = ("_conn", "_request", "chunked", "ended", "headers", "keep_alive", "status")

    prepared = True

    def __init__(self, conn: Connection, request: Request, status: int, headers: CIMultiDict[str]) -> None:
        self._conn = conn
        self._request = request
        self.status = status
        self.headers = headers
        self.chunked = request.version != "1.0"
        self.keep_alive: bool | None = None
        self.ended = False

    def force_close(self) -> None:
        self.keep_alive = False

    def start(self) -> None:
        conn = self._conn
        if not self.chunked:
            self.keep_alive = False
        framing = b"Transfer-Encoding: chunked\r\n" if self.chunked else b""
        conn.write(conn.head(self._request, self.status, self.headers, framing, self.keep_alive))

    async def write(self, data: bytes) -> None:
        if not data:
            return
        conn = self._conn
        if conn.gone:
            await conn.left()
        conn.write(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data)
        if conn.writing_paused:
            await conn.drained()

    async def write_eof(self, data: bytes = b"") -> None:
        if self.ended:
            return
        self.ended = True
        conn = self._conn
        if conn.gone:
            await conn.left()
        if self.chunked:
            conn.write((b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data)) if data else b"0\r\n\r\n")
        elif data:
            conn.write(data)
        if conn.writing_paused:
            await conn.drained()


class Server:
    """The protocol factory of one listener, and its open connections."""

    def __init__(
        self,
        routes: dict[tuple[str, str], Handler],
        app: dict[Any, Any],
        *,
        max_body: int,
        header_timeout: float,
        prepare: Prepare | None = None,
    ) -> None:
        self.routes = routes
        self.app = app
        self.max_body = max_body
        self.header_timeout = header_timeout
        self.prepare = prepare
        self.connections: set[Connection] = set()
        self.leaving = False
        methods: dict[str, set[str]] = {}
        for method, path in routes:
            methods.setdefault(path, set()).add(method)
        self.allowed = {path: ", ".join(sorted(m)) for path, m in methods.items()}  # a 405's Allow

    def __call__(self) -> Connection:
        return Connection(self)

    def look(self, now: float) -> None:
        """Close the connections whose head is late."""
        for conn in list(self.connections):
            if conn.head_deadline and now >= conn.head_deadline:
                conn.close()

    async def watch_heads(self) -> None:
        loop = asyncio.get_running_loop()
        every = min(1.0, self.header_timeout / 4)
        while True:
            await asyncio.sleep(every)
            self.look(loop.time())

    async def close(self) -> None:
        """Close every connection; cancel and wait for the handlers."""
        tasks = [c.task for c in self.connections if c.task is not None and not c.task.done()]
        for conn in list(self.connections):
            conn.close()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


class Connection(asyncio.Protocol):
    """One client connection: parses requests, runs their handlers one after another."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.lost = False
        self.writing_paused = False
        self.reading_paused = False
        self.task: asyncio.Task[None] | None = None
        self.current: Request | None = None  # the request being answered
        self.parsing: Request | None = None  # the request whose body is arriving
        self.waiting: deque[Request] = deque()
        self.head_deadline = 0.0  # 0: not waiting for a head
        self.idle_since = 0.0
        self.refused = False  # the parser failed: no more requests on this connection
        self.refusal = 0  # the status to answer once the answer under way is written
        self._drain: asyncio.Future[None] | None = None
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_size = 0
        self._in_head = False
        self._raw_head = 0

    # --- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports have asyncio.Transport's methods without its base class
        self.transport = cast(asyncio.Transport, transport)
        self.server.connections.add(self)
        self.head_deadline = self.loop.time() + self.server.header_timeout
        self.idle_since = self.loop.time()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.server.connections.discard(self)
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the client went away: its handler (and the engine's request) end
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(ConnectionResetError("the client closed its connection"))
        self.waiting.clear()

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._next()

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        if self._in_head:
            self._raw_head += len(data)
            if self._raw_head > _RAW_HEAD:
                self._refuse(431)
                return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # A request asking to switch protocols is answered as plain HTTP, and is the
            # connection's last: what follows its head is not HTTP/1.1.
            self._stop_reading()
            self.refused = True
        except httptools.HttpParserError as exc:
            if not self.refused:
                log.debug("refused a malformed request: %s", " ".join(str(exc).split())[:200])
                self._refuse(400)

    def eof_received(self) -> bool | None:
        # The client closed its end: gone, as far as HTTP/1.1 can tell (clients close
        # both ends at once). The transport closes, which cancels a handler under way.
        return None

    # --- httptools callbacks ---------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._head_size = 0
        self._in_head = True
        self._raw_head = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_size += len(url)
        if self._head_size > MAX_HEAD:
            self._refuse(431)
            raise httptools.HttpParserError("request line too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))
        self._head_size += len(name) + len(value) + 4
        if self._head_size > MAX_HEAD or len(self._headers) > MAX_HEADERS:
            self._refuse(431)
            raise httptools.HttpParserError("request head too large")

    def on_headers_complete(self) -> None:
        self._in_head = False
        parser = self.parser
        request = Request(
            self,
            parser.get_method().decode("ascii"),
            self._url,
            parser.get_http_version(),
            self._headers,
            parser.should_keep_alive(),
            self.server.app,
        )
        if request.encoding and request.encoding not in CODINGS:
            self._refuse(415)
            return
        self.parsing = request
        if self.current is None and not self.waiting and not self.writing_paused:
            self._start(request)
        else:
            self.waiting.append(request)
            if len(self.waiting) >= PIPELINE:
                self._stop_reading()

    def on_body(self, body: bytes) -> None:
        if self.parsing is not None:
            self.parsing.feed(body)

    def on_message_complete(self) -> None:
        if self.parsing is not None:
            self.parsing.finish()
            self.parsing = None

    # --- answering ----------------------------------------------------------------------------

    def _start(self, request: Request) -> None:
        self.current = request
        self.head_deadline = 0.0
        if request.expect_continue and not request.complete and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self.task = self.loop.create_task(self._handle(request))

    async def _handle(self, request: Request) -> None:
        server = self.server
        handler = server.routes.get((request.method, request.path))
        head_only = request.method == "HEAD"
        if handler is None and head_only:
            handler = server.routes.get(("GET", request.path))
        try:
            if handler is not None:
                reply = await handler(request)
            elif request.path in server.allowed:
                reply = web.Response(
                    status=405,
                    text="405: Method Not Allowed",
                    headers={"Allow": server.allowed[request.path]},
                )
            else:
                reply = web.Response(status=404, text="404: Not Found")
            if not isinstance(reply, (web.Response, Stream)):
                raise TypeError(f"a handler answered {type(reply).__name__}")
        except asyncio.CancelledError:
            self.close()
            raise
        except web.HTTPException as exc:  # a refusal raised by the server's own reading
            reply = web.Response(status=exc.status, text=exc.text, headers={"Connection": "close"})
            reply.force_close()
        except Exception as exc:
            if isinstance(exc, ConnectionResetError) and self.gone:
                return  # the client left while its answer was written
            log.exception("Error handling request %s %s", request.method, request.path[:200])
            reply = web.Response(status=500, text="500: Internal Server Error")
        if self.gone:  # the client left, or an answer cut short closed the connection
            return
        close = self.refused or not request.keep_alive or not request.complete or request.too_large
        if isinstance(reply, Stream):
            close = close or reply.keep_alive is False
            if not reply.ended:
                try:
                    await reply.write_eof()
                except ConnectionResetError:
                    return
        else:
            close = close or server.leaving or reply.keep_alive is False
            self._answer(request, reply, close, head_only)
        self._finished(close)

    def head(
        self,
        request: Request,
        status: int,
        headers: CIMultiDict[str],
        extra: bytes,
        keep_alive: bool | None,
    ) -> bytes:
        """An answer's status line and headers, ``extra`` (framing) among them."""
        if self.server.prepare is not None:
            self.server.prepare(request, headers)
        close = keep_alive is False or self.server.leaving or not request.keep_alive
        lines = [b"HTTP/1.1 %d %b\r\n" % (status, _reason(status)), b"Date: ", _Date.now(), b"\r\n", extra]
        for name, value in headers.items():
            if name.lower() not in _NO_BODY_HEADERS:
                if "\n" in value or "\r" in value or "\n" in name or "\r" in name:
                    raise ValueError(f"the answer's header {name[:40]!r} holds a line break")
                lines.append(b"%b: %b\r\n" % (name.encode("latin-1"), value.encode()))
        if close:
            lines.append(b"Connection: close\r\n")
        elif request.version == "1.0":
            lines.append(b"Connection: keep-alive\r\n")
        lines.append(b"\r\n")
        return b"".join(lines)

    def _answer(self, request: Request, reply: web.Response, close: bool, head_only: bool) -> None:
        body = reply.body
        data = body if isinstance(body, bytes) else b""
        length = b"Content-Length: %d\r\n" % len(data)
        try:
            head = self.head(request, reply.status, reply.headers, length, False if close else None)
        except ValueError:
            log.exception("refused to send an answer")
            self.write(_refusal(500))
            return
        self.write(head if head_only else head + data)

    def _finished(self, close: bool) -> None:
        self.task = None
        self.current = None
        if self.refusal:
            self.write(_refusal(self.refusal))
            close = True
        if close:
            self.close()
            return
        self.idle_since = self.loop.time()
        if self.waiting:
            self._next()
        else:
            self.head_deadline = self.loop.time() + self.server.header_timeout

    def _next(self) -> None:
        """Start the next request read ahead, unless the client is not reading its answers
        (their bytes would pile up here): then once it reads again."""
        if self.current is None and self.waiting and not self.writing_paused:
            self._start(self.waiting.popleft())
            if self.reading_paused and len(self.waiting) < PIPELINE // 2:
                self._resume_reading()

    def resume_body(self) -> None:
        """A handler waits for its body: read, even if pipelined requests wait."""
        if self.reading_paused:
            self._resume_reading()

    async def left(self) -> None:
        """The client is gone: the handler's cancellation (``connection_lost`` cancels it)
        arrives here, as it would at its next wait; without one (the handler closed the
        connection itself) a ``ConnectionResetError``."""
        await asyncio.sleep(0)
        raise ConnectionResetError("the client closed its connection")

    async def drained(self) -> None:
        if self.gone:
            await self.left()
        if not self.writing_paused:
            return
        self._drain = self.loop.create_future()
        await self._drain

    @property
    def gone(self) -> bool:
        """Lost or closing: nothing more is written (a cut stream must not end well)."""
        return self.lost or self.transport is None or self.transport.is_closing()

    def write(self, data: bytes) -> None:
        transport = self.transport
        if transport is not None and not self.lost and not transport.is_closing():
            transport.write(data)

    def _refuse(self, status: int) -> None:
        """A request that cannot be parsed: no more reading, and its refusal. A request
        whose own body broke is refused at once (its handler cancelled); one after an
        answer under way is refused once that answer is written."""
        self.refused = True
        self._stop_reading()
        if self.current is None or self.current is self.parsing:
            self.write(_refusal(status))
            self.force_close()
        else:
            self.refusal = status

    def _stop_reading(self) -> None:
        if self.transport is not None and not self.reading_paused and not self.lost:
            self.reading_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self.transport is not None and self.reading_paused and not self.lost and not self.refused:
            self.reading_paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        """Close after what was written (the answers' bytes) has been sent."""
        self.head_deadline = 0.0
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def force_close(self) -> None:
        """Close now; a handler under way is cancelled."""
        self.close()
        if self.task is not None and not self.task.done():
            self.task.cancel()

    @property
    def busy(self) -> bool:
        """A request is being answered or waits for its turn."""
        return self.current is not None or bool(self.waiting)


def _reason(status: int) -> bytes:
    found = _KNOWN.get(status)
    if found is None:
        try:
            found = HTTPStatus(status).phrase.encode()
        except ValueError:
            found = b"Unknown"
        _KNOWN[status] = found
    return found


_KNOWN: dict[int, bytes] = {200: b"OK"}
