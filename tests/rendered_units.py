"""Every replica unit an inventory renders to, for the tests that check all of them."""

from __future__ import annotations

from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.engine.engines import Member, ReplicaUnit, replica_unit
from llmgw_cli.core.weights.pins import pin, unpinned

MADE_UP_COMMIT = "c0ffee" * 6 + "c0ff"  # what a plan would resolve a repository's revision to


def pinned(spec: ClusterSpec) -> ClusterSpec:
    """``spec`` with each repository llmgw fetches pinned at a made-up commit, as a plan
    would pin it after asking the Hub."""
    return pin(spec, dict.fromkeys(unpinned(spec), MADE_UP_COMMIT))


def every_replica_unit(spec: ClusterSpec) -> list[ReplicaUnit]:
    """Replica i of each model i, with port 8100 + i: a multi-node model on the fabric's
    nodes (one unit per member), any other on the first node; GPU uuids made up, and each
    repository llmgw fetches pinned at a made-up commit (a plan asks the Hub for it)."""
    spec = pinned(spec)
    out = []
    fabric_nodes = [n for n in spec.nodes if n.fabric] or spec.nodes
    for i, model in enumerate(spec.models):
        nodes = fabric_nodes[: model.nodes] if model.nodes > 1 else spec.nodes[:1]
        members = tuple(
            Member(n, r, tuple(f"GPU-{n.name}-{g}" for g in range(model.tensor_parallel)), "=mlx5_0:1")
            for r, n in enumerate(nodes)
        )
        out += [
            replica_unit(
                spec, model, replica=i, member=member, port=8100 + i, members=members, dist_port=29500
            )
            for member in members
        ]
    return out
