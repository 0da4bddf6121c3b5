"""`llmgw gateway run` end to end: the official openai client through the gateway to
simulated vLLM engines on loopback (real HTTP, real processes, real signals)."""

from __future__ import annotations

import http.server
import json
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.gateway.harness import Engine, Gateway, free_port
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

MESSAGES: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "hello there"}]


def model(name: str, mode: str) -> dict[str, object]:
    scaling = {"always": {"min": 1, "max": 2}, "on-demand": {"min": 0, "max": 1}, "off": None}[mode]
    entry: dict[str, object] = {"name": name, "source": f"org/{name}", "fetch": "engine", "profile": "sim"}
    if scaling:
        entry["scaling"] = scaling
    return entry


class Setup:
    def __init__(self, gateway: Gateway, engines: dict[str, list[Engine]], keys: dict[str, str]) -> None:
        self.gw, self.engines, self.keys = gateway, engines, keys


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    directory = tmp_path_factory.mktemp("gateway")
    engines = {
        "chat": [Engine(directory, "chat"), Engine(directory, "chat")],
        "slow": [Engine(directory, "slow", tokens_per_second=20)],
        "wrongkey": [Engine(directory, "wrongkey", key="not-the-engine-key")],
    }
    models = [
        model("chat", "always"),
        model("slow", "always"),
        model("wrongkey", "always"),
        model("lazy", "on-demand"),
        model("off", "off"),
        model("starting", "always"),
    ]
    replicas = {name: [e.address for e in group] for name, group in engines.items()}
    replicas["starting"] = [f"127.0.0.1:{free_port()}"]  # nothing listens: loading
    gw = Gateway(directory, models, replicas)
    keys = {
        "admin": gw.cli("keys", "create", "--name", "ops", "--admin"),
        "all": gw.cli("keys", "create", "--name", "alice"),
        "chat-only": gw.cli("keys", "create", "--name", "bob", "--models", "chat"),
        "expired": gw.cli("keys", "create", "--name", "old", "--expires", "2020-01-01"),
        "revoked": gw.cli("keys", "create", "--name", "gone"),
    }
    gw.start()
    try:
        yield Setup(gw, engines, keys)
    finally:
        if gw.proc is not None:
            gw.stop()
        for group in engines.values():
            for e in group:
                e.stop()


def test_chat_non_streamed_and_streamed_agree(setup: Setup) -> None:
    client = setup.gw.client(setup.keys["all"])
    reply = client.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=8)
    assert reply.choices[0].message.content
    assert reply.usage is not None and reply.usage.completion_tokens == 8
    chunks = list(
        client.chat.completions.create(
            model="chat", messages=MESSAGES, max_tokens=8, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    # Not asked for: the usage chunk the gateway requested for metering is not passed on,
    # so every chunk has a choices[0] (naive clients index it).
    plain = list(client.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=8, stream=True))
    assert all(c.choices for c in plain) and all(c.usage is None for c in plain)
    assert "".join(c.choices[0].delta.content or "" for c in plain) == text


def test_stream_arrives_chunk_by_chunk(setup: Setup) -> None:
    # 20 tokens/s: a buffering proxy would deliver everything at the end.
    client = setup.gw.client(setup.keys["all"])
    started = time.monotonic()
    arrivals = [
        time.monotonic() - started
        for c in client.chat.completions.create(model="slow", messages=MESSAGES, max_tokens=10, stream=True)
        if c.choices and c.choices[0].delta.content
    ]
    assert len(arrivals) == 10
    assert arrivals[0] < 0.3 and arrivals[-1] - arrivals[0] > 0.3


def test_completions_and_embeddings(setup: Setup) -> None:
    client = setup.gw.client(setup.keys["all"])
    done = client.completions.create(model="chat", prompt="Once upon", max_tokens=4)
    assert done.choices[0].text and done.usage is not None and done.usage.completion_tokens == 4
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model="chat", prompt="Once upon", max_tokens=4, stream=True)
        if c.choices
    )
    assert streamed == done.choices[0].text
    vectors = client.embeddings.create(model="chat", input=["a", "b"])
    assert len(vectors.data) == 2 and len(vectors.data[0].embedding) > 0


def test_a_chunked_request_body_is_read_whole(setup: Setup) -> None:
    # No Content-Length: the body arrives after the head, in pieces.
    parts = [b'{"model": "chat", ', b'"messages": [{"role": "user", "content": "hi"}], ', b'"max_tokens": 3}']
    answer = httpx.post(
        f"http://127.0.0.1:{setup.gw.port}/v1/chat/completions",
        content=iter(parts),
        headers={"Authorization": f"Bearer {setup.keys['all']}", "Content-Type": "application/json"},
        timeout=10,
    )
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3


