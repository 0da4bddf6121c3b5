"""Hostile clients of a real gateway (`llmgw gateway run` on loopback): each test is one
attack, and asserts that the gateway shed it without a 5xx, a traceback or a lost slot.

The engines are the lab's simulated vLLM (a real process) or, where the test must see the
engine's side of a connection, a raw socket server written here.
"""

from __future__ import annotations

import gzip
import json
import socket
import ssl
import threading
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw_cli.errors import BadRequest
from llmgw_cli.gateway.serving.openai_error import bad_request
from llmgw_cli.gateway.serving.request_body import MAX_DEPTH, parse_body, too_deep
from tests.gateway.harness import (
    EVENT_STREAM,
    HEALTHY,
    Engine,
    Gateway,
    chunk,
    fake_engine,
    read_head,
    self_signed_cert,
    start_gateway,
    trickle_until_closed,
)
from tests.waiting import wait_until

MESSAGES: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "hello there"}]
FAST = {"header": "2s", "body": "2s", "write": "1s"}


def _model(name: str) -> dict[str, object]:
    return {
        "name": name,
        "source": f"org/{name}",
        "fetch": "engine",
        "profile": "sim",
        "scaling": {"min": 1, "max": 1},
    }


def _no_traceback(gw: Gateway) -> None:
    text = gw.log.read_text(errors="replace")
    assert "Traceback" not in text and "Error handling request" not in text, text[-3000:]


