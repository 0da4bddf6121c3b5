"""Prefix routing over three real llama-servers (SmolLM2-135M on the CPU) behind one real
gateway: where each prompt lands is what rendezvous hashing on its key predicts, it stays
there, and when a replica leaves only the prompts it held move (each to its runner-up),
coming back when it returns.

Each prompt's first KiB differs (its own long system prompt), so each has its own key;
requests go one at a time, so no replica is ever overloaded and every route is
``affinity``. Mod-N hashing or round robin would move the survivors' prompts too.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from llmgw_cli.core.serving.affinity import rendezvous, request_key
from tests.gateway.harness import Gateway, free_port, stop
from tests.test_llama_server import ALIAS, KEY, llama_paths, start_llama_server, stop_llama_server
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

REPLICAS = 3
PROMPTS = 12


def body(i: int) -> dict[str, object]:
    """Request ``i``'s body, as sent: a system prompt of ~1.3 KiB whose first characters
    name ``i``, so its first KiB (the key) differs from every other's. Most of it is a
    rule of dashes, a few dozen tokens in all: each request costs the CPU little."""
    system = f"You are help desk {i} of {PROMPTS}.\n" + "-" * 1280 + "\nAnswer in one word."
    return {
        "model": ALIAS,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Hello?"}],
        "max_tokens": 1,
        "temperature": 0,
    }


BODIES = [body(i) for i in range(PROMPTS)]


def key(i: int) -> str:
    found = request_key(BODIES[i], None)
    assert found is not None, "a prompt past 1 KiB has a key"
    return found


@dataclass
class Fleet:
    """The llama-servers by address, the gateway in front of them and its keys."""

    binary: str
    model: str
    directory: Path
    ports: list[int]
    gw: Gateway | None = None
    key: str = ""
    admin: str = ""
    servers: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.ports]

    @property
    def gateway(self) -> Gateway:
        assert self.gw is not None
        return self.gw

    def start(self, address: str) -> None:
        port = int(address.rsplit(":", 1)[1])
        log = self.directory / f"llama-{port}.log"
        self.servers[address] = start_llama_server(self.binary, self.model, port, log)

    def kill(self, address: str) -> None:
        stop(self.servers.pop(address), signal.SIGKILL)

    def stop_all(self) -> None:
        with contextlib.ExitStack() as stack:  # every one stopped, even after one fails
            for proc in self.servers.values():
                stack.callback(stop_llama_server, proc)
            self.servers.clear()

    def health(self) -> dict[str, str]:
        """Each replica's health in the gateway's admin view."""
        got = self.gateway.admin("/admin/api/replicas", self.admin)
        got.raise_for_status()
        return {r["address"]: r["health"] for r in got.json()["replicas"] if r["model"] == ALIAS}

    def wait_health(self, want: dict[str, bool], what: str) -> None:
        """Until the admin view lists each address of ``want`` as ready or not, as it says."""
        wait_until(
            self.health,
            until=lambda h: all((h.get(a) == "ready") == ready for a, ready in want.items()),
            timeout=30,
            interval=0.1,
            what=what,
        )

    def round(self) -> list[tuple[str, str]]:
        """Each prompt sent once, in order: the (replica, route) its access log line names."""
        gw = self.gateway
        ids = []
        with httpx.Client(
            base_url=f"http://127.0.0.1:{gw.port}",
            headers={"Authorization": f"Bearer {self.key}"},
            timeout=60,
        ) as client:
            for sent in BODIES:
                reply = client.post("/v1/chat/completions", json=sent)
                assert reply.status_code == 200, reply.text
                assert reply.json()["usage"]["completion_tokens"] == 1
                ids.append(reply.headers["x-request-id"])

        def logged() -> dict[str, tuple[str, str]]:
            lines = [line for line in gw.log.read_text(errors="replace").splitlines() if line.startswith("{")]
            records = [json.loads(line) for line in lines]
            return {r["request_id"]: (r["replica"], r["route"]) for r in records if "request_id" in r}

        found = wait_until(
            logged,
            until=lambda seen: all(i in seen for i in ids),
            timeout=10,
            what="the access log lines of the round",
        )
        return [found[i] for i in ids]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    binary, model = llama_paths()
    directory = tmp_path_factory.mktemp("route-llama")
    fleet = Fleet(binary, model, directory, [free_port() for _ in range(REPLICAS)])
    models: list[dict[str, object]] = [
        {
            "name": ALIAS,
            "source": "./smollm2.gguf",
            "profile": "sim",
            "scaling": {"min": 1, "max": REPLICAS},
            "routing": {"policy": "prefix"},
        }
    ]
    try:
        for address in fleet.addresses:
            fleet.start(address)
        fleet.gw = Gateway(directory, models, {ALIAS: fleet.addresses}, engine_key=KEY)
        fleet.key = fleet.gw.cli("keys", "create", "--name", "user")
        fleet.admin = fleet.gw.cli("keys", "create", "--name", "ops", "--admin")
        fleet.gw.start()
        try:
            fleet.wait_health(dict.fromkeys(fleet.addresses, True), "all three replicas ready")
            yield fleet
        finally:
            fleet.gw.stop()
    finally:
        fleet.stop_all()


def test_each_prompt_goes_where_rendezvous_hashing_puts_it_every_time(fleet: Fleet) -> None:
    first, second = fleet.round(), fleet.round()
    predicted = [(rendezvous(key(i), fleet.addresses)[0], "affinity") for i in range(PROMPTS)]
    assert first == predicted
    assert second == predicted
    assert len({replica for replica, _ in first}) > 1, "12 keys spread over the replicas"


def test_a_replica_leaving_moves_only_its_prompts_and_they_return_with_it(fleet: Fleet) -> None:
    before = [replica for replica, _ in fleet.round()]
    assert before == [rendezvous(key(i), fleet.addresses)[0] for i in range(PROMPTS)]
    # The replica holding the most prompts leaves; the others hold some too, which stay.
    leaver = max(fleet.addresses, key=before.count)
    assert 0 < before.count(leaver) < PROMPTS
    remaining = [a for a in fleet.addresses if a != leaver]

    fleet.kill(leaver)
    fleet.wait_health({leaver: False, **dict.fromkeys(remaining, True)}, f"{leaver} no longer ready")
    during = fleet.round()
    assert {route for _, route in during} == {"affinity"}
    for i, ((now, _), was) in enumerate(zip(during, before, strict=True)):
        if was == leaver:  # to its runner-up among all three
            assert now == rendezvous(key(i), fleet.addresses)[1], f"prompt {i}"
        else:  # a survivor keeps its prompts
            assert now == was, f"prompt {i} moved from {was}, which stayed"
        assert now == rendezvous(key(i), remaining)[0]

    fleet.start(leaver)
    fleet.wait_health(dict.fromkeys(fleet.addresses, True), f"{leaver} ready again")
    assert fleet.round() == [(replica, "affinity") for replica in before]