def test_models_lists_every_model_with_its_state(setup: Setup) -> None:
    listed = setup.gw.client(setup.keys["all"]).models.list()
    states = {m.id: m.model_extra["state"] for m in listed.data}  # type: ignore[index]
    assert states == {
        "chat": "ready",
        "slow": "ready",
        "wrongkey": "ready",
        "lazy": "stopped",
        "off": "off",
        "starting": "starting",
    }
    # A replica of a fixed list that does not answer yet: starting, with no start of the
    # gateway's own to say anything about (a start's progress: test_coordination.py).
    progress = {m.id: m.model_extra["progress"] for m in listed.data}  # type: ignore[index]
    assert progress == dict.fromkeys(states, "")


def test_error_cases_in_openai_format(setup: Setup) -> None:
    gw, keys = setup.gw, setup.keys
    with pytest.raises(openai.NotFoundError) as not_found:
        gw.client(keys["all"]).chat.completions.create(model="chta", messages=MESSAGES)
    assert not_found.value.code == "model_not_found"
    for bad in ("wrong", keys["expired"]):
        with pytest.raises(openai.AuthenticationError) as denied:
            gw.client(bad).chat.completions.create(model="chat", messages=MESSAGES)
        assert denied.value.code == "invalid_api_key"
    with pytest.raises(openai.PermissionDeniedError) as forbidden:
        gw.client(keys["chat-only"]).chat.completions.create(model="slow", messages=MESSAGES)
    assert forbidden.value.code == "model_not_allowed"
    with pytest.raises(openai.NotFoundError) as off:
        gw.client(keys["all"]).chat.completions.create(model="off", messages=MESSAGES)
    assert off.value.code == "model_off" and "switched off" in off.value.message
    with pytest.raises(openai.InternalServerError) as loading:
        gw.client(keys["all"]).chat.completions.create(model="starting", messages=MESSAGES)
    assert loading.value.status_code == 503 and loading.value.code == "model_loading"
    assert loading.value.response.headers["Retry-After"] == "5"
    with pytest.raises(openai.InternalServerError) as lazy:
        gw.client(keys["all"]).chat.completions.create(model="lazy", messages=MESSAGES)
    assert lazy.value.status_code == 503 and "Retry-After" in lazy.value.response.headers
    with pytest.raises(openai.InternalServerError) as upstream:
        gw.client(keys["all"]).chat.completions.create(model="wrongkey", messages=MESSAGES)
    assert upstream.value.status_code == 502 and upstream.value.code == "upstream_auth"
    url = f"http://127.0.0.1:{gw.port}/v1/chat/completions"
    auth = {"Authorization": f"Bearer {keys['all']}"}
    too_big = httpx.post(url, headers=auth, content=b'{"model":"chat","x":"' + b"x" * (5 << 20) + b'"}')
    assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "request_too_large"
    not_json = httpx.post(url, headers=auth, content=b"{nope")
    assert not_json.status_code == 400 and not_json.json()["error"]["type"] == "invalid_request_error"


def test_engines_get_the_engine_key_not_the_clients(setup: Setup) -> None:
    # The simulated engine refuses anything but the engine key (401); the client's key
    # is not it, so a 200 means the gateway replaced the header.
    direct = httpx.post(
        f"http://{setup.engines['chat'][0].address}/v1/chat/completions",
        headers={"Authorization": f"Bearer {setup.keys['all']}"},
        json={"model": "chat", "messages": MESSAGES},
    )
    assert direct.status_code == 401
    assert setup.gw.client(setup.keys["all"]).chat.completions.create(model="chat", messages=MESSAGES).choices


def test_client_disconnect_ends_the_upstream_request(setup: Setup) -> None:
    gw = setup.gw
    body = {"model": "slow", "messages": MESSAGES, "max_tokens": 100, "stream": True}  # 5 s at 20 tokens/s

    def outstanding() -> list[int]:
        replicas = gw.admin("/admin/api/replicas", setup.keys["admin"]).json()["replicas"]
        return [r["outstanding"] for r in replicas if r["model"] == "slow"]

    with (
        httpx.Client(timeout=10) as client,
        client.stream(
            "POST",
            f"http://127.0.0.1:{gw.port}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {setup.keys['all']}"},
        ) as response,
    ):
        chunks = response.iter_bytes()  # kept: a dropped iterator closes the response
        next(chunks)
        assert outstanding() == [1]
    wait_until(
        outstanding,
        until=lambda o: o == [0],
        timeout=2,
        what="the upstream stream to close after the client left",
    )
    wait_until(lambda: '"status":499' in gw.log.read_text(), timeout=2, what="the 499 in the access log")


