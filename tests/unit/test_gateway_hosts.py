"""Several gateway hosts (``gateway.hosts``): what apply puts on the nodes and on each
host, the cluster lock it takes on every host, and the routing views it reads from every
host. Pure parts directly; the remote steps with fake transports that record commands."""

from __future__ import annotations

import asyncio
import base64
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.clusterfile.spec import ClusterSpec, Node
from llmgw_cli.core.engine.engine_access import allowed_addresses, gateway_sources
from llmgw_cli.core.hosts.gateway_install import (
    CLUSTER_FILE,
    GATEWAY_ACCOUNT,
    HUB_ENV_FILE,
    GatewayChange,
    gateway_change,
    gateway_files,
    hub_env_text,
)
from llmgw_cli.core.hosts.node_access import AUTHORIZED_KEYS, HELPER, authorized_keys_text, node_files
from llmgw_cli.core.planning.drain import Routes, routes_text
from llmgw_cli.core.views.monitoring import PROMETHEUS_FILE, monitoring_files, scrape_targets
from llmgw_cli.errors import InputError, LockTimeout, NodeError
from llmgw_cli.remote.cluster_lock import lock_order, take_for_apply
from llmgw_cli.remote.connect import Connections, GatewayAccess
from llmgw_cli.remote.gateway_install import GatewayPreview, GatewayPreviews, gateway_transport, host_subject
from llmgw_cli.remote.rollout import Gateways
from llmgw_cli.remote.transport import CommandResult, Transport

CLUSTER = """\
cluster: {name: t}
nodes:
  - {name: gw2, address: 10.0.0.12, engine_address: 10.1.0.12}
  - {name: gw1, address: 10.0.0.11}
  - {name: n1, address: 10.0.0.21}
profiles:
  vllm: {engine: vllm, ports: 8100-8199}
gateway:
  hosts: [gw2, gw1, 192.0.2.7, gw.example.net]
  store: postgresql://llmgw@db.example.net:5432/llmgw
  store_password_file: /etc/llmgw/store-password
  state_dir: /var/lib/llmgw-gw
models:
  - {name: m, source: org/m, profile: vllm}
"""
KEYS = [
    "ssh-ed25519 AAAAone gw2",
    "ssh-ed25519 AAAAtwo gw1",
    "ssh-ed25519 AAAAthree x",
    "ssh-ed25519 AAAAone again",
]


def spec() -> ClusterSpec:
    return parse_cluster(CLUSTER)


def test_the_first_listed_host_is_the_host_and_all_hosts_keep_their_order() -> None:
    s = spec()
    assert s.gateway.host == "gw2"
    assert s.gateway.all_hosts == ["gw2", "gw1", "192.0.2.7", "gw.example.net"]
    assert parse_cluster(
        CLUSTER.replace("  hosts: [gw2, gw1, 192.0.2.7, gw.example.net]\n", "")
    ).gateway.all_hosts == ["localhost"]


def test_every_node_lets_every_gateway_host_in_to_the_helper_only() -> None:
    text = authorized_keys_text(KEYS)
    lines = text.splitlines()
    # one line per key (the same key twice is one line), each restricted to the helper
    assert lines == [
        f'restrict,command="{HELPER}" ssh-ed25519 AAAAone',
        f'restrict,command="{HELPER}" ssh-ed25519 AAAAtwo',
        f'restrict,command="{HELPER}" ssh-ed25519 AAAAthree',
    ]
    s = spec()
    files = {
        f.path: f
        for f in node_files(
            s, s.node("n1"), helper_source="", nodefetch_source="", probe_source="", public_keys=KEYS
        )
    }
    assert files[AUTHORIZED_KEYS].text == text
    none_yet = node_files(
        s, s.node("n1"), helper_source="", nodefetch_source="", probe_source="", public_keys=[]
    )
    assert next(f for f in none_yet if f.path == AUTHORIZED_KEYS).text == ""


