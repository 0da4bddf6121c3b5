"""The gateway's HTTP/1.1 client to the engines: keep-alive connections per engine address.

Why not aiohttp's client: it was about half of the gateway's time per request (a profile
at concurrency 64, bench/RESULTS.md); the gateway needs only POST, a few fixed headers, the
status, the Content-Type and the body as it arrives. Responses are parsed by ``httptools``
(llhttp, as in uvicorn): status, headers, Content-Length, chunked and close-delimited bodies.

Contract
--------
``Upstreams.request(address, path, body, read_timeout)`` sends one ``POST`` and returns an
``Answer`` once its status line and headers are in. The caller reads the body with
``Answer.read()`` (whole) or ``Answer.next_chunk()`` (what arrived since the last call,
``b""`` at the end) and always calls ``Answer.release()`` (in a ``finally``):

- A connection goes back to the pool only after a complete answer that allows keep-alive;
  otherwise ``release`` closes it. So a caller that stops reading (the client went away,
  its handler was cancelled) closes the engine's connection, and the engine stops
  generating.
- ``connect_timeout`` bounds a TCP connect. ``read_timeout`` bounds every wait for bytes
  from the engine: until the first byte of the answer, and every gap after it. Time during
  which reading is paused because the caller is behind does not count.
- Reading from the engine pauses while more than ``HIGH_WATER`` bytes of body wait for the
  caller, and resumes when the caller has taken them.
- ``Upstreams.retain(addresses)`` says which addresses are in rotation (the gateway calls
  it whenever its pool changes): the idle connections to any other address are closed at
  once, and a connection to one is closed instead of pooled when its answer is released.
  Requests in flight to an address that left go on to their end on their connection. So
  an engine being drained sees its connections fall to none as its requests end (``apply``
  waits for that). Until the first call, every address is kept.

Errors, all ``UpstreamError`` (defined in ``llmgw_cli.errors``)::

    UpstreamError
    ├── ConnectFailed   no connection (refused, unreachable, connect timeout): nothing was
    │                   sent; another replica may be tried
    ├── Disconnected    the connection closed before any byte of the answer; ``reused``
    │                   says it was a pooled keep-alive connection (most likely closed by
    │                   the engine while idle: one retry on a fresh connection is safe)
    ├── ReadTimeout     no byte for ``read_timeout`` seconds
    └── BrokenAnswer    the connection closed in the middle of the answer, or the answer
                        is not HTTP
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import cast

import httptools

from llmgw_cli.errors import BrokenAnswer, ConnectFailed, Disconnected, ReadTimeout, UpstreamError

HIGH_WATER = 256 * 1024


class _Connection(asyncio.Protocol):
    """One TCP connection to an engine; it hands what it reads to the current ``Answer``.

    Its one timer outlives answers: it fires at the earliest deadline of the answer in
    flight, which re-arms it from its last byte (or leaves it off when none is in flight).
    An answer moves it earlier only when its own deadline is sooner, so a busy keep-alive
    connection does not add and cancel a timer per request."""

    def __init__(self, pool: Upstreams, address: str) -> None:
        self.pool = pool
        self.address = address
        self.transport: asyncio.Transport | None = None
        self.answer: Answer | None = None
        self.closed = False
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A TCP connection's transport: asyncio's is an asyncio.Transport; uvloop's has the
        # same methods without that base class, so no isinstance check can say which.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.answer is None:  # bytes nobody asked for: this connection can't be trusted
            self.close()
            return
        self.answer.feed(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.pool.forget(self)
        if self.answer is not None:
            self.answer.lost(exc)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def watch(self, deadline: float) -> None:
        """Be woken by ``deadline`` at the latest."""
        if self._timer is not None:
            if self._timer.when() <= deadline:
                return
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_at(deadline, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if self.answer is not None:
            deadline = self.answer.check_timeout()
            if deadline is not None:
                self.watch(deadline)


class Answer:
    """One response: status and Content-Type once the headers are in, then the body."""

    def __init__(self, connection: _Connection, read_timeout: float, reused: bool) -> None:
        self.status = 0
        self.content_type = ""
        self._conn = connection
        self._reused = reused
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpResponseParser(self)
        self._head: asyncio.Future[None] = self._loop.create_future()
        self._pieces: list[bytes] = []  # body pieces of the read being parsed
        self._ready: list[bytes] = []  # body not yet taken by the caller
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._error: UpstreamError | None = None
        self._complete = False
        self._keep_alive = False
        self._delimited = False  # Content-Length or chunked: the body's end is known
        self._started = False  # a byte of the answer arrived
        self._paused = False
        self._released = False
        self._timeout = read_timeout
        self._last = self._loop.time()
        connection.watch(self._last + read_timeout)

    @property
    def complete(self) -> bool:
        """The whole answer has arrived (the caller may not have taken all of it yet)."""
        return self._complete

    # --- the caller's side ------------------------------------------------------------

    async def read(self) -> bytes:
        """The whole body."""
        parts: list[bytes] = []
        while True:
            if self._ready:
                parts.append(self._take())  # taken as it comes: reading never stays paused
            if self._complete:
                return parts[0] if len(parts) == 1 else b"".join(parts)
            if self._error is not None:
                raise self._error
            await self._wait()

    async def next_chunk(self) -> bytes:
        """The body that arrived since the last call (one engine read or more), ``b""`` at
        its end."""
        while not self._ready:
            if self._error is not None:
                raise self._error
            if self._complete:
                return b""
            await self._wait()
        return self._take()

    def release(self) -> None:
        """Back to the pool after a complete keep-alive answer, else close the connection."""
        if self._released:
            return
        self._released = True
        conn = self._conn
        conn.answer = None
        if self._complete and self._keep_alive and not conn.closed:
            conn.pool.put(conn)
        else:
            conn.close()

    def _take(self) -> bytes:
        data = self._ready[0] if len(self._ready) == 1 else b"".join(self._ready)
        self._ready.clear()
        self._buffered = 0
        if self._paused:
            self._paused = False
            self._last = self._loop.time()
            if self._conn.transport is not None:
                self._conn.transport.resume_reading()
        return data

    async def _wait(self) -> None:
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # --- the connection's side --------------------------------------------------------

    def feed(self, data: bytes) -> None:
        self._started = True
        self._last = self._loop.time()
        if self._complete:  # bytes after the end of the answer: not a connection to reuse
            self._keep_alive = False
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(BrokenAnswer(f"the engine's answer is not valid HTTP: {exc}"))
            self._conn.close()
            return
        if self._pieces:
            piece = self._pieces[0] if len(self._pieces) == 1 else b"".join(self._pieces)
            self._pieces.clear()
            self._ready.append(piece)
            self._buffered += len(piece)
            if self._buffered > HIGH_WATER and not self._paused and self._conn.transport is not None:
                self._paused = True
                self._conn.transport.pause_reading()
        self._wake()

    def lost(self, exc: Exception | None) -> None:
        if self._complete or self._error is not None:
            return
        why = f": {exc}" if exc else ""
        if not self._started:
            self._fail(
                Disconnected(f"the engine closed the connection before answering{why}", reused=self._reused)
            )
        elif self._head.done() and not self._delimited:
            self.on_message_complete()  # a body that ends with the connection
            self._keep_alive = False
            self._wake()
        else:
            self._fail(BrokenAnswer(f"the engine closed the connection in the middle of its answer{why}"))

    def _fail(self, error: UpstreamError) -> None:
        self._error = error
        if not self._head.done():
            self._head.set_exception(error)
            self._head.exception()  # retrieved: a caller cancelled meanwhile logs nothing
        self._wake()

    def check_timeout(self) -> float | None:
        """Fail when the engine has been silent too long; else the next deadline (None when
        there is nothing left to wait for)."""
        if self._complete or self._error is not None:
            return None
        now = self._loop.time()
        if self._paused:  # the caller is behind: not the engine's silence
            return now + self._timeout
        deadline = self._last + self._timeout
        if now >= deadline:
            self._fail(ReadTimeout(f"no answer from the engine for {self._timeout:g}s"))
            self._conn.close()
            return None
        return deadline

    # --- httptools callbacks ----------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        lowered = name.lower()
        if lowered == b"content-type":
            self.content_type = value.decode("latin-1")
        elif lowered in (b"content-length", b"transfer-encoding"):
            self._delimited = True

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        if not self._head.done():
            self._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self._pieces.append(body)

    def on_message_complete(self) -> None:
        self._complete = True
        self._keep_alive = self._parser.should_keep_alive()
        if not self._head.done():  # no body and no header callback (should not happen)
            self.status = self._parser.get_status_code()
            self._head.set_result(None)


class Upstreams:
    """Keep-alive connections per engine address (``host:port``), no limit on their number
    (the gateway's per-model admission is the limit)."""

    def __init__(self, connect_timeout: float, headers: dict[str, str]) -> None:
        self._auth: dict[str, tuple[bytes, ...]] = {}
        self._default_auth: tuple[bytes, ...] = ()
        self._keys: dict[str, tuple[str, ...]] = {}
        self._default_keys: tuple[str, ...] = ()
        self.configure(connect_timeout, headers)
        # Per address, the idle connections; a dict as an ordered set, so that the most
        # recently used (the least likely to have been closed by the engine) goes first.
        self._idle: dict[str, dict[_Connection, None]] = {}
        self._routed: frozenset[str] | None = None  # the addresses in rotation; None: all

    def configure(self, connect_timeout: float, headers: dict[str, str]) -> None:
        """Settings of the next requests (a reload changes them; pooled connections stay)."""
        self.connect_timeout = connect_timeout
        self._headers = "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode("latin-1")

    def configure_keys(self, by_host: dict[str, tuple[str, ...]], default: tuple[str, ...] = ()) -> None:
        """The engine keys by engine host (keys are per node), current key first; ``default``
        for a host not in the map. A second key is the one the host held before a
        rotation: an engine still running with it answers 401 to the first, and the
        request is sent once more with the other (nothing was processed)."""

        def lines(keys: tuple[str, ...]) -> tuple[bytes, ...]:
            return tuple(f"Authorization: Bearer {k}\r\n".encode("latin-1") for k in keys if k)

        self._auth = {host: lines(keys) for host, keys in by_host.items()}
        self._default_auth = lines(default)
        self._keys = {host: tuple(k for k in keys if k) for host, keys in by_host.items()}
        self._default_keys = tuple(k for k in default if k)

    def keys_for(self, address: str) -> tuple[str, ...]:
        """The engine keys of the node at ``address`` (host:port), current key first: for
        requests the gateway makes of its own (the engines' /metrics)."""
        return self._keys.get(address.rpartition(":")[0].strip("[]"), self._default_keys)

    async def request(
        self, address: str, path: str, body: bytes, read_timeout: float, *, fresh: bool = False
    ) -> Answer:
        """POST ``body`` to ``http://{address}{path}``; ``fresh``: on a new connection."""
        auth = self._auth.get(address.rpartition(":")[0].strip("[]"), self._default_auth) or (b"",)
        for attempt, line in enumerate(auth):
            answer = await self._send(address, path, body, read_timeout, line, fresh=fresh)
            if answer.status != 401 or attempt == len(auth) - 1:
                return answer
            # Refused before any work: drain the short 401 (the connection stays usable)
            # and try the host's other key.
            try:
                await answer.read()
            finally:
                answer.release()
        raise AssertionError("unreachable: the last key's answer is returned")

    async def _send(
        self, address: str, path: str, body: bytes, read_timeout: float, auth: bytes, *, fresh: bool
    ) -> Answer:
        conn = None if fresh else self._take(address)
        reused = conn is not None
        if conn is None:
            conn = await self._connect(address)
        assert conn.transport is not None
        answer = conn.answer = Answer(conn, read_timeout, reused)
        conn.transport.write(
            b"POST %b HTTP/1.1\r\nHost: %b\r\n%b%bContent-Length: %d\r\n\r\n%b"
            % (path.encode("latin-1"), address.encode("latin-1"), self._headers, auth, len(body), body)
        )
        try:
            await answer._head
        except BaseException:
            answer.release()
            raise
        return answer

    def _take(self, address: str) -> _Connection | None:
        idle = self._idle.get(address)
        while idle:
            conn, _ = idle.popitem()
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                return conn
        return None

    async def _connect(self, address: str) -> _Connection:
        host, _, port = address.rpartition(":")
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self, address), host.strip("[]"), int(port)
                )
        except TimeoutError:
            raise ConnectFailed(
                f"cannot connect to {address}: no answer in {self.connect_timeout:g}s"
            ) from None
        except (OSError, ValueError) as exc:
            raise ConnectFailed(f"cannot connect to {address}: {exc}") from None
        return conn

    def put(self, conn: _Connection) -> None:
        if self._routed is not None and conn.address not in self._routed:
            conn.close()  # its engine left the rotation: no connection is kept to it
            return
        self._idle.setdefault(conn.address, {})[conn] = None

    def retain(self, addresses: Iterable[str]) -> None:
        """The addresses in rotation now: idle connections to any other are closed, and
        a connection to one is not pooled again until it is back in rotation."""
        self._routed = frozenset(addresses)
        for address in [a for a in self._idle if a not in self._routed]:
            for conn in list(self._idle.pop(address)):
                conn.close()

    def forget(self, conn: _Connection) -> None:
        idle = self._idle.get(conn.address)
        if idle is not None:
            idle.pop(conn, None)
            if not idle:
                del self._idle[conn.address]

    def idle_count(self, address: str) -> int:
        return len(self._idle.get(address, ()))

    def close(self) -> None:
        """Close every idle connection (those in use close when their answers are released)."""
        for idle in list(self._idle.values()):
            for conn in list(idle):
                conn.close()
        self._idle.clear()
