"""A path source is checked on each node of a replica before its units start, whoever
starts it: the gateway asks the installed node helper (its code, run here on a folder of
this machine) with its own key; apply, as root, pipes that code itself. A node where the
path is not there fails with the path and the node named; the others go on."""

from __future__ import annotations

import asyncio
import io
import json
import shlex
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.hosts import node_access
from llmgw_cli.core.planning.plan import Action, Plan, UnitFile
from llmgw_cli.errors import NodeError
from llmgw_cli.node import helper as node_helper
from llmgw_cli.remote.connect import Connections
from llmgw_cli.remote.transport import CommandResult
from llmgw_cli.remote.weights import ensure_for_plan


def cluster(tmp_path: Path) -> ClusterSpec:
    return parse_cluster(
        "cluster: {name: t}\nnodes:\n"
        + "".join(f"  - {{name: n{i}, address: 10.0.0.{i}, weights: [{tmp_path}/n{i}]}}\n" for i in (1, 2, 3))
        + "profiles: {p: {engine: llama-server}, v: {engine: vllm}}\nmodels:\n"
        f"  - {{name: qwen, source: {tmp_path}/shared/Qwen2.5-7B-Instruct, profile: v}}\n"
        "  - {name: smol, source: ./smol.gguf, profile: p}\n"
        "  - {name: hub, source: org/engine-downloads, profile: v, fetch: engine}\n"
    )


@dataclass
class HelperNode:
    """A node reached with the gateway's key: every command is the helper's, run here with
    the configuration apply wrote for this node."""

    node: str
    config: dict[str, list[str]]
    verbs: list[str] = field(default_factory=list)
    old_helper: bool = False  # one installed before `exists` existed
    down: bool = False

    async def run(self, command: str, *, root: bool = False, stdin: str | None = None) -> CommandResult:
        assert not root, "the gateway's key is never root"
        if self.down:
            raise NodeError(self.node, "unreachable", "connection refused")
        words = shlex.split(command)
        assert words[0] == node_access.HELPER, command
        self.verbs.append(words[1])
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            try:
                if self.old_helper and words[1] == "exists":
                    raise node_helper.Refused("'exists' is not a node-helper verb")
                node_helper.check_words(words[1:])
                status = node_helper.run_verb(words[1:], self.config)
            except node_helper.Refused as exc:
                print(f"node-helper: refused: {exc}", file=err)
                status = 2
        return CommandResult(status, out.getvalue(), err.getvalue())

    async def close(self) -> None:
        pass


@dataclass
class GatewayConnections:
    spec: ClusterSpec
    base: Path
    nodes: dict[str, HelperNode]
    access: Any = "gateway"  # not None: the gateway's access, helper verbs only

    def to(self, node: Any) -> HelperNode:
        return self.nodes[node if isinstance(node, str) else node.name]

    async def close(self) -> None:
        pass


def gateway(spec: ClusterSpec, tmp_path: Path) -> GatewayConnections:
    nodes = {}
    for n in spec.nodes:
        config = node_helper.config_from(json.loads(node_access.helper_config(spec, n)), "node-helper.json")
        nodes[n.name] = HelperNode(n.name, config)
    return GatewayConnections(spec, tmp_path, nodes)


def starts(*replicas: tuple[str, tuple[str, ...]]) -> Plan:
    unit = UnitFile(node="n1", name="llmgw-x-0.service", text="")
    return Plan(
        actions=tuple(
            Action(op="+", model=m, replica=i, nodes=nodes, reason="on demand", write=(unit,))
            for i, (m, nodes) in enumerate(replicas)
        ),
        unplaced=(),
        warnings=(),
        facts_digest="",
    )


def ensure(spec: ClusterSpec, plan: Plan, conns: Any) -> tuple[dict[str, str], list[tuple[str, str]]]:
    lines: list[tuple[str, str]] = []
    failed = asyncio.run(ensure_for_plan(spec, plan, conns, lambda s, m, _p=None: lines.append((s, m))))
    return failed, lines