def test_the_engine_firewall_lets_every_gateway_host_in() -> None:
    s = spec()
    # gw2's engine and SSH addresses, gw1's, the IP host; a DNS name is not an address
    # systemd takes (engine_clients gives it)
    assert gateway_sources(s) == ["10.1.0.12", "10.0.0.12", "10.0.0.11", "192.0.2.7"]
    model = s.models[0]
    allow = allowed_addresses(s, model, [s.node("n1")])
    assert allow == ["localhost", "10.0.0.21", "10.1.0.12", "10.0.0.12", "10.0.0.11", "192.0.2.7"]


def test_the_store_password_is_copied_as_a_secret_of_the_gateways_group() -> None:
    s = spec()
    files = gateway_files(
        s,
        cluster_text="x",
        pins_text="",
        llmgw_bin="/usr/bin/llmgw",
        known_hosts="",
        store_password="hunter2\n",
    )
    (password,) = [f for f in files if f.secret]
    assert password.path == "/etc/llmgw/store-password"
    assert (password.mode, password.group) == (0o640, GATEWAY_ACCOUNT)
    assert not any(
        f.secret
        for f in gateway_files(s, cluster_text="x", pins_text="", llmgw_bin="/usr/bin/llmgw", known_hosts="")
    )
    # what a plan line says names the file, never its content
    change = GatewayChange((password,), "handover", active=True, rebind=False)
    said = GatewayPreviews(
        (GatewayPreview("gw2", change), GatewayPreview("gw1", GatewayChange((), "none")))
    ).describe()
    assert said.splitlines() == [
        "gateway on gw2: hand over to a new gateway process, no request refused (store-password)",
        "gateway on gw1: unchanged",
    ]
    assert "hunter2" not in said and "hunter2" not in repr(GatewayPreview("gw2", change))
    # the same text, but root's alone (put there by hand): not in place for the gateway
    found = {f.path: f.state for f in files}
    assert gateway_change(files, found, active=True, listeners_changed=False).how == "none"
    found[password.path] = f"{password.digest} 600 root"
    assert gateway_change(files, found, active=True, listeners_changed=False).write == (password,)
    clash = parse_cluster(CLUSTER.replace("/etc/llmgw/store-password", CLUSTER_FILE))
    with pytest.raises(InputError, match="one of the gateway's own files"):
        gateway_files(
            clash,
            cluster_text="x",
            pins_text="",
            llmgw_bin="/usr/bin/llmgw",
            known_hosts="",
            store_password="p",
        )


# --- remote steps, with fake transports ------------------------------------------------------


@dataclass
class Spawn:
    """The lock's shell on one host: answers ``lines`` in turn, then ends."""

    lines: list[str]
    log: list[str]
    host: str

    async def readline(self) -> str:
        return self.lines.pop(0) if self.lines else ""

    async def close(self) -> None:
        self.log.append(f"release {self.host}")


@dataclass
class Fake:
    """One host: records the commands run, answers routes files and the lock."""

    node: str
    address: str
    world: World

    async def run(self, command: str, *, root: bool = False, stdin: str | None = None) -> CommandResult:
        self.world.log.append(f"{self.address}: {command.split(maxsplit=1)[0]}")
        if "base64 -w0" in command:
            views = self.world.routes.get(self.address, [])
            text = "".join(f"{r.pid} {base64.b64encode(routes_text(r).encode()).decode()}\n" for r in views)
            return CommandResult(0, text, "")
        if "kill -USR1 " in command:
            # as_folder_owner's script: the kill is the last word of its inner command
            inner = shlex.split(command)[-2]
            self.world.signalled.append(
                (self.address, sorted(int(p) for p in inner.split()[2:] if p.isdigit()))
            )
            return CommandResult(0, "", "")
        return CommandResult(0, "", "")

    async def write_file(self, path: str, content: str, *, mode: int = 0o644, root: bool = False) -> None:
        raise AssertionError("nothing is written here")

    async def spawn(self, command: str, *, root: bool = False) -> Spawn:
        assert root and "flock" in command
        self.world.log.append(f"lock {self.address}")
        answer = self.world.lock.get(self.address, ["held\n"])
        if isinstance(answer, Exception):
            raise answer
        return Spawn(list(answer), self.world.log, self.address)

    async def close(self) -> None:
        pass


