"""The upstream client against a real asyncio server on loopback that misbehaves on purpose."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import pytest
import uvloop

from llmgw_cli.errors import BrokenAnswer, ConnectFailed, Disconnected, ReadTimeout
from llmgw_cli.gateway.serving.upstream import Answer, Upstreams

HEADERS = {"Content-Type": "application/json", "Authorization": "Bearer engine"}


def plain(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%b\r\n%b" % (
        len(body),
        extra,
        body,
    )


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"

# What the engine does with the n-th request (from 0) on one connection, given the request.
Behaviour = Callable[[asyncio.StreamWriter, int, bytes], Awaitable[None]]


@dataclass
class Engine:
    """A loopback HTTP server: counts connections, records requests, notices hang-ups."""

    behaviour: Behaviour
    connections: int = 0
    open: int = 0  # connections not yet closed (what ``ss`` counts as established)
    requests: list[bytes] = field(default_factory=list)
    hung_up: asyncio.Event = field(default_factory=asyncio.Event)
    port: int = 0

    async def start(self) -> asyncio.Server:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        return server

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open += 1
        n = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                await self.behaviour(writer, n, request)
                n += 1
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            self.hung_up.set()
        except RuntimeError:
            # uvloop refuses a write on a transport the client closed with RuntimeError
            # ("the handler is closed") where asyncio's own loop raises ConnectionError.
            if not writer.is_closing():
                raise
            self.hung_up.set()
        finally:
            self.open -= 1
            writer.close()


def run(
    behaviour: Behaviour,
    scenario: Callable[[Engine, Upstreams], Awaitable[None]],
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
) -> None:
    """``scenario`` against an engine with ``behaviour``, on the event loop the tests run on
    (``LLMGW_TEST_LOOP``, tests/gateway/conftest.py) unless ``loop_factory`` makes another."""

    async def main() -> None:
        engine = Engine(behaviour)
        server = await engine.start()
        pool = Upstreams(1.0, HEADERS)
        try:
            await scenario(engine, pool)
        finally:
            pool.close()
            server.close()
            await server.wait_closed()

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(main())


async def answers_ok(writer: asyncio.StreamWriter, n: int, request: bytes) -> None:
    writer.write(plain(b'{"n":%d}' % n))


async def streams(writer: asyncio.StreamWriter, n: int, request: bytes) -> None:
    writer.write(SSE_HEAD + chunk(b"data: 1\n\n"))
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.write(chunk(b"data: 2\n\n") + chunk(b"data: [DONE]\n\n"))
    await asyncio.sleep(0.05)
    writer.write(b"0\r\n\r\n")


async def all_chunks(answer: Answer) -> list[bytes]:
    """Every read of a streamed answer, in order, until its end."""
    received = []
    while piece := await answer.next_chunk():
        received.append(piece)
    return received


def test_keep_alive_reuses_one_connection_and_sends_the_headers() -> None:
    async def scenario(engine: Engine, pool: Upstreams) -> None:
        for n in range(3):
            answer = await pool.request(engine.address, "/v1/chat/completions", b'{"a":1}', 5)
            try:
                assert (answer.status, answer.content_type) == (200, "application/json")
                assert await answer.read() == b'{"n":%d}' % n
            finally:
                answer.release()
            assert pool.idle_count(engine.address) == 1
        assert engine.connections == 1
        first = engine.requests[0]
        assert first.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
        assert f"Host: {engine.address}\r\n".encode() in first
        assert b"Authorization: Bearer engine\r\n" in first and first.endswith(b'\r\n\r\n{"a":1}')

    run(answers_ok, scenario)


def test_chunked_stream_arrives_read_by_read_and_the_connection_is_reused() -> None:
    async def scenario(engine: Engine, pool: Upstreams) -> None:
        for _ in range(2):
            answer = await pool.request(engine.address, "/v1/completions", b"{}", 5)
            try:
                assert answer.content_type == "text/event-stream"
                assert await all_chunks(answer) == [b"data: 1\n\n", b"data: 2\n\ndata: [DONE]\n\n"]
            finally:
                answer.release()
        assert engine.connections == 1

    run(streams, scenario)


def test_a_large_body_is_read_whole_while_reading_pauses_and_resumes() -> None:
    big = b"x" * (3 * 1024 * 1024)

    async def sends_big(writer: asyncio.StreamWriter, n: int, request: bytes) -> None:
        writer.write(plain(big))
        await writer.drain()

    async def scenario(engine: Engine, pool: Upstreams) -> None:
        answer = await pool.request(engine.address, "/v1/embeddings", b"{}", 0.1)
        try:
            # Not reading for longer than the read timeout: reading from the engine pauses
            # at the high-water mark, and a paused wait is no engine's silence.
            await asyncio.sleep(0.3)
            assert await answer.read() == big
        finally:
            answer.release()

    run(sends_big, scenario)


def test_the_client_runs_on_uvloop() -> None:
    """uvloop's transports are no ``asyncio.Transport`` subclass: a keep-alive answer, a
    stream and a paused-then-resumed read all work on them (`llmgw gateway run` uses
    uvloop when it is installed)."""
    big = b"x" * (3 * 1024 * 1024)

    async def behaviour(writer: asyncio.StreamWriter, n: int, request: bytes) -> None:
        if n == 0:
            await answers_ok(writer, n, request)
        elif n == 1:
            await streams(writer, n, request)
        else:
            writer.write(plain(big))
            await writer.drain()

    async def scenario(engine: Engine, pool: Upstreams) -> None:
        assert type(asyncio.get_running_loop()) is uvloop.Loop
        answer = await pool.request(engine.address, "/v1/chat/completions", b"{}", 5)
        try:
            assert await answer.read() == b'{"n":0}'
        finally:
            answer.release()
        answer = await pool.request(engine.address, "/v1/completions", b"{}", 5)
        try:
            assert await all_chunks(answer) == [b"data: 1\n\n", b"data: 2\n\ndata: [DONE]\n\n"]
        finally:
            answer.release()
        answer = await pool.request(engine.address, "/v1/embeddings", b"{}", 0.1)
        try:
            await asyncio.sleep(0.3)  # past the read timeout: reading pauses at the high-water mark
            assert await answer.read() == big
        finally:
            answer.release()
        assert engine.connections == 1

    run(behaviour, scenario, loop_factory=uvloop.new_event_loop)


def test_a_body_delimited_by_the_end_of_the_connection() -> None:
    async def until_close(writer: asyncio.StreamWriter, n: int, request: bytes) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it")
        writer.close()

    async def scenario(engine: Engine, pool: Upstreams) -> None:
        answer = await pool.request(engine.address, "/v1/completions", b"{}", 5)
        try:
            assert (answer.content_type, await answer.read()) == ("", b"all of it")
        finally:
            answer.release()
        assert pool.idle_count(engine.address) == 0

    run(until_close, scenario)


def test_a_pooled_connection_closed_by_the_engine_is_stale_and_a_fresh_one_works() -> None:
    async def closes_the_second(writer: asyncio.StreamWriter, n: int, request: bytes) -> None:
        if n == 0:
            writer.write(plain(b"first"))
        else:  # as an engine whose keep-alive timer fired just as the request arrived
            writer.close()

    async def scenario(engine: Engine, pool: Upstreams) -> None:
        answer = await pool.request(engine.address, "/p", b"{}", 5)
        assert await answer.read() == b"first"
        answer.release()
        with pytest.raises(Disconnected) as stale:
            await pool.request(engine.address, "/p", b"{}", 5)
        assert stale.value.reused
        answer = await pool.request(engine.address, "/p", b"{}", 5, fresh=True)
        assert await answer.read() == b"first"
        answer.release()
        assert engine.connections == 2

    run(closes_the_second, scenario)


def test_a_connection_the_engine_closed_while_idle_is_skipped() -> None:
    async def closes_after(writer: asyncio.StreamWriter, n: int, request: bytes) -> None:
        writer.write(plain(b"ok"))  # keep-alive by HTTP/1.1, closed all the same
        await writer.drain()
        writer.close()

    async def scenario(engine: Engine, pool: Upstreams) -> None:
        for _ in range(2):
            answer = await pool.request(engine.address, "/p", b"{}", 5)
            assert await answer.read() == b"ok"
            answer.release()
            await asyncio.sleep(0.05)  # the close arrives while the connection is idle
        assert engine.connections == 2

    run(closes_after, scenario)


def test_a_fresh_connection_closed_without_an_answer() -> None:
    async def hangs_up(writer: asyncio.StreamWriter, n: int, request: bytes) -> None:
        writer.close()

    async def scenario(engine: Engine, pool: Upstreams) -> None:
        with pytest.raises(Disconnected) as failed:
            await pool.request(engine.address, "/p", b"{}", 5)
        assert not failed.value.reused

    run(hangs_up, scenario)


def test_an_answer_cut_mid_body() -> None:
    async def cuts(writer: asyncio.StreamWriter, n: int, request: bytes) -> None:
        if request.startswith(b"POST /plain"):
            writer.write(plain(b"0123456789")[:-4])  # Content-Length 10, 6 bytes sent
        else:
            writer.write(SSE_HEAD + chunk(b"data: 1\n\n"))  # no final 0-length chunk
        await writer.drain()
        writer.close()

    async def scenario(engine: Engine, pool: Upstreams) -> None:
        answer = await pool.request(engine.address, "/plain", b"{}", 5)
        with pytest.raises(BrokenAnswer):
            await answer.read()
        answer.release()
        answer = await pool.request(engine.address, "/stream", b"{}", 5)
        assert await answer.next_chunk() == b"data: 1\n\n"
        with pytest.raises(BrokenAnswer):
            await answer.next_chunk()
        answer.release()
        assert pool.idle_count(engine.address) == 0

    run(cuts, scenario)


def test_not_http_is_a_broken_answer() -> None:
    async def babbles(writer: asyncio.StreamWriter, n: int, request: bytes) -> None:
        writer.write(b"SSH-2.0-OpenSSH_9.2\r\n\r\n")

    async def scenario(engine: Engine, pool: Upstreams) -> None:
        with pytest.raises(BrokenAnswer):
            await pool.request(engine.address, "/p", b"{}", 5)

    run(babbles, scenario)


def test_read_timeout_before_the_first_byte_and_between_chunks() -> None:
    async def slow(writer: asyncio.StreamWriter, n: int, request: bytes) -> None:
        if request.startswith(b"POST /plain"):
            await asyncio.sleep(0.5)
            writer.write(plain(b"late"))
        else:
            writer.write(SSE_HEAD + chunk(b"data: 1\n\n"))
            await writer.drain()
            for _ in range(3):  # gaps of 0.1 s: each shorter than the timeout
                await asyncio.sleep(0.1)
                writer.write(chunk(b"data: more\n\n"))
                await writer.drain()
            await asyncio.sleep(0.5)

    async def scenario(engine: Engine, pool: Upstreams) -> None:
        started = asyncio.get_running_loop().time()
        with pytest.raises(ReadTimeout):
            await pool.request(engine.address, "/plain", b"{}", 0.2)
        assert asyncio.get_running_loop().time() - started < 0.45
        answer = await pool.request(engine.address, "/stream", b"{}", 0.2)
        received = []
        with pytest.raises(ReadTimeout):
            while piece := await answer.next_chunk():
                received.append(piece)
        answer.release()
        assert received == [b"data: 1\n\n"] + [b"data: more\n\n"] * 3  # 0.3 s in all: gaps count

    run(slow, scenario)


def test_connect_refused() -> None:
    async def scenario(engine: Engine, pool: Upstreams) -> None:
        with pytest.raises(ConnectFailed):
            await pool.request("127.0.0.1:1", "/p", b"{}", 5)

    run(answers_ok, scenario)


def test_a_reader_that_goes_away_closes_the_engine_connection() -> None:
    async def endless(writer: asyncio.StreamWriter, n: int, request: bytes) -> None:
        writer.write(SSE_HEAD)
        while True:
            writer.write(chunk(b"data: token\n\n"))
            await writer.drain()
            await asyncio.sleep(0.01)

    async def scenario(engine: Engine, pool: Upstreams) -> None:
        async def relay() -> None:
            answer = await pool.request(engine.address, "/p", b"{}", 5)
            try:
                while await answer.next_chunk():
                    pass
            finally:
                answer.release()

        task = asyncio.create_task(relay())
        await asyncio.sleep(0.1)
        task.cancel()  # as aiohttp cancels the handler of a client that disconnected
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(engine.hung_up.wait(), 2)
        assert pool.idle_count(engine.address) == 0

    run(endless, scenario)


def test_a_shorter_timeout_on_a_reused_connection_is_kept() -> None:
    async def stalls_the_second(writer: asyncio.StreamWriter, n: int, request: bytes) -> None:
        if n == 0:
            writer.write(plain(b"ok"))
        else:
            await asyncio.sleep(1)

    async def scenario(engine: Engine, pool: Upstreams) -> None:
        answer = await pool.request(engine.address, "/p", b"{}", 60)  # a timer 60 s away
        assert await answer.read() == b"ok"
        answer.release()
        started = asyncio.get_running_loop().time()
        with pytest.raises(ReadTimeout):
            await pool.request(engine.address, "/p", b"{}", 0.2)
        assert asyncio.get_running_loop().time() - started < 0.6
        assert engine.connections == 1

    run(stalls_the_second, scenario)


async def until(condition: Callable[[], bool], what: str) -> None:
    """Yield to the loop until ``condition`` holds (bounded, so a broken test ends)."""
    for _ in range(2000):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"never happened: {what}")


def test_an_address_that_leaves_the_rotation_keeps_no_idle_connection() -> None:
    async def scenario(engine: Engine, pool: Upstreams) -> None:
        answers = await asyncio.gather(*(pool.request(engine.address, "/p", b"{}", 5) for _ in range(3)))
        for answer in answers:
            await answer.read()
            answer.release()
        assert pool.idle_count(engine.address) == 3 and engine.open == 3
        pool.retain([engine.address, "127.0.0.1:1"])  # still in rotation: kept
        assert pool.idle_count(engine.address) == 3
        pool.retain(["127.0.0.1:1"])
        assert pool.idle_count(engine.address) == 0
        await until(lambda: engine.open == 0, "the engine sees its connections closed")

    run(answers_ok, scenario)


def test_a_request_in_flight_to_an_address_that_left_ends_whole_and_its_connection_closes() -> None:
    gate = asyncio.Event()

    async def waits_for_the_gate(writer: asyncio.StreamWriter, n: int, request: bytes) -> None:
        writer.write(SSE_HEAD + chunk(b"data: 1\n\n"))
        await writer.drain()
        await gate.wait()
        writer.write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")

    async def scenario(engine: Engine, pool: Upstreams) -> None:
        gate.clear()
        answer = await pool.request(engine.address, "/p", b"{}", 5)
        assert await answer.next_chunk() == b"data: 1\n\n"
        pool.retain([])  # drained: out of rotation while the stream runs
        gate.set()
        assert await all_chunks(answer) == [b"data: [DONE]\n\n"]
        assert answer.complete
        answer.release()
        assert pool.idle_count(engine.address) == 0
        await until(lambda: engine.open == 0, "the engine sees the connection closed")
        # back in rotation: pooled again
        pool.retain([engine.address])
        gate.set()
        again = await pool.request(engine.address, "/p", b"{}", 5)
        await all_chunks(again)
        again.release()
        assert pool.idle_count(engine.address) == 1 and engine.open == 1

    run(waits_for_the_gate, scenario)
