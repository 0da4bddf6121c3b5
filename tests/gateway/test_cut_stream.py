"""Streams whose end is not a clean end of body are still metered: the tokens were made
and delivered.

- An engine that closes its connection right after the last event (without ending the
  chunked body), as llama-server can. The log line says the stream was cut.
- An engine that keeps the body open a while after `data: [DONE]` while the client (the
  official openai client does this) hangs up as soon as it has read `[DONE]`: the gateway's
  handler is cancelled mid-relay, and that must count as a whole answer, not a 499.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.harness import EVENT_STREAM, HEALTHY, Gateway, chunk, fake_engine, read_head
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

EVENTS = [
    b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n',
    b'data: {"id":"x","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3}}\n\n',
    b"data: [DONE]\n\n",
]


def _serve(server: socket.socket, hold: float = 0, events: int = len(EVENTS)) -> None:
    while True:
        try:
            conn, _ = server.accept()
        except OSError:
            return
        with conn:
            if read_head(conn).startswith(b"GET"):
                conn.sendall(HEALTHY)
                continue
            conn.sendall(EVENT_STREAM + b"".join(chunk(e) for e in EVENTS[:events]))
            if hold:  # end the body properly, but only after a while
                time.sleep(hold)
                conn.sendall(b"0\r\n\r\n")
            # else: close without the final 0-length chunk


@pytest.fixture
def abrupt_engine() -> Iterator[int]:
    yield from fake_engine(lambda server: _serve(server, hold=0))


@pytest.fixture
def crashing_engine() -> Iterator[int]:
    """Dies after its first event: no usage, no `[DONE]`, no end of body."""
    yield from fake_engine(lambda server: _serve(server, events=1))


@pytest.fixture
def lingering_engine() -> Iterator[int]:
    yield from fake_engine(lambda server: _serve(server, hold=5))


MODELS: list[dict[str, object]] = [
    {"name": "m", "source": "org/m", "fetch": "engine", "profile": "sim", "scaling": {"min": 1, "max": 1}}
]


def test_usage_of_a_stream_cut_after_its_last_event_is_metered(abrupt_engine: int, tmp_path: Path) -> None:
    gw = Gateway(tmp_path, MODELS, {"m": [f"127.0.0.1:{abrupt_engine}"]})
    key = gw.cli("keys", "create", "--name", "user")
    admin = gw.cli("keys", "create", "--name", "ops", "--admin")
    gw.start()
    try:
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
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
    lines = [json.loads(x) for x in gw.log.read_text().splitlines() if x.startswith("{")]
    assert [(x["status"], x["cut"]) for x in lines if x["key"] == "user"] == [(200, True)]  # the log says so
    gw.start()
    try:
        (row,) = [u for u in gw.admin("/admin/api/usage", admin).json()["usage"] if u["key"] == "user"]
        assert (row["requests"], row["prompt_tokens"], row["completion_tokens"]) == (1, 5, 3)
    finally:
        gw.stop()


def test_a_stream_the_engine_broke_off_reaches_the_client_broken(
    crashing_engine: int, tmp_path: Path
) -> None:
    """A client must not take half an answer for a whole one: the gateway ends the
    client's body the way the engine ended its own, without the end of the chunked body."""
    gw = Gateway(tmp_path, MODELS, {"m": [f"127.0.0.1:{crashing_engine}"]})
    key = gw.cli("keys", "create", "--name", "user")
    gw.start()
    try:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        with (
            httpx.stream(
                "POST",
                f"http://127.0.0.1:{gw.port}/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {key}"},
                timeout=30,
            ) as response,
            pytest.raises(httpx.RemoteProtocolError),
        ):
            assert response.status_code == 200
            for _ in response.iter_raw():
                pass
    finally:
        gw.stop()
    lines = [json.loads(x) for x in gw.log.read_text().splitlines() if x.startswith("{")]
    assert [(x["status"], x["cut"]) for x in lines if x["key"] == "user"] == [(200, True)]


def test_client_that_hangs_up_after_done_is_metered_as_a_whole_answer(
    lingering_engine: int, tmp_path: Path
) -> None:
    gw = Gateway(tmp_path, MODELS, {"m": [f"127.0.0.1:{lingering_engine}"]})
    key = gw.cli("keys", "create", "--name", "user")
    admin = gw.cli("keys", "create", "--name", "ops", "--admin")
    gw.start()
    try:
        client = gw.client(key)
        chunks = list(
            client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "hi"}],
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
        # The engine still holds the body open (5 s): what is metered now was metered when
        # the client hung up.

        def metered() -> list[dict[str, object]]:
            return [u for u in gw.admin("/admin/api/usage", admin).json()["usage"] if u["key"] == "user"]

        rows = wait_until(metered, timeout=2, interval=0.1, what="the request in /admin/api/usage")
        assert [(r["requests"], r["prompt_tokens"], r["completion_tokens"], r["errors"]) for r in rows] == [
            (1, 5, 3, 0)
        ]

        def logged() -> list[tuple[int, int, bool]]:  # the log is written in batches (0.2 s)
            lines = [json.loads(x) for x in gw.log.read_text().splitlines() if x.startswith("{")]
            return [(x["status"], x["completion_tokens"], x["cut"]) for x in lines if x["key"] == "user"]

        logged_lines = wait_until(logged, timeout=3, interval=0.1, what="the request in the access log")
        assert logged_lines == [(200, 3, False)]  # the client hung up: not a cut
    finally:
        gw.stop()
