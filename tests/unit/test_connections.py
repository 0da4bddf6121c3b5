"""The one owner of the connections to the nodes: each node is connected to once, however
many stages use it, and every connection is closed at the end."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmgw_cli.cli import apply_steps as apply_cli
from llmgw_cli.cli.main import app
from llmgw_cli.cli.session import Session
from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.clusterfile.spec import ClusterSpec, Node
from llmgw_cli.core.planning.plan import Action
from llmgw_cli.gateway.control.sources import ProbeSource
from llmgw_cli.progress import silent
from llmgw_cli.remote.connect import Connections, GatewayAccess
from llmgw_cli.remote.execute import execute
from llmgw_cli.remote.executor import one_plan
from llmgw_cli.remote.transport import CommandResult, Transport

CLUSTER = """
cluster: {name: t}
ssh: {connect_timeout: 1s}
gateway: {install: false}
nodes:
  - {name: a, address: 192.0.2.1}
  - {name: b, address: 192.0.2.2}
profiles:
  vllm: {engine: vllm, command: [/opt/vllm/bin/vllm, serve]}
models: []
"""
# What a node with no GPU and no unit answers to the probe.
PROBE_OUTPUT = "@@ host\nclock 5.0\n@@ units\n@@ end\n"


class FakeTransport:
    """Answers every command with success (the probe with a node's answer); counts the
    connections it would open (the first command opens one) and its closes."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.connects = 0
        self.closes = 0
        self.commands: list[str] = []
        self.open = False

    async def run(self, command: str, *, root: bool = False, stdin: str | None = None) -> CommandResult:
        if not self.open:
            self.open = True
            self.connects += 1
        self.commands.append(command)
        probe = command == "sh -s" or command.endswith(" probe")  # the operator's, the gateway's
        return CommandResult(0, PROBE_OUTPUT if probe else "", "")

    async def write_file(self, path: str, content: str, *, mode: int = 0o644, root: bool = False) -> None:
        await self.run(f"write {path}", root=root)

    async def close(self) -> None:
        self.closes += 1
        self.open = False


class Recorder:
    """An opener that makes fake transports and keeps every one it made."""

    def __init__(self) -> None:
        self.made: list[FakeTransport] = []
        self.access: list[GatewayAccess | None] = []

    def __call__(self, spec: ClusterSpec, node: Node, base: Path, access: GatewayAccess | None) -> Transport:
        t = FakeTransport(node.name)
        self.made.append(t)
        self.access.append(access)
        return t

    def opened(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for t in self.made:
            counts[t.node] = counts.get(t.node, 0) + t.connects
        return counts


def test_one_apply_connects_to_each_node_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Probe, node helper check and install, engine keys and the gateway's key map all
    go through the one owner `apply` makes: one connection per node, closed at the end."""
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(CLUSTER)
    recorder = Recorder()
    monkeypatch.setattr(
        apply_cli, "Session", lambda spec, base: Session(spec, base, opener=recorder), raising=True
    )
    result = CliRunner().invoke(app, ["apply", "-f", str(cluster), "--yes"])
    assert result.exit_code == 0, result.output
    assert "node helper in place" in result.output  # the stages after the probe did run
    assert recorder.opened() == {"a": 1, "b": 1}
    assert [t.node for t in recorder.made] == ["a", "b"]
    for t in recorder.made:
        # the probe, the helper check, the key reads, the helper install, the key writes
        assert t.commands[0] == "sh -s"
        assert len(t.commands) > 10, t.commands
        assert t.closes == 1 and not t.open


def spec_of(text: str = CLUSTER) -> ClusterSpec:
    return parse_cluster(text)


def test_a_node_is_opened_once_and_every_transport_closed() -> None:
    recorder = Recorder()
    access = GatewayAccess(Path("/k"))

    async def scenario() -> None:
        async with Connections(spec_of(), Path(), access, opener=recorder) as conns:
            first = conns.to("a")
            assert conns.to("a") is first
            assert conns.to(spec_of().node("a")) is first  # by name or by node, the same
            await first.run("true")
            await conns.to("b").run("true")
        assert all(t.closes == 1 for t in recorder.made)
        # used again after a close: opened anew
        await conns.to("a").run("true")
        await conns.close()

    asyncio.run(scenario())
    assert [t.node for t in recorder.made] == ["a", "b", "a"]
    assert recorder.access == [access] * 3  # the owner's access reaches every transport


def test_a_reloaded_cluster_file_replaces_only_the_nodes_it_changed() -> None:
    recorder = Recorder()
    moved = spec_of(CLUSTER.replace("192.0.2.2", "192.0.2.22").replace("- {name: a", "- {name: c"))

    async def scenario() -> Connections:
        conns = Connections(spec_of(), Path(), opener=recorder)
        a, b = conns.to("a"), conns.to("b")
        gateway_host = conns.to(Node(name="gateway", address="192.0.2.9"))
        await conns.use(spec_of())  # the same file again: nothing changes
        assert conns.to("a") is a and conns.to("b") is b
        await conns.use(moved)  # a is gone, b moved, c is new
        assert a.closes == 1 and b.closes == 1 and gateway_host.closes == 1
        assert conns.to("b") is not b
        conns.to("c")
        return conns

    conns = asyncio.run(scenario())
    assert [t.node for t in recorder.made] == ["a", "b", "gateway", "b", "c"]
    assert conns.spec is moved


def test_each_node_at_most_max_parallel_at_once_in_order() -> None:
    more = "".join(f"  - {{name: n{i}, address: 192.0.2.{10 + i}}}\n" for i in range(5))
    spec = spec_of(
        CLUSTER.replace("connect_timeout: 1s", "connect_timeout: 1s, max_parallel: 2").replace(
            "profiles:", more + "profiles:"
        )
    )
    assert len(spec.nodes) == 7
    recorder = Recorder()
    running: set[str] = set()
    most = 0

    async def work(node: Node, t: Transport) -> str:
        nonlocal most
        running.add(node.name)
        most = max(most, len(running))
        await asyncio.sleep(0)  # let the others in, if the limit allowed them
        await t.run("true")
        running.discard(node.name)
        return node.name

    async def scenario() -> list[str]:
        async with Connections(spec, Path(), opener=recorder) as conns:
            return await conns.each(list(reversed(spec.nodes)), work)

    names = asyncio.run(scenario())
    assert names == [n.name for n in reversed(spec.nodes)]
    assert most == 2
    assert recorder.opened() == {n.name: 1 for n in spec.nodes}


def test_discovery_rounds_and_the_controllers_work_share_the_gateways_connections() -> None:
    """The gateway keeps its connections between discovery rounds, lends them to the
    model controller's starts and stops, and closes them when it stops."""
    recorder = Recorder()
    access = GatewayAccess(Path("/k"))
    source = ProbeSource(Path(), access, opener=recorder)
    spec = spec_of()
    stop = one_plan(
        [
            Action(
                op="-",
                model="m",
                replica=0,
                nodes=("a",),
                reason="idle",
                remove=(("a", "llmgw-m-0.service"),),
            )
        ]
    )

    async def scenario() -> None:
        for _ in range(3):
            facts = await source.probe(spec)
            assert all(f.reachable for f in facts.values()), facts
        outcomes = await execute(spec, await source.connections(spec), stop, silent, wait=False)
        assert [o.ok for o in outcomes] == [True]
        await source.discover(spec)
        await source.close()

    asyncio.run(scenario())
    assert recorder.opened() == {"a": 1, "b": 1}
    assert recorder.access == [access, access]
    a = recorder.made[0]
    assert sum(c.endswith(" probe") for c in a.commands) == 4
    assert any("stop" in c for c in a.commands)  # the stop went through the same connection
    assert all(t.closes == 1 and not t.open for t in recorder.made)