def _raw(port: int, data: bytes, wait: float = 10) -> bytes:
    """Send ``data`` on a new connection; everything the server answers until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as sock:
        sock.sendall(data)
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
                if b"\r\n\r\n" in answer and _complete(answer):
                    break
        except TimeoutError:
            pass
    return answer


def _complete(answer: bytes) -> bool:
    head, _, body = answer.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return False


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def _error(answer: bytes) -> dict[str, object]:
    body = json.loads(answer.partition(b"\r\n\r\n")[2])
    error: dict[str, object] = body["error"]
    return error


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[Engine]:
    engine = Engine(tmp_path, "m", tokens_per_second=20)
    yield engine
    engine.stop()


def _gateway(tmp_path: Path, address: str, **settings: object) -> tuple[Gateway, str, str]:
    gw = Gateway(tmp_path, [_model("m")], {"m": [address]}, client_timeouts=FAST, **settings)
    key = gw.cli("keys", "create", "--name", "user")
    admin = gw.cli("keys", "create", "--name", "ops", "--admin")
    return gw, key, admin


@contextmanager
def _serving(tmp_path: Path, address: str, **settings: object) -> Iterator[tuple[Gateway, str, str]]:
    """A started gateway with model m on ``address``, a user key and an admin key; stopped after."""
    gw, key, admin = _gateway(tmp_path, address, **settings)
    gw.start()
    try:
        yield gw, key, admin
    finally:
        gw.stop()


# --- slow and stalled clients -------------------------------------------------------------


@pytest.mark.integration
def test_slow_header_client_is_dropped(sim: Engine, tmp_path: Path) -> None:
    with _serving(tmp_path, sim.address) as (gw, _, _):
        request = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        # one byte a second, never the end of the head
        closed = trickle_until_closed(gw.port, request, pause=1, give_up=8)
        assert closed is not None, "a client sending one byte a second was still connected after 8s"
        assert closed < 4, f"dropped after {closed:.1f}s, header timeout 2s"


@pytest.mark.integration
def test_slow_body_client_is_answered_408_and_dropped(sim: Engine, tmp_path: Path) -> None:
    with _serving(tmp_path, sim.address) as (gw, key, _):
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
        ).encode()
        with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as sock:
            sock.sendall(head + b'{"model":')  # and then nothing: the body never ends
            started = time.monotonic()
            sock.settimeout(8)
            try:
                answer = sock.recv(65536)
            except TimeoutError:
                answer = b""
            waited = time.monotonic() - started
        assert answer, "no answer 8s after the body stalled (body timeout 2s)"
        assert _status(answer) == 408 and waited < 4, (waited, answer[:200])
        _no_traceback(gw)


def _serve_forever_stream(server: socket.socket, closed: list[float]) -> None:
    """A fake engine: `GET` is healthy; a `POST` whose body says `forever` gets an endless
    stream (until the gateway closes the connection: the time is put in ``closed``), any
    other `POST` a short stream with its usage."""
    while True:
        try:
            conn, _ = server.accept()
        except OSError:
            return
        threading.Thread(target=_answer, args=(conn, closed), daemon=True).start()


def _answer(conn: socket.socket, closed: list[float]) -> None:
    with conn:
        request = read_head(conn)
        if b"\r\n\r\n" not in request:
            return
        if request.startswith(b"GET"):
            conn.sendall(HEALTHY)
            return
        head, _, body = request.partition(b"\r\n\r\n")
        length = int(
            next(x for x in head.split(b"\r\n") if x.lower().startswith(b"content-length")).split(b":")[1]
        )
        while len(body) < length:
            body += conn.recv(65536)
        conn.sendall(EVENT_STREAM)
        event = chunk(b'data: {"choices":[{"index":0,"delta":{"content":"' + b"x" * 60000 + b'"}}]}\n\n')
        if b"forever" not in body:
            usage = (
                b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":1}}\n\ndata: [DONE]\n\n'
            )
            conn.sendall(event + chunk(usage) + b"0\r\n\r\n")
            return
        try:
            while True:
                conn.sendall(event)
        except OSError:
            closed.append(time.monotonic())


@pytest.fixture
def endless_engine() -> Iterator[tuple[int, list[float]]]:
    closed: list[float] = []
    for port in fake_engine(lambda server: _serve_forever_stream(server, closed)):
        yield port, closed


@pytest.mark.integration
def test_client_that_never_reads_is_dropped_and_its_slot_freed(
    endless_engine: tuple[int, list[float]], tmp_path: Path
) -> None:
    port, closed = endless_engine
    with _serving(tmp_path, f"127.0.0.1:{port}", model_concurrency=1, model_queue=0) as (gw, key, _):
        body = json.dumps(
            {"model": "m", "messages": MESSAGES, "stream": True, "max_tokens": 9, "x": "forever"}
        )
        request = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
        ).encode()
        with socket.socket() as stalled:
            stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            stalled.connect(("127.0.0.1", gw.port))
            stalled.sendall(request)
            started = time.monotonic()
            # It never reads. While it holds the model's only slot, another request is refused.
            time.sleep(0.3)
            client = gw.client(key)
            with pytest.raises(openai.RateLimitError):
                client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1)
            # Within the write timeout (1s, looked at every 0.25s) the stalled client is
            # dropped, the engine's connection closed, and the slot is free again.
            wait_until(
                lambda: closed,
                timeout=started + 6 - time.monotonic(),
                what="the engine's connection to close after the client stopped reading",
            )
            assert closed[0] - started < 4
            answer = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1, stream=True)
            chunks = [c for c in answer if c.choices]
            assert chunks[0].choices[0].delta.content
        _no_traceback(gw)


# --- one key against the others -------------------------------------------------------------


@pytest.mark.integration
def test_one_key_flooding_a_model_cannot_starve_another_key(sim: Engine, tmp_path: Path) -> None:
    gw, flooder_key, _ = _gateway(tmp_path, sim.address, model_concurrency=1, model_queue=4)
    other_key = gw.cli("keys", "create", "--name", "other")
    gw.start()
    try:
        flooder, other = gw.client(flooder_key), gw.client(other_key)
        finished: list[str] = []

        def ask(client: openai.OpenAI, name: str, tokens: int = 4) -> None:
            client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=tokens)
            finished.append(name)

        holding = threading.Thread(target=ask, args=(flooder, "flood-0", 60))
        holding.start()
        time.sleep(0.3)  # holds the only slot for ~3s (60 tokens at 20/s)
        queued = [threading.Thread(target=ask, args=(flooder, f"flood-{i}")) for i in (1, 2)]
        for thread in queued:
            thread.start()
            time.sleep(0.1)
        # The flooder's share of a queue of 4 is 2: its next request is refused at once ...
        with pytest.raises(openai.RateLimitError) as refused:
            flooder.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1)
        assert refused.value.code == "key_overloaded"
        assert refused.value.response.headers["Retry-After"].isdigit()
        # ... while the other key still queues, and is served before the flooder's backlog.
        ask(other, "other")
        for thread in [holding, *queued]:
            thread.join(30)
        assert finished.index("other") < finished.index("flood-2"), finished
        _no_traceback(gw)
    finally:
        gw.stop()


# --- fields the gateway acts on, and metering -----------------------------------------------


@pytest.mark.integration
def test_stream_that_is_not_a_boolean_is_refused(sim: Engine, tmp_path: Path) -> None:
    with _serving(tmp_path, sim.address) as (gw, key, admin):
        for field, value in [("stream", 1), ("stream", "true"), ("stream_options", [1]), ("model", 7)]:
            body = {"model": "m", "messages": MESSAGES, "max_tokens": 3, field: value}
            answer = httpx.post(
                f"http://127.0.0.1:{gw.port}/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {key}"},
                timeout=10,
            )
            assert answer.status_code == 400, (field, value, answer.text)
            assert answer.json()["error"]["param"] == field
        time.sleep(1)  # a flush (0.5s)
        assert [u for u in gw.admin("/admin/api/usage", admin).json()["usage"] if u["key"] == "user"] == []


@pytest.mark.integration
def test_client_that_hangs_up_early_is_metered(sim: Engine, tmp_path: Path) -> None:
    with _serving(tmp_path, sim.address) as (gw, key, admin):
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "x" * 400}],
            "max_tokens": 200,
            "stream": True,
        }
        with httpx.stream(
            "POST",
            f"http://127.0.0.1:{gw.port}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
            timeout=10,
        ) as response:
            events = 0
            for line in response.iter_lines():
                events += line.startswith("data:")
                if events == 4:
                    break  # and hang up, long before the usage chunk (200 tokens at 20/s)
        rows: list[dict[str, int]] = wait_until(
            lambda: [u for u in gw.admin("/admin/api/usage", admin).json()["usage"] if u["key"] == "user"],
            timeout=5,
            interval=0.1,
            what="the request in /admin/api/usage",
        )
        assert len(rows) == 1
        assert rows[0]["completion_tokens"] >= 3, rows  # what the engine had sent
        assert rows[0]["prompt_tokens"] >= 100, rows  # estimated from a 400-character prompt
        _no_traceback(gw)


# --- undecodable credentials, hostile bodies ---------------------------------------------------


@pytest.mark.integration
def test_undecodable_credentials_are_401_on_every_listener(sim: Engine, tmp_path: Path) -> None:
    with _serving(tmp_path, sim.address) as (gw, _, _):
        body = b'{"model":"m","messages":[]}'
        for authorization in [
            b"Bearer \xff",
            b"Bearer \xc3\x28x",
            b"Bearer ",
            b"Basic \xff\xfe",
            b"Token abc",
        ]:
            head = b"Host: x\r\nAuthorization: %b\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % (
                authorization,
                len(body),
            )
            public = _raw(gw.port, b"POST /v1/chat/completions HTTP/1.1\r\n" + head + body)
            assert _status(public) == 401, (authorization, public[:300])
            models = _raw(gw.port, b"GET /v1/models HTTP/1.1\r\n" + head)
            assert _status(models) == 401, (authorization, models[:300])
            admin = _raw(gw.admin_port, b"GET /admin/api/usage HTTP/1.1\r\n" + head)
            assert _status(admin) == 401, (authorization, admin[:300])
        # Control characters (DEL too) stop at aiohttp's HTTP parser: a 400.
        control = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer a\x01b\r\n\r\n"
        assert _status(_raw(gw.port, control)) == 400
        _no_traceback(gw)


@pytest.mark.integration
def test_deeply_nested_json_is_400(sim: Engine, tmp_path: Path) -> None:
    with _serving(tmp_path, sim.address) as (gw, key, _):
        bodies = [
            b"[" * 100_000 + b"]" * 100_000,
            b'{"model":"m","messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            b'{"model":"m","x":' + b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1) + b"}",
            b'"just a string"',
            b"[]",
        ]
        for body in bodies:
            head = (
                b"Host: x\r\nAuthorization: Bearer %b\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                % (
                    key.encode(),
                    len(body),
                )
            )
            answer = _raw(gw.port, b"POST /v1/chat/completions HTTP/1.1\r\n" + head + body)
            assert _status(answer) == 400, (body[:40], answer[:300])
            assert _error(answer)["type"] == "invalid_request_error"
        _no_traceback(gw)


@pytest.mark.integration
@pytest.mark.parametrize("server", ["httptools", "aiohttp"])
def test_compressed_bodies_are_read_a_bomb_is_413_and_a_broken_one_400(
    sim: Engine, tmp_path: Path, server: str
) -> None:
    with _serving(tmp_path, sim.address, max_request_size="64KiB", http_server=server) as (gw, key, _):
        body = json.dumps({"model": "m", "messages": MESSAGES, "max_tokens": 2}).encode()
        bomb = b'{"model":"m","x":"' + b"a" * 50_000_000 + b'"}'  # 50 MB, about 50 KB gzipped
        for coding, data, status, code in [
            ("gzip", gzip.compress(body), 200, None),
            ("deflate", zlib.compress(body), 200, None),
            ("gzip", gzip.compress(bomb), 413, "request_too_large"),
            ("gzip", b"not gzip at all", 400, "invalid_body"),
            # cut short: aiohttp's server passes on what did decompress, which is not JSON
            (
                "gzip",
                gzip.compress(body)[:-12],
                400,
                "invalid_body" if server == "httptools" else "invalid_json",
            ),
        ]:
            head = (
                b"Host: x\r\nAuthorization: Bearer %b\r\nContent-Encoding: %b\r\nContent-Length: %d\r\n"
                b"Connection: close\r\n\r\n" % (key.encode(), coding.encode(), len(data))
            )
            answer = _raw(gw.port, b"POST /v1/chat/completions HTTP/1.1\r\n" + head + data)
            assert _status(answer) == status, (coding, answer[:300])
            if code:
                assert _error(answer)["code"] == code, answer[:300]
        logged = wait_until(
            lambda: [x["status"] for x in gw.access_lines() if x["path"] == "/v1/chat/completions"],
            until=lambda found: len(found) == 5,
            timeout=10,
            what="five access log lines",
        )
        assert logged == [200, 200, 413, 400, 400]
        _no_traceback(gw)


def test_depth_check_counts_brackets_outside_strings_only() -> None:
    deep = b'{"model":"m","x":' + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"}"  # MAX_DEPTH + 1 levels
    assert too_deep(deep)
    assert not too_deep(b'{"model":"m","x":' + b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1) + b"}")
    assert not too_deep(b'{"model":"m","x":"' + b"[" * 500 + b'\\"[{"}')  # brackets in a string
    tricky = {"model": "m", "a": '\\"' + "[" * 500, "b": "\\", "c": '"\\\\"{{{'}  # escapes before quotes
    assert not too_deep(json.dumps(tricky).encode())
    assert too_deep(json.dumps({**tricky, "d": json.loads("[" * 70 + "]" * 70)}).encode())
    wide = json.dumps({"model": "m", "messages": [{"role": "user", "content": str(i)} for i in range(500)]})
    assert not too_deep(wide.encode())


def test_a_key_given_twice_reaches_the_engine_as_the_gateway_read_it() -> None:
    payload, body = parse_body(b'{"model":"m","stream":false,"stream":true}')
    assert payload["stream"] is True and json.loads(body) == payload and body.count(b'"stream"') == 1
    payload, body = parse_body(b'{"model":"m","str\\u0065am":true}')
    assert b"\\u" not in body and payload["stream"] is True


# --- fuzzing the request path ---------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["m", "nope", ""]) | JSON,
        "stream": JSON,
        "stream_options": JSON,
        "messages": JSON,
        "max_tokens": JSON,
    },
)
BODIES = (
    FIELDS.map(lambda d: json.dumps(d).encode())
    | JSON.map(lambda d: json.dumps(d).encode())
    | st.binary(max_size=200)
    | st.integers(1, 3000).map(lambda n: b'{"model":"m","x":' + b"[" * n + b"]" * n + b"}")
)


@settings(max_examples=300, deadline=None)
@given(body=BODIES)
def test_parse_body_answers_every_body_with_a_payload_or_a_400(body: bytes) -> None:
    try:
        payload, sent = parse_body(body)
    except BadRequest as exc:
        assert bad_request(exc).status == 400
        return
    assert isinstance(payload, dict) and isinstance(payload["model"], str)
    assert payload.get("stream") in (None, True, False)
    assert json.loads(sent) == payload or sent == body


HEADER_BYTES = st.binary(min_size=0, max_size=40).filter(lambda b: not (set(b) & {0, 10, 13}))


@pytest.fixture(scope="module")
def fuzz_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, str]]:
    directory = tmp_path_factory.mktemp("fuzz")
    engine = Engine(directory, "m")
    gw = Gateway(directory, [_model("m")], {"m": [engine.address]}, client_timeouts=FAST)
    key = gw.cli("keys", "create", "--name", "user")
    gw.start()
    yield gw, key
    gw.stop()
    engine.stop()


@pytest.mark.integration
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    body=BODIES,
    authorization=st.none() | HEADER_BYTES.map(lambda b: b"Bearer " + b) | HEADER_BYTES,
    path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models"])
    | st.from_regex(r"/[!-~]{0,40}", fullmatch=True),
    use_key=st.booleans(),
)
def test_fuzzed_requests_never_get_a_5xx(
    fuzz_gateway: tuple[Gateway, str], body: bytes, authorization: bytes | None, path: str, use_key: bool
) -> None:
    gw, key = fuzz_gateway
    head = b"Host: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
    if use_key:
        head += b"Authorization: Bearer " + key.encode() + b"\r\n"
    elif authorization is not None:
        head += b"Authorization: " + authorization + b"\r\n"
    method = b"GET" if path == "/v1/models" or not path.startswith("/v1/") else b"POST"
    request = b"%b %b HTTP/1.1\r\n%bContent-Length: %d\r\n\r\n%b" % (
        method,
        path.encode(),
        head,
        len(body),
        body,
    )
    answer = _raw(gw.port, request, wait=30)
    assert _status(answer) < 500, (body[:200], authorization, answer[:400])
    _no_traceback(gw)


# --- TLS on the public listener ----------------------------------------------------------------


@pytest.mark.integration
def test_tls_listener_serves_the_openai_client_that_trusts_its_certificate(
    sim: Engine, tmp_path: Path
) -> None:
    cert, private = self_signed_cert(tmp_path)
    gw, key, _ = _gateway(tmp_path, sim.address, tls={"cert": str(cert), "key": str(private)})
    trusted = ssl.create_default_context(cafile=str(cert))
    # Started here, not with the harness's start: its readiness check speaks plain HTTP.
    options = ("--replicas", str(gw.replicas), "--engine-key-file", str(gw.dir / "engine.env"))
    gw.proc = start_gateway(gw.cluster, gw.log, *options, port=gw.port, tls=trusted)
    try:
        with httpx.Client(verify=trusted) as http:
            client = openai.OpenAI(
                base_url=f"https://127.0.0.1:{gw.port}/v1", api_key=key, max_retries=0, http_client=http
            )
            answer = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
            assert answer.choices[0].message.content
            client.close()
        with httpx.Client() as untrusting, pytest.raises(httpx.ConnectError):
            untrusting.get(f"https://127.0.0.1:{gw.port}/health")  # the system CAs do not know it
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{gw.port}/health", timeout=3)  # no plain HTTP
    finally:
        gw.stop()