@dataclass
class World:
    log: list[str] = field(default_factory=list)
    routes: dict[str, list[Routes]] = field(default_factory=dict)
    signalled: list[tuple[str, list[int]]] = field(default_factory=list)
    lock: dict[str, list[str] | Exception] = field(default_factory=dict)

    def conns(self, s: ClusterSpec) -> Connections:
        def opener(spec: ClusterSpec, node: Node, base: Path, access: GatewayAccess | None) -> Transport:
            return Fake(node.name, node.address, self)

        return Connections(s, Path("/"), opener=opener)


def test_each_gateway_host_is_reached_as_itself() -> None:
    s = spec()
    conns = World().conns(s)
    reached = [gateway_transport(conns, h) for h in s.gateway.all_hosts]
    assert [t.node for t in reached] == ["gw2", "gw1", "gateway 192.0.2.7", "gateway gw.example.net"]
    assert [t.address for t in reached if isinstance(t, Fake)] == [
        "10.0.0.12",
        "10.0.0.11",
        "192.0.2.7",
        "gw.example.net",
    ]
    assert gateway_transport(conns) is reached[0]  # no host: the first
    assert [host_subject(s, h) for h in s.gateway.all_hosts[:2]] == ["gateway gw2", "gateway gw1"]
    one = parse_cluster(CLUSTER.replace("[gw2, gw1, 192.0.2.7, gw.example.net]", "[gw1]"))
    assert host_subject(one, "gw1") == "gateway"


def test_apply_takes_every_hosts_lock_in_sorted_order_and_releases_them_all() -> None:
    s = spec()
    world = World()
    waits: list[str] = []

    async def take() -> None:
        async with world.conns(s) as conns:
            held = await take_for_apply(s, conns, wait=5, why="testing", on_wait=waits.append)
            assert held.hosts == lock_order(s.gateway.all_hosts) == sorted(s.gateway.all_hosts)
            await held.release()
            await held.release()  # once

    world.lock["10.0.0.11"] = ["busy apply by someone\n", "held\n"]
    asyncio.run(take())
    order = ["192.0.2.7", "gw.example.net", "10.0.0.11", "10.0.0.12"]  # 192.0.2.7, gw.example.net, gw1, gw2
    assert [e for e in world.log if e.startswith("lock ")] == [f"lock {a}" for a in order]
    assert [e for e in world.log if e.startswith("release ")] == [f"release {a}" for a in reversed(order)]
    assert waits == ["waiting for the cluster lock held by apply by someone (on gw1)"]


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (["timeout\n"], LockTimeout),
        (NodeError("gw1", "unreachable", "no route"), NodeError),
        (["error cannot open /var/lib/llmgw-gw/cluster.lock\n"], NodeError),
    ],
)
def test_a_lock_not_taken_on_one_host_releases_those_taken_before(
    answer: list[str] | Exception, error: type[Exception]
) -> None:
    s = spec()
    world = World()
    world.lock["10.0.0.11"] = answer  # gw1: the third in sorted order

    async def take() -> None:
        async with world.conns(s) as conns:
            await take_for_apply(s, conns, wait=5, why="testing", on_wait=print)

    with pytest.raises(error) as failed:
        asyncio.run(take())
    assert "gw1" in str(failed.value)
    taken = ["192.0.2.7", "gw.example.net"]
    assert [e for e in world.log if e.startswith("release ")][-2:] == [
        f"release {a}" for a in reversed(taken)
    ]
    assert "lock 10.0.0.12" not in world.log  # gw2 is never asked


