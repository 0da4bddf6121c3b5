"""ProbeSource: replicas from the nodes' units and labels, as the probe reports them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.observe.facts import NodeFacts
from llmgw_cli.errors import InputError
from llmgw_cli.gateway.control import sources
from llmgw_cli.gateway.control.sources import ProbeSource, StaticSource
from llmgw_cli.remote.connect import Connections
from llmgw_cli.remote.probe import Snapshot
from tests.unit.facts_factory import unit_state

CLUSTER = """
cluster: {name: t}
fabrics:
  ib: {kind: infiniband}
nodes:
  - {name: a, address: 10.0.0.1, fabric: ib}
  - {name: b, address: 10.0.0.2, fabric: ib}
profiles:
  p: {engine: vllm}
models:
  - {name: big, source: o/big, fetch: engine, profile: p, nodes: 2, scaling: {min: 1, max: 1}}
  - {name: small, source: o/small, fetch: engine, profile: p, scaling: {min: 1, max: 2}}
"""


def labels(model: str, replica: int, port: int, members: str) -> dict[str, str]:
    return {"Model": model, "Replica": str(replica), "Port": str(port), "Members": members}


def probed(*facts: NodeFacts) -> Snapshot:
    return Snapshot(nodes=facts, seconds=0.0)


def run(
    source: ProbeSource, spec: ClusterSpec, snapshot: Snapshot, monkeypatch: pytest.MonkeyPatch
) -> dict[str, list[str]]:
    async def fake_gather(
        _spec: ClusterSpec, _conns: Connections, _nodes: list[str] | None = None
    ) -> Snapshot:
        return snapshot

    monkeypatch.setattr(sources, "gather", fake_gather)
    return asyncio.run(source.discover(spec))


def test_probe_source_takes_rank_zero_of_active_replicas(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = parse_cluster(CLUSTER)
    a = NodeFacts(
        node="a",
        units=(
            unit_state("llmgw-big-0.service"),
            unit_state("llmgw-small-0.service"),
            unit_state("llmgw-small-1.service", "failed"),
        ),
        unit_labels={
            "llmgw-big-0.service": labels("big", 0, 8100, "a,b"),
            "llmgw-small-0.service": labels("small", 0, 8101, "a"),
            "llmgw-small-1.service": labels("small", 1, 8102, "a"),
        },
    )
    b = NodeFacts(
        node="b",
        units=(unit_state("llmgw-big-0.service"),),
        unit_labels={"llmgw-big-0.service": labels("big", 0, 8100, "a,b")},
    )
    found = run(ProbeSource(Path()), spec, probed(a, b), monkeypatch)
    assert found == {"big": ["10.0.0.1:8100"], "small": ["10.0.0.1:8101"]}


def test_an_unreachable_node_keeps_its_replicas(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = parse_cluster(CLUSTER)
    source = ProbeSource(Path())
    b_up = NodeFacts(
        node="b",
        units=(unit_state("llmgw-small-0.service"),),
        unit_labels={"llmgw-small-0.service": labels("small", 0, 8101, "b")},
    )
    assert run(source, spec, probed(NodeFacts(node="a"), b_up), monkeypatch) == {"small": ["10.0.0.2:8101"]}
    b_down = NodeFacts(node="b", error="timed out", error_kind="timeout")
    assert run(source, spec, probed(NodeFacts(node="a"), b_down), monkeypatch) == {"small": ["10.0.0.2:8101"]}
    b_stopped = NodeFacts(node="b", units=(), unit_labels={})
    assert run(source, spec, probed(NodeFacts(node="a"), b_stopped), monkeypatch) == {}


def test_a_start_does_not_wait_on_a_node_the_last_probe_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    """The controller's probes skip a node the last probe could not read (each would
    wait out its SSH timeouts); discovery's rounds ask every node again."""
    spec = parse_cluster(CLUSTER)
    source = ProbeSource(Path())
    asked: list[list[str] | None] = []
    answers = {"a": NodeFacts(node="a"), "b": NodeFacts(node="b", error="timed out", error_kind="timeout")}

    async def fake_gather(
        _spec: ClusterSpec, _conns: Connections, nodes: list[str] | None = None
    ) -> Snapshot:
        asked.append(nodes)
        return probed(*(answers[n] for n in (nodes or ["a", "b"])))

    async def no_connections(_spec: ClusterSpec) -> Connections:
        return None  # type: ignore[return-value]  # the fake gather needs none

    monkeypatch.setattr(sources, "gather", fake_gather)
    monkeypatch.setattr(source, "connections", no_connections)
    asyncio.run(source.probe(spec))
    facts = asyncio.run(source.probe(spec, skip_lost=True))
    assert asked[-1] == ["a"]
    assert list(facts) == ["a", "b"] and facts["b"].error == "timed out"  # its last answer kept
    asyncio.run(source.discover(spec))
    assert asked[-1] == ["a", "b"]


