"""What each lab node reports now: alive, reachable, sshd, adapter ports, GPU health."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from llmgw_cli.lab import cluster
from llmgw_cli.lab.host import LabRecord, NodeRecord


@dataclass(frozen=True)
class NodeStatus:
    name: str
    ip: str
    shape: str
    alive: bool
    link: str = "?"
    ssh: bool = False
    ports: dict[str, str] = field(default_factory=dict)
    gpus_bad: list[str] = field(default_factory=list)  # e.g. "3 (reset-required)"
    gpu_count: int = 0


def node_status(node: NodeRecord) -> NodeStatus:
    root = Path(f"/proc/{node.pid1}/root")
    if not (node.pid1 and (root / "etc/lab").is_dir()):
        return NodeStatus(node.name, node.ip, node.shape, alive=False)
    try:
        link = Path(f"/sys/class/net/lgwv{node.index}/operstate").read_text().strip()
    except OSError:
        link = "missing"
    ports = {}
    for state in sorted((root / "sys/class/infiniband").glob("*/ports/*/state")):
        hca, port = state.parts[-4], state.parts[-2]
        ports[f"{hca}:{port}"] = state.read_text().strip().split(": ", 1)[-1]
    doc = json.loads((root / "etc/lab/gpus.json").read_text())
    bad = [f"{g['index']} ({g['state']})" for g in doc["gpus"] if g.get("state") != "healthy"]
    return NodeStatus(
        node.name,
        node.ip,
        node.shape,
        alive=True,
        link=link,
        ssh=cluster.banner(node.ip) if link != "down" else False,
        ports=ports,
        gpus_bad=bad,
        gpu_count=len(doc["gpus"]),
    )


def lab_status(record: LabRecord) -> list[NodeStatus]:
    return [node_status(n) for n in record.nodes]
