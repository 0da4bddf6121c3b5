"""Model aliases and fallbacks end to end: the official openai client through `llmgw
gateway run` to simulated vLLM engines (which check `model`, as vLLM does) and a real
HTTP engine that answers 500, on loopback."""

from __future__ import annotations

import http.server
import json
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import yaml

from tests.gateway.harness import Engine, Gateway, free_port
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

MESSAGES: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "hello there"}]
SERVED_BY = "x-llmgw-served-by"


def model(name: str, **extra: object) -> dict[str, object]:
    """A catalog entry; ``scaling=None``: switched off (no scaling key)."""
    entry = {
        "name": name,
        "source": f"org/{name}",
        "fetch": "engine",
        "profile": "sim",
        "scaling": {"min": 1, "max": 1},
        **extra,
    }
    return {k: v for k, v in entry.items() if v is not None}


class _Fails(http.server.BaseHTTPRequestHandler):
    """Healthy to the health check, 500 to every request: an engine that is broken."""

    posts = 0

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self) -> None:
        type(self).posts += 1
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = json.dumps({"error": {"message": "CUDA error: out of memory", "type": "InternalServerError"}})
        self.send_response(500)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args: object) -> None:
        pass


class Setup:
    def __init__(self, gw: Gateway, keys: dict[str, str]) -> None:
        self.gw, self.keys = gw, keys

    def lines(self, key: str) -> list[dict[str, object]]:
        """The access-log lines of the key's requests."""
        lines = [json.loads(x) for x in self.gw.log.read_text().splitlines() if x.startswith("{")]
        return [x for x in lines if x["key"] == key]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    directory = tmp_path_factory.mktemp("aliases")
    chat, spare = Engine(directory, "chat"), Engine(directory, "spare")
    failing = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Fails)
    threading.Thread(target=failing.serve_forever, daemon=True).start()
    models = [
        model("chat", aliases=["gpt-4o-mini", "org/chat-v2"]),
        model("spare"),
        # a replica nothing listens on: loading until load_wait (1s), then 503 model_loading
        model("starting", fallbacks=["secret", "chat"]),
        model("secret"),  # the key `limited` may not use it: skipped
        model("broken", fallbacks=["spare"]),
        model("off", scaling=None, fallbacks=["chat"]),
    ]
    replicas = {
        "chat": [chat.address],
        "spare": [spare.address],
        "starting": [f"127.0.0.1:{free_port()}"],
        "secret": [f"127.0.0.1:{free_port()}"],
        "broken": [f"127.0.0.1:{failing.server_address[1]}"],
    }
    gw = Gateway(directory, models, replicas)
    keys = {
        "admin": gw.cli("keys", "create", "--name", "ops", "--admin"),
        "all": gw.cli("keys", "create", "--name", "alice"),
        "chat-only": gw.cli("keys", "create", "--name", "bob", "--models", "chat"),
        "limited": gw.cli("keys", "create", "--name", "carol", "--models", "starting,chat,broken"),
        "no-fallback": gw.cli("keys", "create", "--name", "dave", "--models", "starting,broken"),
    }
    gw.start()
    try:
        yield Setup(gw, keys)
    finally:
        gw.stop()
        chat.stop()
        spare.stop()
        failing.shutdown()
        failing.server_close()


def test_an_alias_answers_as_its_model_plain_and_streamed(setup: Setup) -> None:
    client = setup.gw.client(setup.keys["chat-only"])  # limited to `chat`: its aliases too
    raw = client.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=MESSAGES, max_tokens=4
    )
    reply = raw.parse()
    # the engine (which refuses names it does not serve) got `chat`, and says so
    assert raw.headers[SERVED_BY] == "chat" and reply.model == "chat"
    assert reply.usage is not None and reply.usage.completion_tokens == 4
    direct = client.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=4)
    assert direct.choices[0].message.content == reply.choices[0].message.content
    with client.chat.completions.with_streaming_response.create(
        model="org/chat-v2", messages=MESSAGES, max_tokens=3, stream=True
    ) as streamed:
        assert streamed.headers[SERVED_BY] == "chat"
        chunks = list(streamed.parse())
    assert chunks and {c.model for c in chunks} == {"chat"}
    # metered and logged under the model, with the name asked for beside it
    (row,) = [
        u
        for u in setup.gw.admin("/admin/api/usage", setup.keys["admin"]).json()["usage"]
        if u["key"] == "bob"
    ]
    assert (row["model"], row["requests"], row["completion_tokens"]) == ("chat", 3, 4 + 4 + 3)
    wait_until(lambda: len(setup.lines("bob")) >= 3, timeout=5, what="three access-log lines of bob")
    assert sorted((x["model"], x["asked"]) for x in setup.lines("bob")) == [
        ("chat", "chat"),
        ("chat", "gpt-4o-mini"),
        ("chat", "org/chat-v2"),
    ]


def test_an_alias_is_listed_only_to_keys_that_may_use_its_model(setup: Setup) -> None:
    everything = setup.gw.client(setup.keys["all"]).models.list().data
    ids = [m.id for m in everything]
    assert ids[:3] == ["chat", "gpt-4o-mini", "org/chat-v2"] and "spare" in ids and "off" in ids
    alias = next(m for m in everything if m.id == "gpt-4o-mini")
    assert alias.model_extra == {**(everything[0].model_extra or {}), "alias_of": "chat"}
    limited = setup.gw.client(setup.keys["chat-only"]).models.list().data
    assert [m.id for m in limited] == ["chat", "gpt-4o-mini", "org/chat-v2"]
    with pytest.raises(openai.PermissionDeniedError) as refused:
        setup.gw.client(setup.keys["no-fallback"]).chat.completions.create(
            model="gpt-4o-mini", messages=MESSAGES
        )
    assert refused.value.code == "model_not_allowed" and SERVED_BY not in refused.value.response.headers