def test_routing_views_come_from_every_host_and_each_process_is_signalled_on_its_own() -> None:
    s = spec()
    world = World()
    routed = {"m": frozenset({"10.0.0.21:8100"})}
    world.routes = {
        "10.0.0.12": [Routes(pid=11, written=0.0, ready=routed), Routes(pid=12, written=0.0, ready=routed)],
        "10.0.0.11": [Routes(pid=11, written=0.0, ready={})],  # the same pid on another host
    }
    said: list[tuple[str, str]] = []

    async def look() -> bool | None:
        async with world.conns(s) as conns:
            gateways = Gateways.of(s, conns, lambda who, what: said.append((who, what)))
            views = await gateways.views()
            assert sorted(v.pid for v in views) == [11, 11, 12]
            return await gateways.until(lambda v: v.routes("m", "10.0.0.21:8100"), timeout=0.0)

    assert asyncio.run(look()) is False  # gw1's gateway does not route it
    assert sorted(world.signalled) == [("10.0.0.11", [11]), ("10.0.0.12", [11, 12])]
    world.routes = {}
    world.signalled.clear()
    assert asyncio.run(look_none(s, world, said)) is None
    assert said[-1] == (
        "gateway",
        "no gateway's routing view on gw2, gw1, 192.0.2.7, gw.example.net; going by health checks only",
    )
    assert world.signalled == []


async def look_none(s: ClusterSpec, world: World, said: list[tuple[str, str]]) -> bool | None:
    async with world.conns(s) as conns:
        gateways = Gateways.of(s, conns, lambda who, what: said.append((who, what)))
        return await gateways.until(lambda v: True, timeout=0.0)


def test_a_plan_line_per_host() -> None:
    previews = GatewayPreviews(
        (
            GatewayPreview("gw2", None, "gw2 does not run systemd; start the gateway yourself"),
            GatewayPreview("gw1", GatewayChange((), "restart")),
        )
    )
    assert previews.changes
    assert re.findall(r"gateway on (\w+)", previews.describe()) == ["gw2", "gw1"]
    settled = previews.settled()
    assert settled.hosts[0] is previews.hosts[0] and settled.hosts[1].change == GatewayChange((), "none")
    assert not settled.changes


def test_prometheus_scrapes_every_gateway_host() -> None:
    s = parse_cluster(
        CLUSTER.replace("  state_dir: /var/lib/llmgw-gw\n", '  metrics_listen: "0.0.0.0:9100"\n')
    )
    assert scrape_targets(s) == ["10.0.0.12:9100", "10.0.0.11:9100", "192.0.2.7:9100", "gw.example.net:9100"]
    job = yaml.safe_load(monitoring_files(s, "/k")[PROMETHEUS_FILE])["scrape_configs"][0]
    assert job["static_configs"] == [{"targets": scrape_targets(s)}]


def test_the_hub_endpoint_and_token_reach_the_gateway_as_a_secret_environment_file() -> None:
    s = spec()
    text = hub_env_text(
        {"HF_ENDPOINT": "https://hub.example/mirror", "HF_TOKEN": "hf_abc123", "HOME": "/root"}
    )
    assert text == "HF_ENDPOINT=https://hub.example/mirror\nHF_TOKEN=hf_abc123\n"
    assert hub_env_text({"HOME": "/root"}) is None  # none of them: the file is left as it is
    files = gateway_files(
        s, cluster_text="x", pins_text="", llmgw_bin="/usr/bin/llmgw", known_hosts="", hub_env=text
    )
    (env,) = [f for f in files if f.path == HUB_ENV_FILE]
    assert (env.secret, env.mode, env.group) == (True, 0o640, GATEWAY_ACCOUNT)
    unit = next(f.text for f in files if f.path.endswith("/llmgw-gateway.service"))
    assert f"\nEnvironmentFile=-{HUB_ENV_FILE}\n" in unit
    # a change of it alone is a hand-over: a process reads its environment when it starts
    current = {f.path: f.state for f in files if f.path != HUB_ENV_FILE}
    assert gateway_change(files, current, active=True, listeners_changed=False).how == "handover"
    for bad in ("hf_x\nExecStartPre=/bin/sh", "a b", 'hf_"x', "$HOME", "hf\\x", "x" * 5000):
        with pytest.raises(InputError, match="HF_TOKEN"):
            hub_env_text({"HF_TOKEN": bad})
