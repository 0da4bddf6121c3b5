"""Which weights go where, and from whom: the pure decisions behind `llmgw fetch`.

https sources and repositories are fetched (unless a repository says ``fetch: engine``:
that repo id goes to the engine untouched), and a path is only checked. A file is downloaded from the origin once per group of nodes (a
fabric by default): the first node that needs it fetches it from the origin, the others
copy it from a peer that has it, over the nodes' own network. Nodes whose weights folder
is shared storage count once per (fabric, folder).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any
from urllib.parse import urlsplit

from llmgw_cli.core.clusterfile.spec import ClusterSpec, Model, Node, ScalingMode, SourceKind
from llmgw_cli.core.engine.engines import model_path
from llmgw_cli.core.observe.facts import NodeFacts
from llmgw_cli.core.observe.hardware import gpu_class
from llmgw_cli.core.planning.plan import Plan
from llmgw_cli.core.weights.path_sources import checks_for
from llmgw_cli.core.weights.peers import Peers

__all__ = ["Peers"]  # re-exported: where callers have always found it

HF_HOST = "huggingface.co"


def token_for(url: str, token: str | None, hf_endpoint: str | None = None) -> str | None:
    """The token is sent only to Hugging Face (or the host of ``HF_ENDPOINT``), never to
    another origin a cluster file names."""
    if not token:
        return None
    hosts = {HF_HOST}
    if hf_endpoint:
        hosts.add(urlsplit(hf_endpoint).netloc)
    return token if urlsplit(url).scheme == "https" and urlsplit(url).netloc in hosts else None


def target_path(model: Model, node: Node) -> str:
    """Where a fetched file lives on a node: what the engine is given (``model_path``)."""
    return model_path(model, node)


def held_in_facts(spec: ClusterSpec, facts: dict[str, NodeFacts]) -> set[tuple[str, str]]:
    """``(model, node)`` pairs whose fetched file the probe found complete on the node."""
    held = set()
    for model in spec.models:
        if model.source_kind is not SourceKind.url:
            continue
        for node in spec.nodes:
            f = facts.get(node.name)
            if f is None:
                continue
            path = PurePosixPath(target_path(model, node))
            for d in f.weights:
                if PurePosixPath(d.path) == path.parent and any(
                    m.name == path.name and m.complete for m in d.models
                ):
                    held.add((model.name, node.name))
    return held


@dataclass(frozen=True)
class Skip:
    model: str
    node: str
    reason: str


@dataclass(frozen=True)
class Spread:
    """One file brought onto a group of nodes with at most one origin download."""

    model: str
    url: str
    sha256: str | None
    group: str
    seeds: tuple[str, ...]  # nodes already holding the file: peers copy from them
    origin: str | None  # the node that downloads from the origin; None when a seed exists
    copies: tuple[str, ...]  # nodes that copy from a peer, in this order
    paths: dict[str, str]  # node -> file path on it (seeds included)

    @property
    def nodes(self) -> tuple[str, ...]:
        return ((self.origin,) if self.origin else ()) + self.copies


@dataclass(frozen=True)
class RepoFetch:
    """A repository's snapshot brought onto nodes (``remote/snapshot_fetch.py`` decides,
    per fabric, who downloads from the Hub and who copies from a peer)."""

    model: str
    source: str  # org/name@commit
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class FetchPlan:
    spreads: tuple[Spread, ...]
    skipped: tuple[Skip, ...]
    checks: tuple[tuple[str, str, str], ...]  # (model, node, path) of path sources to check
    repos: tuple[RepoFetch, ...] = ()


@dataclass(frozen=True)
class PlanWeights:
    """What the replicas a plan starts need on their nodes before their units start, each
    model -> its nodes: files fetched from a URL, repository snapshots, and path sources,
    which are only checked (``core/weights/path_sources.py``)."""

    files: dict[str, list[str]]
    repos: dict[str, list[str]]
    paths: dict[str, list[str]]


def plan_weights(spec: ClusterSpec, plan: Plan) -> PlanWeights:
    """The weights of every replica ``plan`` writes units for, on each of its nodes (a
    replica of several nodes: on each); a repo id the engine downloads needs none."""
    out = PlanWeights({}, {}, {})
    for action in plan.changes:
        model = next((m for m in spec.models if m.name == action.model), None)
        if not action.write or model is None:
            continue
        kind = model.source_kind
        if kind is SourceKind.url:
            into = out.files
        elif kind is SourceKind.path:
            into = out.paths
        elif model.selection is not None:
            into = out.repos
        else:
            continue
        nodes = into.setdefault(model.name, [])
        nodes += [n for n in action.nodes if n not in nodes]
    return out


def select(
    spec: ClusterSpec,
    facts: dict[str, NodeFacts],
    models: list[str] | None = None,
    nodes: list[str] | None = None,
) -> dict[str, list[str]]:
    """Model -> nodes wanted. Default models: every model not switched off. Default nodes:
    those whose GPU class suits the model (every node when it names no class or the node's
    GPUs are unknown). Raises ValueError naming an unknown model or node."""
    known_models = {m.name for m in spec.models}
    known_nodes = {n.name for n in spec.nodes}
    for name in models or []:
        if name not in known_models:
            raise ValueError(f"no model named {name!r} in the cluster file")
    for name in nodes or []:
        if name not in known_nodes:
            raise ValueError(f"no node named {name!r} in the cluster file")
    chosen = (
        [spec.model(m) for m in models] if models else [m for m in spec.models if m.mode != ScalingMode.off]
    )
    wanted: dict[str, list[str]] = {}
    for model in chosen:
        if nodes:
            wanted[model.name] = list(nodes)
            continue
        wanted[model.name] = [n.name for n in spec.nodes if _suits(model, facts.get(n.name))]
    return wanted


def _suits(model: Model, facts: NodeFacts | None) -> bool:
    if model.gpu_class is None or facts is None or not facts.gpus:
        return True
    return any(gpu_class(g.name).upper() == model.gpu_class.upper() for g in facts.gpus)


def group_key(node: Node, peers: Peers) -> str:
    if peers is Peers.off:
        return node.name
    if peers is Peers.cluster:
        return "cluster"
    return node.fabric or "(no fabric)"


def plan_fetch(
    spec: ClusterSpec,
    wanted: dict[str, list[str]],
    held: set[tuple[str, str]],
    unreachable: set[str],
    peers: Peers = Peers.fabric,
) -> FetchPlan:
    """Decide, per model and group, who downloads from the origin and who copies from
    which peers. ``held`` are the ``(model, node)`` pairs known to have the file already;
    seeds may be any reachable node of the group, not only wanted ones."""
    spreads: list[Spread] = []
    skipped: list[Skip] = []
    checks: list[tuple[str, str, str]] = []
    repos: list[RepoFetch] = []
    for name, node_names in wanted.items():
        model = spec.model(name)
        kind = model.source_kind
        if model.selection is not None:
            skipped += [Skip(name, n, "unreachable") for n in node_names if n in unreachable]
            reachable = tuple(n for n in node_names if n not in unreachable)
            if reachable:
                repos.append(RepoFetch(name, model.source, reachable))
            continue
        if kind is not SourceKind.url:
            checks += checks_for(spec, {name: node_names})
            if kind is not SourceKind.path:
                skipped += [
                    Skip(name, n, "a Hugging Face repo id: the engine downloads it") for n in node_names
                ]
            continue
        spreads_of, skips = _spreads(
            spec, model, node_names=node_names, held=held, unreachable=unreachable, peers=peers
        )
        spreads += spreads_of
        skipped += skips
    return FetchPlan(tuple(spreads), tuple(skipped), tuple(checks), tuple(repos))


def _spreads(
    spec: ClusterSpec,
    model: Model,
    *,
    node_names: list[str],
    held: set[tuple[str, str]],
    unreachable: set[str],
    peers: Peers,
) -> tuple[list[Spread], list[Skip]]:
    skipped: list[Skip] = []
    wanted = set(node_names)
    shared_owner: dict[tuple[str | None, str], str] = {}
    members: dict[str, list[Node]] = defaultdict(list)
    for node in spec.nodes:
        if node.name in unreachable:
            if node.name in wanted:
                skipped.append(Skip(model.name, node.name, "unreachable"))
            continue
        path = target_path(model, node)
        if node.weights and node.weights[0].shared:
            owner = shared_owner.setdefault((node.fabric, path), node.name)
            if owner != node.name:
                if node.name in wanted:
                    skipped.append(Skip(model.name, node.name, f"shared storage: brought by {owner}"))
                continue
        members[group_key(node, peers)].append(node)
    result = []
    for group, nodes in sorted(members.items()):
        seeds = [n.name for n in nodes if (model.name, n.name) in held]
        for n in nodes:
            if n.name in wanted and n.name in seeds:
                skipped.append(Skip(model.name, n.name, "present"))
        needing = [n.name for n in nodes if n.name in wanted and n.name not in seeds]
        if not needing:
            continue
        origin = None if seeds else needing.pop(0)
        result.append(
            Spread(
                model=model.name,
                url=model.source,
                sha256=model.sha256,
                group=group,
                seeds=tuple(seeds),
                origin=origin,
                copies=tuple(needing),
                paths={n.name: target_path(model, n) for n in nodes},
            )
        )
    return result, skipped


def plan_report(plan: FetchPlan) -> dict[str, Any]:
    """What ``llmgw fetch --dry-run --json`` prints: each (model, node) pair the plan
    brings, from the origin or from a peer of its group (one that holds the file, ``seeds``,
    or gets it first, ``origin``); the paths it only checks; the pairs it leaves out, and why."""
    fetches = [
        {
            "model": s.model,
            "node": node,
            "from": "origin" if node == s.origin else "peer",
            "url": s.url,
            "sha256": s.sha256,
            "path": s.paths[node],
            "group": s.group,
            "seeds": list(s.seeds),
            "origin": s.origin,
        }
        for s in plan.spreads
        for node in s.nodes
    ]
    return {
        "fetches": fetches,
        "repositories": [{"model": r.model, "source": r.source, "nodes": list(r.nodes)} for r in plan.repos],
        "checks": [{"model": m, "node": n, "path": p} for m, n, p in plan.checks],
        "skipped": [{"model": s.model, "node": s.node, "reason": s.reason} for s in plan.skipped],
    }