def test_admin_and_metrics_listeners(setup: Setup) -> None:
    gw, keys = setup.gw, setup.keys
    assert gw.admin("/admin/api/usage", keys["all"]).status_code == 403
    assert gw.admin("/admin/api/usage", "nope").status_code == 401
    assert gw.admin("/admin/api/replicas", keys["admin"]).status_code == 200
    metrics = f"http://127.0.0.1:{gw.metrics_port}"
    health = httpx.get(f"{metrics}/health")
    assert health.status_code == 200 and health.content == b""
    assert (
        httpx.get(
            f"{metrics}/admin/api/usage", headers={"Authorization": f"Bearer {keys['admin']}"}
        ).status_code
        == 404
    )
    text = httpx.get(f"{metrics}/metrics").text
    assert 'llmgw_requests_total{key="alice",model="chat",status="200"}' in text
    assert re.search(r'llmgw_replica_up\{address="[^"]+",model="starting"\} 0', text)
    public_health = httpx.get(f"http://127.0.0.1:{gw.port}/health")
    assert public_health.status_code == 200 and public_health.content == b""


def test_the_gateway_runs_on_the_event_loop_of_the_tests(setup: Setup, event_loop_choice: str) -> None:
    wait_until(  # logged once every listener is up
        lambda: f"event loop: {event_loop_choice}\n" in setup.gw.log.read_text(),
        timeout=10,
        what=lambda: f"'event loop: {event_loop_choice}' in the log:\n{setup.gw.log.read_text()[-2000:]}",
    )


def test_one_log_line_per_request(setup: Setup) -> None:
    setup.gw.client(setup.keys["chat-only"]).chat.completions.create(
        model="chat", messages=MESSAGES, max_tokens=3
    )
    time.sleep(0.5)
    lines = [json.loads(line) for line in setup.gw.log.read_text().splitlines() if line.startswith("{")]
    mine = [x for x in lines if x["key"] == "bob" and x["status"] == 200]
    assert len(mine) == 1
    assert (
        mine[0]["model"] == "chat"
        and mine[0]["completion_tokens"] == 3
        and mine[0]["replica"].startswith("127.0.0.1:")
        and mine[0]["cut"] is False
    )


def test_revoked_key_is_refused_without_restart(setup: Setup) -> None:
    client = setup.gw.client(setup.keys["revoked"])
    assert client.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=1).choices
    setup.gw.cli("keys", "revoke", "gone")

    def refused() -> bool:
        try:
            client.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=1)
        except openai.AuthenticationError:
            return True
        return False

    wait_until(refused, timeout=10, interval=0.2, what="the revoked key to be refused")


# --- each of these runs its own gateway ------------------------------------------------


def test_overload_answers_429(tmp_path: Path) -> None:
    engine = Engine(tmp_path, "slow", tokens_per_second=20)
    gw = Gateway(
        tmp_path, [model("slow", "always")], {"slow": [engine.address]}, model_concurrency=1, model_queue=1
    )
    key = gw.cli("keys", "create", "--name", "k")
    gw.start()
    try:
        client = gw.client(key)
        first = client.chat.completions.create(model="slow", messages=MESSAGES, max_tokens=20, stream=True)
        next(iter(first))  # holds the only slot for about a second

        queued: list[str] = []
        waiter = threading.Thread(
            target=lambda: queued.append(
                client.chat.completions.create(model="slow", messages=MESSAGES, max_tokens=1)
                .choices[0]
                .finish_reason
                or ""
            )
        )
        waiter.start()
        time.sleep(0.3)  # the second request now waits in the queue of one
        with pytest.raises(openai.RateLimitError) as overloaded:
            client.chat.completions.create(model="slow", messages=MESSAGES, max_tokens=1)
        assert overloaded.value.code == "overloaded"
        list(first)
        waiter.join(10)
        assert queued == ["length"]  # the queued one was served once the slot freed
    finally:
        gw.stop()
        engine.stop()


