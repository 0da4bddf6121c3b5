"""A client that goes away, at whatever point of its request, is a 499 in the access log and
in the metrics, never a traceback in the gateway's log, and the engine's connection is
closed (the engine stops generating).

The client is a raw socket, so the test decides exactly when it closes; the engine is a
raw socket too, so the test decides when each byte of the answer leaves it. Some points
can only be reached when the client's close and the engine's bytes arrive together: the
gateway then finds the client's connection closing when it writes, before aiohttp has
cancelled its handler. The test makes that happen by stopping the gateway process
(SIGSTOP) while the engine sends and the client closes, and letting it go on (SIGCONT):
the kernel then reports both at once, the engine's bytes first.

One gateway for the module (its model admits one request at a time: the tests run one
after another); each test looks at the access lines and log written since it began.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.harness import HEALTHY, Gateway, chunk, fake_engine, free_port, read_head
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

MODELS: list[dict[str, object]] = [
    {"name": "m", "source": "org/m", "fetch": "engine", "profile": "sim", "scaling": {"min": 1, "max": 1}},
    # its one replica never becomes ready: a request waits for it (load_wait)
    {
        "name": "cold",
        "source": "org/cold",
        "fetch": "engine",
        "profile": "sim",
        "scaling": {"min": 1, "max": 1},
    },
]
# An answer whose end the gateway knows: its connection is closed, not pooled, after it.
STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
    b"Connection: close\r\n\r\n"
)
EVENT = (
    b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
)
USAGE = b'data: {"id":"x","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3}}\n\n'
DONE = b"data: [DONE]\n\n"
ANSWER = json.dumps(
    {
        "id": "x",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
    }
).encode()


class ScriptedEngine:
    """Answers health checks itself; every POST's connection goes to the test, which
    writes the answer (or nothing)."""

    def __init__(self) -> None:
        self.requests: queue.Queue[socket.socket] = queue.Queue()

    def serve(self, server: socket.socket) -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        head = read_head(conn)
        if not head.startswith(b"POST"):
            with conn:
                conn.sendall(HEALTHY)
            return
        self.requests.put(conn)

    def next(self) -> socket.socket:
        return self.requests.get(timeout=10)


@dataclass
class Setup:
    gw: Gateway
    key: str
    admin: str
    engine: ScriptedEngine


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    engine = ScriptedEngine()
    directory: Path = tmp_path_factory.mktemp("disconnect")
    for port in fake_engine(engine.serve):
        replicas = {"m": [f"127.0.0.1:{port}"], "cold": [f"127.0.0.1:{free_port()}"]}
        gw = Gateway(directory, MODELS, replicas, model_concurrency=1, load_wait="60s")
        key = gw.cli("keys", "create", "--name", "user")
        admin = gw.cli("keys", "create", "--name", "ops", "--admin")
        gw.start()
        try:
            yield Setup(gw, key, admin, engine)
        finally:
            gw.stop()


def _count_499(gw: Gateway, model: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{gw.metrics_port}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "llmgw_requests_total" and s.labels == {
                "model": model,
                "status": "499",
                "key": "user",
            }:
                return s.value
    return 0.0


class Watch:
    """What the gateway wrote (access lines, its log) and counted from now on."""

    def __init__(self, setup: Setup, model: str) -> None:
        self.gw, self.model = setup.gw, model
        self.offset = self.gw.log.stat().st_size
        self.before = _count_499(self.gw, model)

    def text(self) -> str:
        with self.gw.log.open("rb") as f:
            f.seek(self.offset)
            return f.read().decode(errors="replace")

    def lines(self) -> list[dict[str, object]]:
        return [json.loads(x) for x in self.text().splitlines() if x.startswith("{")]

    def assert_499(self, model: str | None = None) -> dict[str, object]:
        """The one access line since the watch began says 499; so does the counter; the
        log has no traceback or error."""
        (line,) = wait_until(self.lines, timeout=5, what="the access line")
        assert (line["status"], line["key"], line["model"]) == (499, "user", model or self.model)
        wait_until(
            lambda: _count_499(self.gw, self.model),
            until=lambda n: n == self.before + 1,
            timeout=5,
            what="llmgw_requests_total with status 499 counted once",
        )
        time.sleep(0.3)  # whatever the gateway logs after the line: a traceback comes later
        text = self.text()
        assert "Traceback" not in text and "Error" not in text, text
        return line


def _request(gw: Gateway, key: str, body: dict[str, object], *, length: int | None = None) -> socket.socket:
    """A client that has sent ``body`` (or, with ``length``, announced that many bytes
    of it and sent a few)."""
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length or len(data)}\r\n\r\n"
    ).encode()
    client = socket.create_connection(("127.0.0.1", gw.port), timeout=10)
    client.sendall(head + (data[:10] if length else data))
    return client


def _body(model: str = "m", *, stream: bool) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream}


def _read_until(client: socket.socket, marker: bytes) -> bytes:
    got = b""
    while marker not in got:
        data = client.recv(65536)
        assert data, f"closed before {marker!r}: {got!r}"
        got += data
    return got


def _engine_closed(conn: socket.socket) -> None:
    """The gateway closed its connection to the engine."""
    conn.settimeout(5)
    with contextlib.suppress(ConnectionResetError):  # closed with a reset: closed too
        assert conn.recv(65536) == b""
    conn.close()


def _state(pid: int) -> str:
    """A process's state letter (R, S, T for stopped...)."""
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]


