"""An engine that closes its connection right after the last event (without ending the
chunked body) still has the stream's usage metered: the tokens were made and delivered."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.harness import Gateway, free_port

pytestmark = pytest.mark.integration

EVENTS = [
    b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n',
    b'data: {"id":"x","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3}}\n\n',
    b"data: [DONE]\n\n",
]


def _serve(server: socket.socket) -> None:
    while True:
        try:
            conn, _ = server.accept()
        except OSError:
            return
        with conn:
            request = b""
            while b"\r\n\r\n" not in request:
                data = conn.recv(65536)
                if not data:
                    break
                request += data
            if request.startswith(b"GET"):
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                continue
            head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            body = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in EVENTS)
            conn.sendall(head + body)  # ...and close without the final 0-length chunk


@pytest.fixture
def abrupt_engine() -> Iterator[int]:
    port = free_port()
    server = socket.create_server(("127.0.0.1", port))
    thread = threading.Thread(target=_serve, args=(server,), daemon=True)
    thread.start()
    yield port
    server.close()


def test_usage_of_a_stream_cut_after_its_last_event_is_metered(abrupt_engine: int, tmp_path: Path) -> None:
    models: list[dict[str, object]] = [
        {"name": "m", "source": "org/m", "profile": "sim", "scaling": {"min": 1, "max": 1}}
    ]
    gw = Gateway(tmp_path, models, {"m": [f"127.0.0.1:{abrupt_engine}"]})
    key = gw.cli("keys", "create", "--name", "user")
    admin = gw.cli("keys", "create", "--name", "ops", "--admin")
    gw.start()
    try:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        with httpx.stream(
            "POST",
            f"http://127.0.0.1:{gw.port}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
        ) as response:
            assert response.status_code == 200
            try:
                received = b"".join(response.iter_raw())
            except httpx.RemoteProtocolError:
                received = b""  # the cut may reach the client as a broken body
        assert received == b"" or b'"completion_tokens":3' in received
    finally:
        gw.stop()
    gw.start()
    try:
        (row,) = [u for u in gw.admin("/admin/api/usage", admin).json()["usage"] if u["key"] == "user"]
        assert (row["requests"], row["prompt_tokens"], row["completion_tokens"]) == (1, 5, 3)
    finally:
        gw.stop()
