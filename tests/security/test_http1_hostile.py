"""The lean HTTP/1.1 server of the public listener (``gateway/serving/http1.py``) against
hostile and odd clients, on a real socket on loopback: malformed heads and bodies,
request smuggling, huge and repeated headers, pipelining, HTTP/1.0, ``Expect``, and a
fuzz test of the parser boundary. Every one gets an answer under 500 or a closed
connection, never a traceback, and the server serves the next client.

The server runs in a thread of its own with echo handlers; the gateway's own paths on it
are tested through `llmgw gateway run` (tests/gateway, test_gateway_hostile.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import logging
import re
import socket
import threading
import time
import zlib
from collections.abc import Iterator

import pytest
import uvloop
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw_cli.gateway.serving import http1
from tests.gateway.harness import trickle_until_closed
from tests.waiting import wait_until

MAX_BODY = 20_000
HEADER_TIMEOUT = 1.0


async def _echo(request: http1.Request) -> web.Response:
    """The body read whole (413 past the limit), with what the request said of itself."""
    try:
        async with asyncio.timeout(2):
            body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return web.Response(status=413, text="too large")
    except TimeoutError:
        late = web.Response(status=408, text="late")
        late.force_close()
        return late
    auth = request.headers.get("Authorization", "-")
    return web.Response(
        body=b"%s %s %d %s|"
        % (request.method.encode(), request.path.encode(), len(body), auth.encode("utf-8", "replace"))
        + body
    )


async def _stream(request: http1.Request) -> http1.Stream:
    out = await request.open_stream(200, {"Content-Type": "text/event-stream"})
    for n in range(3):
        await out.write(b"data: %d\n\n" % n)
    await out.write_eof(b"data: [DONE]\n\n")
    return out


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def problems(self) -> list[str]:
        return [r.getMessage() for r in self.records if r.exc_info or r.levelno >= logging.ERROR]


class Serving:
    """An ``http1.Server`` on loopback, in a thread with its own event loop."""

    def __init__(self, loop: str = "asyncio") -> None:
        self.records = Records()
        logging.getLogger("llmgw.http").addHandler(self.records)
        self.loop = uvloop.new_event_loop() if loop == "uvloop" else asyncio.new_event_loop()
        self.server = http1.Server(
            {("POST", "/echo"): _echo, ("GET", "/echo"): _echo, ("GET", "/stream"): _stream},
            {},
            max_body=MAX_BODY,
            header_timeout=HEADER_TIMEOUT,
        )
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        started.wait(10)

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        listening = self.loop.run_until_complete(self.loop.create_server(self.server, "127.0.0.1", 0))
        self.port = listening.sockets[0].getsockname()[1]
        watch = self.loop.create_task(self.server.watch_heads())
        started.set()
        self.loop.run_forever()
        watch.cancel()
        listening.close()
        self.loop.run_until_complete(self.server.close())
        self.loop.close()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        logging.getLogger("llmgw.http").removeHandler(self.records)


@pytest.fixture(scope="module", params=["asyncio", "uvloop"])
def serving(request: pytest.FixtureRequest) -> Iterator[Serving]:
    """The server on each event loop the gateway runs on."""
    found = Serving(request.param)
    yield found
    found.stop()


def _talk(port: int, data: bytes, wait: float = 5.0, *, half_close: bool = False) -> tuple[bytes, bool]:
    """Send ``data`` (then, ``half_close``, nothing more: the client's end of the stream);
    what comes back until the server closes (True) or ``wait`` passes without a byte (False)."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as sock:
        try:
            sock.sendall(data)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except TimeoutError:
            return answer, False
        except ConnectionResetError:
            pass
    return answer, True


def _statuses(answer: bytes) -> list[int]:
    return [int(status) for status in re.findall(rb"HTTP/1\.1 (\d{3}) ", answer)]


def _works(port: int) -> None:
    answer, _ = _talk(
        port, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\nhi"
    )
    assert _statuses(answer) == [200] and answer.endswith(b"POST /echo 2 -|hi"), answer


def _clean(serving: Serving) -> None:
    assert serving.records.problems() == []


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        # request smuggling: both framings, two lengths, an odd encoding
        (b"POST /echo HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
        (b"POST /echo HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 5\r\n\r\nabcde", 400),
        (b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n", 400),
        (b"POST /echo HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400),
        (b"POST /echo HTTP/1.1\r\nContent-Length: 1x\r\n\r\n", 400),
        # bad chunk sizes
        (b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nab\r\n0\r\n\r\n", 400),
        (b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffffff\r\nab\r\n", 400),
        # bad bytes in the head
        (b"GET /echo HTTP/1.1\r\nAuthorization: Bearer a\x01b\r\n\r\n", 400),
        (b"GET /echo HTTP/1.1\r\nX: a\rb\r\n\r\n", 400),
        (b"GET /ec ho HTTP/1.1\r\n\r\n", 400),
        (b"G\x00T /echo HTTP/1.1\r\n\r\n", 400),
        (b"GET /echo HTTP/9.9\r\n\r\n", 400),
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", 400),  # a TLS hello on plain HTTP
        # huge or many headers, a huge request line
        (b"GET /echo HTTP/1.1\r\nX: " + b"a" * 100_000 + b"\r\n\r\n", 431),
        (b"GET /echo HTTP/1.1\r\n" + b"X: a\r\n" * 500 + b"\r\n", 431),
        (b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\n\r\n", 431),
        # a body over the limit, declared or chunked
        (b"POST /echo HTTP/1.1\r\nContent-Length: 50000\r\n\r\n" + b"a" * 50_000, 413),
        (
            b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
            + (b"100\r\n" + b"a" * 256 + b"\r\n") * 100,
            413,
        ),
        # unknown paths and methods
        (b"GET /nothing HTTP/1.1\r\n\r\n", 404),
        (b"DELETE /echo HTTP/1.1\r\n\r\n", 405),
    ],
)
def test_hostile_requests_get_a_4xx_and_a_close(serving: Serving, request_bytes: bytes, status: int) -> None:
    answer, closed = _talk(serving.port, request_bytes)
    assert _statuses(answer)[:1] == [status], answer[:300]
    if status not in {404, 405}:
        assert closed, answer[:300]
    _works(serving.port)
    _clean(serving)


def test_undecodable_credentials_reach_the_handler_as_text(serving: Serving) -> None:
    answer, _ = _talk(
        serving.port, b"GET /echo HTTP/1.1\r\nAuthorization: Bearer \xff\r\nConnection: close\r\n\r\n"
    )
    assert _statuses(answer) == [200] and answer.endswith("GET /echo 0 Bearer ÿ|".encode()), answer
    _clean(serving)


def test_a_head_that_trickles_in_is_dropped_at_the_header_timeout(serving: Serving) -> None:
    head = b"GET /echo HTTP/1.1\r\nHost: x\r\nX-Long: aaaaaaaaaaaaaaaaaaaaaaaa"
    closed = trickle_until_closed(serving.port, head, pause=0.2, give_up=HEADER_TIMEOUT + 2)
    assert closed is not None and closed < HEADER_TIMEOUT + 1, closed
    _clean(serving)


def test_an_idle_kept_alive_connection_is_closed_after_the_header_timeout(serving: Serving) -> None:
    with socket.create_connection(("127.0.0.1", serving.port), timeout=5) as sock:
        sock.sendall(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        started = time.monotonic()
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        waited = time.monotonic() - started
    assert _statuses(answer) == [200] and HEADER_TIMEOUT * 0.9 < waited < HEADER_TIMEOUT + 1, (answer, waited)


def test_a_body_that_stalls_is_answered_408(serving: Serving) -> None:
    answer, closed = _talk(serving.port, b"POST /echo HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc", wait=5)
    assert _statuses(answer) == [408] and closed, answer


def test_pipelined_requests_are_answered_in_order(serving: Serving) -> None:
    requests = b"".join(
        b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(b"n%d" % n), b"n%d" % n)
        for n in range(40)
    )
    answer, _ = _talk(serving.port, requests + b"GET /stream HTTP/1.1\r\nConnection: close\r\n\r\n")
    assert _statuses(answer) == [200] * 41
    bodies = [answer.index(b"|n%d" % n) for n in range(40)]
    assert bodies == sorted(bodies)
    assert answer.endswith(b"0\r\n\r\n") and b"data: [DONE]" in answer
    _clean(serving)


def test_http_1_0_gets_a_closed_connection_and_a_close_delimited_stream(serving: Serving) -> None:
    answer, closed = _talk(serving.port, b"GET /stream HTTP/1.0\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert closed and _statuses(answer) == [200] and b"chunked" not in head
    assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
    answer, closed = _talk(
        serving.port, b"GET /echo HTTP/1.0\r\nConnection: keep-alive\r\n\r\nGET /echo HTTP/1.0\r\n\r\n"
    )
    assert closed and _statuses(answer) == [200, 200] and b"Connection: keep-alive" in answer


def test_expect_100_continue_is_answered_before_the_body(serving: Serving) -> None:
    with socket.create_connection(("127.0.0.1", serving.port), timeout=5) as sock:
        sock.sendall(
            b"POST /echo HTTP/1.1\r\nContent-Length: 2\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n"
        )
        assert sock.recv(65536) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(b"ok")
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert _statuses(answer) == [200] and answer.endswith(b"|ok")


@pytest.mark.parametrize(
    ("coding", "body", "status"),
    [
        (b"gzip", gzip.compress(b"hello"), 200),
        (b"deflate", zlib.compress(b"hello"), 200),
        (b"deflate", zlib.compress(b"hello")[2:-4], 200),  # a raw deflate stream, as some clients send
        (b"gzip", gzip.compress(b"\0" * 10_000_000), 413),  # 10 MB from 10 KB: a bomb
        (b"gzip", b"not gzip at all", 400),
        (b"gzip", gzip.compress(b"hello")[:-12], 400),  # cut short
        (b"br", b"whatever", 415),
        (b"zstd", b"whatever", 415),
    ],
)
def test_compressed_bodies_are_read_within_the_limit(
    serving: Serving, coding: bytes, body: bytes, status: int
) -> None:
    head = b"POST /echo HTTP/1.1\r\nContent-Encoding: %b\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
    answer, closed = _talk(serving.port, head % (coding, len(body)) + body)
    assert _statuses(answer) == [status] and closed, answer[:300]
    if status == 200:
        assert answer.endswith(b"|hello")
    _clean(serving)


def test_a_head_request_gets_no_body(serving: Serving) -> None:
    answer, _ = _talk(serving.port, b"HEAD /echo HTTP/1.1\r\nConnection: close\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert _statuses(answer) == [200] and b"Content-Length: " in head and body == b""


def test_a_client_that_leaves_cancels_its_handler() -> None:
    cancelled = threading.Event()

    async def slow(_request: http1.Request) -> web.Response:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return web.Response()

    found = Serving()
    found.server.routes["GET", "/slow"] = slow
    try:
        with socket.create_connection(("127.0.0.1", found.port), timeout=5) as sock:
            sock.sendall(b"GET /slow HTTP/1.1\r\n\r\n")
            time.sleep(0.2)
        assert cancelled.wait(5)
        _works(found.port)
        assert found.records.problems() == []
    finally:
        found.stop()


def test_a_client_gone_before_its_stream_begins_ends_the_handler_without_a_traceback() -> None:
    raised: list[type[BaseException]] = []

    async def late(request: http1.Request) -> http1.Stream:
        assert request.transport is not None
        request.transport.abort()  # as if the client had gone a moment before the head
        try:
            return await request.open_stream(200, {"Content-Type": "text/event-stream"})
        except BaseException as exc:
            raised.append(type(exc))
            raise

    found = Serving()
    found.server.routes["GET", "/late"] = late
    try:
        answer, closed = _talk(found.port, b"GET /late HTTP/1.1\r\n\r\n")
        assert answer == b"" and closed
        wait_until(lambda: raised, timeout=5, what="the handler to end")
        assert raised[0] in {asyncio.CancelledError, ConnectionResetError}
        _works(found.port)
        assert found.records.problems() == []
    finally:
        found.stop()


def test_a_client_that_sends_requests_but_never_reads_holds_a_bounded_number_of_answers() -> None:
    answered = 0

    async def big(_request: http1.Request) -> web.Response:
        nonlocal answered
        answered += 1
        return web.Response(body=b"x" * 65536)

    found = Serving()
    found.server.routes["GET", "/big"] = big
    try:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", found.port))
            sock.settimeout(2)
            with contextlib.suppress(TimeoutError):
                sock.sendall(b"GET /big HTTP/1.1\r\n\r\n" * 20_000)  # blocks once the server stops reading
            time.sleep(0.5)
            # Only what fits the socket buffers and the transport's (then writing pauses)
            # is answered, plus the requests read ahead meanwhile; not 20,000 answers.
            assert answered < 500, answered
        assert found.records.problems() == []
    finally:
        found.stop()


# --- fuzzing the parser boundary -------------------------------------------------------------

TOKEN = st.sampled_from([b"GET", b"POST", b"HEAD", b"PUT", b"G T", b"", b"get", b"\xff", b"POST\x00"])
PATH = st.sampled_from([b"/echo", b"/stream", b"/", b"*", b"/echo?x=1", b"//", b"/\xff", b""]) | st.binary(
    max_size=20
)
VERSION = st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.1 ", b"http/1.1", b""])
NAME = st.sampled_from(
    [b"Host", b"Content-Length", b"Transfer-Encoding", b"Connection", b"Expect", b"Authorization", b"X"]
) | st.binary(max_size=12)
VALUE = (
    st.sampled_from([b"0", b"5", b"-1", b"chunked", b"close", b"keep-alive", b"100-continue", b"Bearer \xff"])
    | st.binary(max_size=30)
    | st.integers(0, 10**20).map(lambda n: str(n).encode())
)
HEADERS = st.lists(st.tuples(NAME, st.sampled_from([b": ", b":", b" : ", b"\t"]), VALUE), max_size=6)
CHUNKED = st.lists(
    st.tuples(
        st.sampled_from([b"3", b"0", b"zz", b"-1", b"3;x=y", b"FFFFFFFFFFFFFFFFF", b""]),
        st.binary(max_size=8),
    ),
    max_size=4,
).map(lambda parts: b"".join(size + b"\r\n" + data + b"\r\n" for size, data in parts))
BODY = st.binary(max_size=64) | CHUNKED
ENDING = st.sampled_from([b"\r\n", b"\n", b"\r", b"\r\n\r\n"])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    method=TOKEN,
    path=PATH,
    version=VERSION,
    headers=HEADERS,
    ending=ENDING,
    body=BODY,
    pipelined=st.booleans(),
)
def test_fuzzed_heads_and_bodies_get_an_answer_under_500_or_a_close(  # noqa: PLR0917 (hypothesis gives each)
    serving: Serving,
    method: bytes,
    path: bytes,
    version: bytes,
    headers: list[tuple[bytes, bytes, bytes]],
    ending: bytes,
    body: bytes,
    pipelined: bool,
) -> None:
    head = b"%b %b %b\r\n" % (method, path, version) + b"".join(n + s + v + ending for n, s, v in headers)
    request = head + b"\r\n" + body
    if pipelined:
        request += b"GET /echo HTTP/1.1\r\nConnection: close\r\n\r\n"
    # A pipelined request asking to close ends the conversation; else the client's close.
    answer, closed = _talk(serving.port, request, wait=HEADER_TIMEOUT + 3, half_close=not pipelined)
    statuses = _statuses(answer)
    assert all(s < 500 for s in statuses), answer[:500]
    assert closed, answer[:500]  # every conversation ends: by the client's close, a refusal or a timeout
    _clean(serving)