def test_the_gateway_checks_each_node_of_a_replica_through_the_helper(tmp_path: Path) -> None:
    spec = cluster(tmp_path)
    (tmp_path / "shared" / "Qwen2.5-7B-Instruct").mkdir(parents=True)
    (tmp_path / "shared" / "Qwen2.5-7B-Instruct" / "config.json").write_text("{}")
    for i in (1, 2, 3):
        (tmp_path / f"n{i}").mkdir()
    (tmp_path / "n1" / "smol.gguf").write_bytes(b"GGUF")
    (tmp_path / "n2" / "smol.gguf").write_bytes(b"")  # a copy cut short
    conns = gateway(spec, tmp_path)
    failed, lines = ensure(
        spec, starts(("qwen", ("n1", "n2")), ("smol", ("n1",)), ("smol", ("n2", "n3"))), conns
    )
    assert failed == {
        "n2": f"weights of smol: {tmp_path}/n2/smol.gguf is not on n2 (an empty file)",
        "n3": f"weights of smol: {tmp_path}/n3/smol.gguf is not on n3 (missing)",
    }
    assert ("smol@n3", f"weights failed: {tmp_path}/n3/smol.gguf is not on n3 (missing)") in lines
    assert all(conns.nodes[n].verbs == ["exists"] for n in ("n1", "n2", "n3"))  # one question each


def test_a_missing_folder_fails_every_node_of_the_replica(tmp_path: Path) -> None:
    spec = cluster(tmp_path)
    failed, _ = ensure(spec, starts(("qwen", ("n1", "n3"))), gateway(spec, tmp_path))
    assert failed == {
        n: f"weights of qwen: {tmp_path}/shared/Qwen2.5-7B-Instruct is not on {n} (missing)"
        for n in ("n1", "n3")
    }


def test_an_empty_folder_is_not_a_model(tmp_path: Path) -> None:
    spec = cluster(tmp_path)
    (tmp_path / "shared" / "Qwen2.5-7B-Instruct").mkdir(parents=True)
    failed, _ = ensure(spec, starts(("qwen", ("n1",))), gateway(spec, tmp_path))
    assert failed == {
        "n1": f"weights of qwen: {tmp_path}/shared/Qwen2.5-7B-Instruct is not on n1 (an empty folder)"
    }


def test_a_node_that_cannot_answer_fails_its_start_with_the_reason(tmp_path: Path) -> None:
    spec = cluster(tmp_path)
    (tmp_path / "n1").mkdir()
    (tmp_path / "n1" / "smol.gguf").write_bytes(b"GGUF")
    conns = gateway(spec, tmp_path)
    conns.nodes["n2"].old_helper = True
    conns.nodes["n3"].down = True
    failed, _ = ensure(spec, starts(("smol", ("n1", "n2", "n3"))), conns)
    assert set(failed) == {"n2", "n3"}
    assert failed["n2"] == (
        f"weights of smol: cannot check {tmp_path}/n2/smol.gguf: node-helper: refused: 'exists' is not a node-helper verb"
    )
    assert failed["n3"] == f"weights of smol: cannot check {tmp_path}/n3/smol.gguf: connection refused"


def test_a_repo_id_the_engine_downloads_asks_the_nodes_nothing(tmp_path: Path) -> None:
    spec = cluster(tmp_path)
    conns = gateway(spec, tmp_path)
    assert ensure(spec, starts(("hub", ("n1",))), conns) == ({}, [])
    assert conns.nodes["n1"].verbs == []


def test_apply_as_root_pipes_the_helper_and_gets_the_same_answers(tmp_path: Path) -> None:
    """The operator's transport on a ``connection: local`` node: no helper installed, no
    config file; the answer comes from the piped helper code, bounded by apply's config."""
    text = (
        "cluster: {name: t}\nnodes:\n"
        f"  - {{name: n1, address: 127.0.0.1, connection: local, weights: [{tmp_path}/n1]}}\n"
        "profiles: {p: {engine: llama-server}}\nmodels:\n"
        f"  - {{name: there, source: {tmp_path}/there.gguf, profile: p}}\n"
        f"  - {{name: gone, source: {tmp_path}/gone.gguf, profile: p}}\n"
    )
    spec = parse_cluster(text)
    (tmp_path / "there.gguf").write_bytes(b"GGUF")

    async def go(model: str) -> dict[str, str]:
        async with Connections(spec, tmp_path) as conns:
            assert conns.access is None
            return await ensure_for_plan(spec, starts((model, ("n1",))), conns, lambda *_a: None)

    assert asyncio.run(go("there")) == {}
    assert asyncio.run(go("gone")) == {"n1": f"weights of gone: {tmp_path}/gone.gguf is not on n1 (missing)"}