def _together(gw: Gateway, engine_sends: bytes, conn: socket.socket, client: socket.socket) -> None:
    """The engine's bytes and the client's close reach the gateway at once, in that order."""
    assert gw.proc is not None
    pid = gw.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        # stopped once its state says so (a signal to a process running on another core
        # takes effect a moment later)
        wait_until(lambda: _state(pid) == "T", timeout=5, interval=0.01, what="the gateway stopped")
        conn.sendall(engine_sends)
        time.sleep(0.05)
        client.close()
        time.sleep(0.05)
    finally:
        os.kill(gw.proc.pid, signal.SIGCONT)


def test_a_client_gone_while_its_body_arrives(setup: Setup) -> None:
    watch = Watch(setup, "-")
    client = _request(setup.gw, setup.key, _body(stream=False), length=1000)
    time.sleep(1)  # the gateway waits for the rest of the body (nothing outside shows it)
    client.close()
    watch.assert_499(model="-")


def test_a_client_gone_while_waiting_for_admission(setup: Setup) -> None:
    gw, engine = setup.gw, setup.engine
    first = _request(gw, setup.key, _body(stream=False))  # holds the model's one slot
    held = engine.next()
    watch = Watch(setup, "m")
    client = _request(gw, setup.key, _body(stream=False))
    wait_until(
        lambda: gw.admin("/admin/api/replicas", setup.admin).json()["queued"].get("m"),
        timeout=5,
        what="the second request in the model's queue",
    )
    client.close()
    watch.assert_499()
    # the first request still gets its answer
    held.sendall(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
        + b"Content-Length: %d\r\n\r\n" % len(ANSWER)
        + ANSWER
    )
    assert _read_until(first, b'"completion_tokens"').startswith(b"HTTP/1.1 200")
    first.close()
    held.close()
    wait_until(lambda: len(watch.lines()) == 2, timeout=5, what="the first request's access line")


def test_a_client_gone_while_its_model_starts(setup: Setup) -> None:
    watch = Watch(setup, "cold")
    client = _request(setup.gw, setup.key, _body("cold", stream=False))
    time.sleep(1)  # waiting for a ready replica (load_wait; nothing outside shows it)
    client.close()
    watch.assert_499()


def test_a_client_gone_before_the_engines_head(setup: Setup) -> None:
    watch = Watch(setup, "m")
    client = _request(setup.gw, setup.key, _body(stream=True))
    conn = setup.engine.next()
    client.close()
    watch.assert_499()
    _engine_closed(conn)


def test_a_client_gone_when_a_streams_head_goes_out(setup: Setup) -> None:
    watch = Watch(setup, "m")
    client = _request(setup.gw, setup.key, _body(stream=True))
    conn = setup.engine.next()
    _together(setup.gw, STREAM_HEAD + chunk(EVENT), conn, client)
    line = watch.assert_499()
    assert line["prompt_tokens"] and line["usage_estimated"]  # the prompt was read all the same
    _engine_closed(conn)


def test_a_client_gone_at_a_write_of_a_stream(setup: Setup) -> None:
    watch = Watch(setup, "m")
    client = _request(setup.gw, setup.key, _body(stream=True))
    conn = setup.engine.next()
    conn.sendall(STREAM_HEAD + chunk(EVENT))
    assert b'"hi"' in _read_until(client, b'"hi"')
    _together(setup.gw, chunk(EVENT), conn, client)
    line = watch.assert_499()
    assert line["completion_tokens"]  # what the engine made was metered
    _engine_closed(conn)


def test_a_client_gone_after_a_stream_was_read_from_its_socket(setup: Setup) -> None:
    """Gone between two events, with nothing of it left to write: the next write meets
    a connection aiohttp has already closed."""
    watch = Watch(setup, "m")
    client = _request(setup.gw, setup.key, _body(stream=True))
    conn = setup.engine.next()
    conn.sendall(STREAM_HEAD + chunk(EVENT))
    _read_until(client, b'"hi"')
    client.close()
    watch.assert_499()
    _engine_closed(conn)


def test_a_client_gone_at_the_end_of_a_stream(setup: Setup) -> None:
    """The last events, `[DONE]` and the end of the body come in one read: the client left
    before any of it reached it, so it did not get the whole answer."""
    watch = Watch(setup, "m")
    client = _request(setup.gw, setup.key, _body(stream=True))
    conn = setup.engine.next()
    conn.sendall(STREAM_HEAD + chunk(EVENT))
    _read_until(client, b'"hi"')
    _together(setup.gw, chunk(USAGE) + chunk(DONE) + b"0\r\n\r\n", conn, client)
    line = watch.assert_499()
    assert (line["prompt_tokens"], line["completion_tokens"]) == (5, 3)
    conn.close()


def test_a_client_gone_when_a_whole_answer_goes_out(setup: Setup) -> None:
    watch = Watch(setup, "m")
    client = _request(setup.gw, setup.key, _body(stream=False))
    conn = setup.engine.next()
    answer = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
        + b"Content-Length: %d\r\n\r\n" % len(ANSWER)
        + ANSWER
    )
    _together(setup.gw, answer, conn, client)
    line = watch.assert_499()
    assert (line["prompt_tokens"], line["completion_tokens"]) == (5, 3)  # metered all the same
    conn.close()