def test_a_probe_that_ends_late_does_not_overwrite_what_a_later_probe_saw(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Discovery's round waits on a lost node while a start writes its unit and probes
    again: the round's older view of the other node must not replace the newer one (the
    controller read the just-started unit as missing and stopped it)."""
    spec = parse_cluster(CLUSTER)
    source = ProbeSource(Path())
    started = NodeFacts(
        node="a",
        units=(unit_state("llmgw-small-0.service"),),
        unit_labels={"llmgw-small-0.service": labels("small", 0, 8101, "a")},
    )
    lost = NodeFacts(node="b", error="timed out", error_kind="timeout")

    async def scenario() -> dict[str, NodeFacts]:
        release = asyncio.Event()

        async def fake_gather(
            _spec: ClusterSpec, _conns: Connections, nodes: list[str] | None = None
        ) -> Snapshot:
            if nodes == ["a", "b"]:  # the slow round: it read a before the start
                await release.wait()
                return probed(NodeFacts(node="a"), lost)
            return probed(started)

        async def no_connections(_spec: ClusterSpec) -> Connections:
            return None  # type: ignore[return-value]  # the fake gather needs none

        monkeypatch.setattr(sources, "gather", fake_gather)
        monkeypatch.setattr(source, "connections", no_connections)
        source.facts = {"b": lost}  # known lost: the start's probe asks a only
        source._asked = {}
        round_ = asyncio.create_task(source.probe(spec))
        await asyncio.sleep(0)
        assert (await source.probe(spec, skip_lost=True))["a"] == started
        release.set()
        return await round_

    facts = asyncio.run(scenario())
    assert facts["a"] == started and source.facts["a"] == started
    assert facts["b"].error == "timed out"


def test_static_source_file(tmp_path: Path) -> None:
    path = tmp_path / "replicas.yaml"
    path.write_text("small: ['127.0.0.1:8000', '127.0.0.1:8001']\n")
    spec = parse_cluster(CLUSTER)
    assert asyncio.run(StaticSource.from_file(path).discover(spec)) == {
        "small": ["127.0.0.1:8000", "127.0.0.1:8001"]
    }
    path.write_text("small: 8000\n")
    with pytest.raises(InputError, match="host:port"):
        StaticSource.from_file(path)


def test_a_replica_being_drained_is_not_discovered(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = parse_cluster(CLUSTER)
    a = NodeFacts(
        node="a",
        units=(unit_state("llmgw-small-0.service"), unit_state("llmgw-small-1.service")),
        unit_labels={
            "llmgw-small-0.service": labels("small", 0, 8101, "a"),
            "llmgw-small-1.service": labels("small", 1, 8102, "a"),
        },
        draining={"llmgw-small-0.service": 1_000_030.0},  # apply retires it
        clock=1_000_000.0,
    )
    found = run(ProbeSource(Path()), spec, probed(a, NodeFacts(node="b")), monkeypatch)
    assert found == {"small": ["10.0.0.1:8102"]}