def test_a_model_with_no_ready_replica_falls_back(setup: Setup) -> None:
    """`starting` never gets ready; `secret` (its first fallback) neither, and `limited` may
    not use it: `chat`, the next one, serves, plain and streamed."""
    client = setup.gw.client(setup.keys["limited"])
    raw = client.chat.completions.with_raw_response.create(model="starting", messages=MESSAGES, max_tokens=5)
    reply = raw.parse()
    assert raw.headers[SERVED_BY] == "chat" and reply.model == "chat"
    assert reply.usage is not None and reply.usage.completion_tokens == 5
    with client.chat.completions.with_streaming_response.create(
        model="starting", messages=MESSAGES, max_tokens=3, stream=True
    ) as streamed:
        assert streamed.headers[SERVED_BY] == "chat"
        chunks = list(streamed.parse())
    assert {c.model for c in chunks} == {"chat"}
    assert all(c.usage is None for c in chunks)  # the usage chunk the gateway asked for: not passed on
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = setup.gw.admin("/admin/api/usage", setup.keys["admin"]).json()["usage"]
    (row,) = [u for u in usage if u["key"] == "carol"]
    assert (row["model"], row["requests"], row["completion_tokens"]) == ("chat", 2, 5 + 3)


def test_a_switched_off_model_falls_back(setup: Setup) -> None:
    raw = setup.gw.client(setup.keys["all"]).chat.completions.with_raw_response.create(
        model="off", messages=MESSAGES, max_tokens=2
    )
    assert raw.headers[SERVED_BY] == "chat" and raw.parse().model == "chat"


def test_a_5xx_before_the_first_byte_falls_back(setup: Setup) -> None:
    before = _Fails.posts
    client = setup.gw.client(setup.keys["all"])
    raw = client.chat.completions.with_raw_response.create(model="broken", messages=MESSAGES, max_tokens=3)
    assert raw.headers[SERVED_BY] == "spare" and raw.parse().model == "spare"
    streamed = list(
        client.chat.completions.create(model="broken", messages=MESSAGES, max_tokens=3, stream=True)
    )
    assert {c.model for c in streamed} == {"spare"}
    assert _Fails.posts == before + 2  # the broken engine was asked first, each time


def test_the_last_model_tried_answers_whatever_it_is(setup: Setup) -> None:
    """A key that may use no fallback gets the model's own answer, as without fallbacks."""
    client = setup.gw.client(setup.keys["no-fallback"])
    with pytest.raises(openai.InternalServerError) as failed:
        client.chat.completions.create(model="broken", messages=MESSAGES, max_tokens=3)
    assert failed.value.status_code == 500 and failed.value.response.headers[SERVED_BY] == "broken"
    with pytest.raises(openai.InternalServerError) as loading:
        client.chat.completions.create(model="starting", messages=MESSAGES, max_tokens=3)
    assert loading.value.code == "model_loading" and loading.value.response.headers[SERVED_BY] == "starting"
    # `limited` may use `chat` but not `spare`, the only fallback of `broken`
    with pytest.raises(openai.InternalServerError):
        setup.gw.client(setup.keys["limited"]).chat.completions.create(model="broken", messages=MESSAGES)


def test_a_fallback_cycle_is_refused_at_load(tmp_path: Path) -> None:
    spec = {
        "cluster": {"name": "gw"},
        "gateway": {"listen": f"127.0.0.1:{free_port()}", "state_dir": str(tmp_path / "state")},
        "profiles": {"sim": {"engine": "vllm"}},
        "models": [model("a", fallbacks=["b"]), model("b", fallbacks=["c"]), model("c", fallbacks=["a"])],
    }
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(spec, sort_keys=False))
    done = subprocess.run(
        [sys.executable, "-m", "llmgw_cli", "gateway", "run", "-f", str(cluster), "--workers", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0
    assert "models[0].fallbacks[0]: fallbacks form a cycle: a -> b -> c -> a" in done.stderr, done.stderr


def test_sighup_takes_new_aliases_and_fallbacks_and_refuses_a_cycle(tmp_path: Path) -> None:
    chat = Engine(tmp_path, "chat")
    replicas = {"chat": [chat.address], "cold": [f"127.0.0.1:{free_port()}"]}
    gw = Gateway(tmp_path, [model("chat"), model("cold")], replicas)
    key = gw.cli("keys", "create", "--name", "k")
    gw.start()
    assert gw.proc is not None
    try:
        client = gw.client(key)
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="mini", messages=MESSAGES, max_tokens=1)
        gw.write([model("chat", aliases=["mini"]), model("cold", fallbacks=["chat"])], replicas)
        gw.proc.send_signal(signal.SIGHUP)
        wait_until(
            lambda: "mini" in {m.id for m in client.models.list().data}, timeout=5, what="the reloaded alias"
        )
        assert client.chat.completions.create(model="mini", messages=MESSAGES, max_tokens=1).model == "chat"
        assert client.chat.completions.create(model="cold", messages=MESSAGES, max_tokens=1).model == "chat"
        # a cycle (the only change) is refused: the running tables stay
        gw.write(
            [model("chat", aliases=["mini"], fallbacks=["cold"]), model("cold", fallbacks=["chat"])], replicas
        )
        gw.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: "reload refused" in gw.log.read_text(), timeout=5, what="'reload refused'")
        assert client.chat.completions.create(model="cold", messages=MESSAGES, max_tokens=1).model == "chat"
    finally:
        gw.stop()
        chat.stop()