class _DropsPosts(http.server.BaseHTTPRequestHandler):
    """Healthy to the health check, hangs up on every request: a broken engine."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self) -> None:
        self.close_connection = True
        self.connection.shutdown(2)

    def log_message(self, *args: object) -> None:
        pass


def test_failover_when_a_replica_dies_and_its_return(tmp_path: Path) -> None:
    engines = [Engine(tmp_path, "ha"), Engine(tmp_path, "ha")]
    gw = Gateway(tmp_path, [model("ha", "always")], {"ha": [e.address for e in engines]})
    key, admin = gw.cli("keys", "create", "--name", "k"), gw.cli("keys", "create", "--name", "a", "--admin")
    gw.start()
    try:
        client = gw.client(key)
        for _ in range(4):
            assert client.chat.completions.create(model="ha", messages=MESSAGES, max_tokens=2).choices
        engines[0].stop(signal.SIGKILL)
        for _ in range(10):  # every one succeeds: a refused connection is retried elsewhere
            assert client.chat.completions.create(model="ha", messages=MESSAGES, max_tokens=2).choices
        metrics = httpx.get(f"http://127.0.0.1:{gw.metrics_port}/metrics").text
        assert 'llmgw_upstream_retries_total{model="ha"}' in metrics

        def health() -> dict[str, str]:
            return {
                r["address"]: r["health"] for r in gw.admin("/admin/api/replicas", admin).json()["replicas"]
            }

        wait_until(
            health,
            until=lambda h: h == {engines[0].address: "failing", engines[1].address: "ready"},
            timeout=5,
            what="the killed replica to be marked failing",
        )
        engines[0] = Engine(tmp_path, "ha", port=engines[0].port)
        wait_until(
            health,
            until=lambda h: h[engines[0].address] == "ready",
            timeout=5,
            interval=0.1,
            what="the restarted replica to be ready again",
        )
    finally:
        gw.stop()
        for e in engines:
            e.stop()


def test_a_replica_that_hangs_up_gives_502(tmp_path: Path) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _DropsPosts)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    gw = Gateway(tmp_path, [model("bad", "always")], {"bad": [f"127.0.0.1:{server.server_address[1]}"]})
    key = gw.cli("keys", "create", "--name", "k")
    gw.start()
    try:
        with pytest.raises(openai.InternalServerError) as failed:
            gw.client(key).chat.completions.create(model="bad", messages=MESSAGES)
        assert failed.value.status_code == 502 and failed.value.code == "upstream_error"
    finally:
        gw.stop()
        server.shutdown()
        server.server_close()


def test_sighup_reloads_and_sigterm_drains_streams(tmp_path: Path) -> None:
    engine = Engine(tmp_path, "slow", tokens_per_second=20)
    gw = Gateway(tmp_path, [model("slow", "always")], {"slow": [engine.address]})
    key = gw.cli("keys", "create", "--name", "k")
    gw.start()
    assert gw.proc is not None
    try:
        client = gw.client(key)

        def started_stream() -> Iterator[openai.types.chat.ChatCompletionChunk]:
            """A stream of 16 tokens at 20 a second, its first chunk read."""
            stream = iter(
                client.chat.completions.create(
                    model="slow",
                    messages=MESSAGES,
                    max_tokens=16,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            next(stream)
            return stream

        stream = started_stream()
        gw.cluster.write_text(gw.cluster.read_text() + "\nbogus: 1\n")  # a broken file is refused
        gw.proc.send_signal(signal.SIGHUP)
        wait_until(
            lambda: "reload refused" in gw.log.read_text(), timeout=5, interval=0.1, what="'reload refused'"
        )
        assert client.chat.completions.create(model="slow", messages=MESSAGES, max_tokens=1).choices
        gw.write([model("slow", "always"), model("new", "off")], {"slow": [engine.address]})
        gw.proc.send_signal(signal.SIGHUP)

        def model_ids() -> set[str]:
            return {m.id for m in client.models.list().data}

        wait_until(lambda: "new" in model_ids(), timeout=5, interval=0.1, what="the reloaded model list")
        assert model_ids() == {"slow", "new"}
        rest = list(stream)  # the stream opened before the reload went on
        assert rest[-1].usage is not None and rest[-1].usage.completion_tokens == 16

        stream = started_stream()
        gw.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        with pytest.raises(openai.APIConnectionError):  # no new connections while draining
            gw.client(key).models.list()
        rest = list(stream)
        assert rest[-1].usage is not None and rest[-1].usage.completion_tokens == 16
        assert gw.proc.wait(10) == 0
    finally:
        gw.close_clients()
        if gw.proc.poll() is None:
            gw.stop()
        engine.stop()


def test_usage_is_counted_and_survives_a_restart(tmp_path: Path) -> None:
    engine = Engine(tmp_path, "chat")
    gw = Gateway(tmp_path, [model("chat", "always")], {"chat": [engine.address]})
    key, admin = gw.cli("keys", "create", "--name", "k"), gw.cli("keys", "create", "--name", "a", "--admin")
    gw.start()
    try:
        client = gw.client(key)
        for _ in range(3):
            client.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=5)
        list(client.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=7, stream=True))
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="nope", messages=MESSAGES)
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=-1)
        before = [u for u in gw.admin("/admin/api/usage", admin).json()["usage"] if u["key"] == "k"]
        assert gw.stop() == 0
        gw.start()
        after = [u for u in gw.admin("/admin/api/usage", admin).json()["usage"] if u["key"] == "k"]
        assert after == before
        (row,) = after
        assert (row["model"], row["requests"], row["completion_tokens"], row["errors"]) == (
            "chat",
            5,
            3 * 5 + 7,
            1,
        )
        assert row["prompt_tokens"] > 0 and row["mean_latency_ms"] > 0
    finally:
        gw.stop()
        engine.stop()
