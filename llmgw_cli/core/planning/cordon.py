"""Nodes out for maintenance (pure): cordons and what draining a node moves.

A cordoned node takes no new replica, whoever places it: ``apply``'s placement, the
gateway controller's on-demand starts and its restores of a model's minimum. The
replicas already there keep serving until ``llmgw drain`` moves them. A cordon comes from
one of two places, and the node is cordoned when either says so:

- the gateway's store (``llmgw cordon``, ``llmgw drain``; ``gateway/store``), seen by
  every gateway and every ``apply`` that reads the store: who set it (user@host), when,
  why, and whether a drain is under way;
- the cluster file (``cordoned: true`` on the node, with ``cordon_reason``), for a long
  stay that belongs with the rest of the cluster's description.

Placement never reads a store: the shell reads the cordons and passes the node names in
(``cordoned_nodes``), as it passes the facts.

Draining a node (``drain_plan``): every replica with a member on it gets a successor on
other nodes, started first, routed by every gateway, then the old one is drained and
stopped: the rolling path of ``apply`` (``plan.move_plan``). A replica that fits nowhere
else is stopped, which is refused (its ``downtime``: ``llmgw drain`` stops before
changing anything) when no other replica of its model would serve meanwhile, unless
``--allow-downtime``. A replica already being retired, of a model removed from the cluster
file or switched off, is simply stopped.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from llmgw_cli.core.clusterfile.spec import ClusterSpec, ScalingMode
from llmgw_cli.core.observe.facts import NodeFacts
from llmgw_cli.core.planning.plan import (
    Action,
    Plan,
    Running,
    facts_digest,
    move_plan,
    running_replicas,
    stop_action,
)

REASON_MOST = 200  # characters of a cordon's reason


@dataclass(frozen=True)
class Cordon:
    """One cordoned node. ``by`` is ``user@host`` of who cordoned it, ``since`` Unix time
    (both empty/0 for a cordon of the cluster file), ``draining`` whether a drain is under
    way (or was interrupted), ``source`` ``store`` or ``file``."""

    node: str
    reason: str = ""
    by: str = ""
    since: float = 0.0
    draining: bool = False
    source: str = "store"

    def as_dict(self) -> dict[str, object]:
        return {
            "node": self.node,
            "reason": self.reason,
            "by": self.by or None,
            "since": self.since or None,
            "draining": self.draining,
            "source": self.source,
        }


def clean_reason(text: str) -> str:
    """A reason as it may be stored: one line of printable characters, at most
    ``REASON_MOST``; ValueError otherwise."""
    if len(text) > REASON_MOST:
        raise ValueError(f"the reason is {len(text)} characters long; at most {REASON_MOST}")
    if any(not c.isprintable() for c in text):
        raise ValueError("the reason must be one line of printable characters")
    return text.strip()


def file_cordons(spec: ClusterSpec) -> list[Cordon]:
    """The cordons the cluster file declares (``cordoned: true`` on a node)."""
    return [
        Cordon(node=n.name, reason=n.cordon_reason or "", source="file") for n in spec.nodes if n.cordoned
    ]


def all_cordons(spec: ClusterSpec, stored: Iterable[Cordon]) -> list[Cordon]:
    """The file's cordons and the store's, by node name (a node in both shows twice: the
    store's cordon is lifted by ``llmgw uncordon``, the file's by editing the file)."""
    return sorted([*file_cordons(spec), *stored], key=lambda c: (c.node, c.source != "file"))


def cordoned_nodes(spec: ClusterSpec, stored: Iterable[Cordon]) -> frozenset[str]:
    """The names of the nodes that take no new replica: the file's cordons and the store's."""
    return frozenset(c.node for c in all_cordons(spec, stored))


def unknown_node(spec: ClusterSpec, name: str) -> str | None:
    """Why ``name`` names no node of the cluster file (listing them), or None."""
    names = [n.name for n in spec.nodes]
    if name in names:
        return None
    return f"no node named {name!r} in the cluster file; its nodes: {', '.join(names) or 'none'}"


@dataclass(frozen=True)
class Move:
    """One replica a drain moves (``to`` empty: stopped, nowhere to go)."""

    model: str
    replica: int
    nodes: tuple[str, ...]
    to: tuple[str, ...]
    successor: int | None
    reason: str

    def as_dict(self) -> dict[str, object]:
        return {
            "model": self.model,
            "replica": self.replica,
            "from": list(self.nodes),
            "to": list(self.to),
            "successor": self.successor,
            "reason": self.reason,
        }


@dataclass(frozen=True)
class DrainPlan:
    """What draining ``node`` does: ``plan`` (``~`` successor-first moves, ``-`` stops: what
    the executor carries out) and each replica's ``Move``; ``refusals``: why it would
    leave a model with no serving replica (empty: it would not)."""

    node: str
    plan: Plan
    moves: tuple[Move, ...]

    @property
    def refusals(self) -> list[str]:
        return self.plan.downtime

    def as_dict(self) -> dict[str, object]:
        return {
            "node": self.node,
            "moves": [m.as_dict() for m in self.moves],
            "refusals": self.refusals,
            "unplaced": [list(u) for u in self.plan.unplaced],
        }


def drain_plan(
    spec: ClusterSpec, facts: dict[str, NodeFacts], node: str, cordoned: frozenset[str] = frozenset()
) -> DrainPlan:
    """Move every replica off ``node`` (see the module's docstring); ``cordoned``: the
    other nodes that take nothing new (``node`` is added)."""
    models = {m.name: m for m in spec.models}
    running = running_replicas(facts)
    on = [r for r in running if node in r.members]
    stops: list[Action] = []
    moving: list[Running] = []
    for r in on:
        model = models.get(r.model)
        if model is None:
            stops.append(stop_action(r, f"drain {node}: model removed from the cluster file"))
        elif model.mode is ScalingMode.off:
            stops.append(stop_action(r, f"drain {node}: model is switched off"))
        elif r.draining is not None:
            stops.append(stop_action(r, f"drain {node}: left draining by an interrupted apply"))
        else:
            moving.append(r)
    wanted = frozenset((r.model, r.replica) for r in moving)
    actions, left = move_plan(spec, facts, wanted, cordoned | {node})
    # what serves each model meanwhile: its replicas elsewhere, and the successors started
    serving = Counter(r.model for r in running if node not in r.members and r.up and r.draining is None)
    serving.update(a.model for a in actions if a.surge)
    moves = [
        Move(
            a.model,
            a.retire.replica,
            a.retire.nodes,
            a.nodes,
            a.replica,
            f"drain {node}: {'successor first' if a.surge else 'replaced in place'}",
        )
        for a in actions
        if a.retire is not None
    ]
    drained = [a.model_copy(update={"reason": f"drain {node}; {a.reason}"}) for a in actions]
    for r, why in left:
        others = serving[r.model]
        if others or not r.up:
            serve = f"{others} other replica(s) serve" if others else "it does not serve"
            stop = stop_action(r, f"drain {node}: fits on no other node ({why}); stopped, {serve}")
        else:
            stop = stop_action(
                r,
                f"drain {node}: fits on no other node; stopped",
                downtime=f"{r.model} would have no serving replica: replica {r.replica} fits on no other"
                f" node ({why})",
            )
        stops.append(stop)
    moves += [Move(a.model, a.replica, a.nodes, (), None, a.reason) for a in stops]
    order = {"-": 0, "~": 1}
    ordered = sorted([*stops, *drained], key=lambda a: (order[a.op], a.model, a.replica))
    plan = Plan(actions=tuple(ordered), unplaced=(), warnings=(), facts_digest=facts_digest(facts))
    return DrainPlan(node, plan, tuple(sorted(moves, key=lambda m: (m.model, m.replica))))
