"""Desired vs actual -> a Plan: a value listing every action with its reason.

``+`` create a replica, ``~`` replace one whose spec changed (or restart one that failed),
``-`` delete one whose model was removed or switched off, ``=`` leave one alone and say
why. What ``--dry-run`` prints is exactly what ``apply`` executes; a plan saved as JSON
carries a digest of the facts it was made from, so applying it later refuses when the
nodes have changed since.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from pydantic import Field

from llmgw_cli.core.engines import Member, replica_unit, spec_hash
from llmgw_cli.core.facts import Fact, GpuHealth, NodeFacts, ReplicaUnit
from llmgw_cli.core.hardware import fabric_status
from llmgw_cli.core.parse.units import replica_units
from llmgw_cli.core.placement import PlacedReplica, Placement, Slot, place
from llmgw_cli.core.spec import ClusterSpec, Model, ScalingMode

Op = Literal["+", "~", "-", "="]


class UnitFile(Fact):
    node: str
    name: str
    text: str


class Running(Fact):
    """A replica found on the nodes: its units grouped by their model and replica labels."""

    model: str
    replica: int
    spec_hash: str
    port: int
    members: tuple[str, ...]  # node names, rank order
    unit: str
    units: dict[str, ReplicaUnit]  # node -> the replica's unit found there

    @property
    def gpus(self) -> dict[str, tuple[str, ...]]:
        """node -> GPU UUIDs its unit holds."""
        return {node: u.gpus for node, u in self.units.items()}

    @property
    def states(self) -> dict[str, str]:
        """node -> ActiveState of its unit."""
        return {node: u.active_state for node, u in self.units.items()}

    @property
    def up(self) -> bool:
        """Every member runs its unit (a multi-node replica serves only with all of them):
        the one rule for plan, apply and status."""
        return all(node in self.units and self.units[node].up for node in self.members)

    def serving(self, unreachable: frozenset[str] = frozenset()) -> bool:
        """The replica may take requests: its rank-0 unit (which serves the API) is up, and
        every other member's unit is up or unseen because its node, in ``unreachable``,
        could not be read this time (an SSH hiccup is not a failed engine; the health
        checks still judge it). The same ``ReplicaUnit.up`` as ``up``, which plan and
        status use."""
        head = self.units.get(self.members[0]) if self.members else None
        return (
            head is not None
            and head.up
            and all(
                (n in self.units and self.units[n].up) or (n not in self.units and n in unreachable)
                for n in self.members
            )
        )

    @property
    def down(self) -> bool:
        """Some member is not running (failed, stopped, or its unit missing on a node)."""
        return not self.up


class Retired(Fact):
    """The replica a ``~`` replaces: drained, then stopped and its units removed."""

    replica: int
    nodes: tuple[str, ...]
    unit: str
    port: int


class Action(Fact):
    op: Op
    model: str
    replica: int
    nodes: tuple[str, ...]
    reason: str
    write: tuple[UnitFile, ...] = ()
    remove: tuple[tuple[str, str], ...] = ()  # (node, unit name)
    port: int | None = None
    gpus: dict[str, tuple[str, ...]] = Field(
        default_factory=dict
    )  # node -> GPU UUIDs the replica takes (`+`, `~`)
    # `~` only: the replica replaced. With ``surge`` this action's units start first (a
    # new replica number, port and cards) and ``retire`` is drained and stopped once they
    # serve; without, ``retire`` is drained and stopped first, then these units start.
    retire: Retired | None = None
    surge: bool = False
    # Non-empty: carrying this out leaves the model with no serving replica for its load
    # time, in plain words; apply refuses it without --allow-downtime.
    downtime: str = ""


class Plan(Fact):
    actions: tuple[Action, ...]
    unplaced: tuple[tuple[str, str], ...]  # (model, reason)
    warnings: tuple[str, ...]
    facts_digest: str

    @property
    def changes(self) -> list[Action]:
        return [a for a in self.actions if a.op != "="]

    @property
    def downtime(self) -> list[str]:
        """Why carrying it out leaves some model with no serving replica (empty: it does not)."""
        return [a.downtime for a in self.actions if a.downtime]


def running_replicas(facts: dict[str, NodeFacts]) -> list[Running]:
    """Replicas as the nodes report them: units grouped by their model and replica labels."""
    found: dict[tuple[str, int], Running] = {}
    for _, f in sorted(facts.items()):
        for u in replica_units(f):
            key = (u.model, u.replica)
            current = found.get(key) or Running(
                model=u.model,
                replica=u.replica,
                spec_hash=u.spec_hash,
                port=u.port,
                members=u.members,
                unit=u.name,
                units={},
            )
            found[key] = current.model_copy(update={"units": {**current.units, u.node: u}})
    return [found[k] for k in sorted(found)]


def facts_digest(facts: dict[str, NodeFacts]) -> str:
    """Digest of the facts a plan depends on (cards, their health, units and their states,
    fabric ports), not of what changes by itself (clock, free memory)."""
    view = {
        name: {
            "error": f.error,
            "gpus": [(g.uuid, g.health.value) for g in f.gpus],
            "units": sorted((u.name, u.active_state) for u in f.units),
            "labels": f.unit_labels,
            "draining": sorted(f.draining),
            "ib": [(p.hca, p.port, p.state.value) for p in f.ib_ports],
        }
        for name, f in sorted(facts.items())
    }
    return hashlib.sha256(json.dumps(view, sort_keys=True).encode()).hexdigest()[:16]


def _as_replica(facts: dict[str, NodeFacts], r: Running) -> PlacedReplica:
    return _holding(facts, r.model, r.members, r.gpus)


def _holding(
    facts: dict[str, NodeFacts], model: str, nodes: tuple[str, ...], gpus: dict[str, tuple[str, ...]]
) -> PlacedReplica:
    """A replica of ``model`` on ``nodes`` holding the cards ``gpus`` (node -> UUIDs), as
    placement takes what is already taken (card indices from the facts)."""
    slots = []
    for node in nodes:
        uuids = gpus.get(node, ())
        indices = tuple(g.index for g in facts[node].gpus if g.uuid in uuids) if node in facts else ()
        slots.append(Slot(node, indices, uuids))
    return PlacedReplica(model, tuple(slots))


def _used_ports(running: list[Running]) -> dict[str, set[int]]:
    used: dict[str, set[int]] = defaultdict(set)
    for r in running:
        for node in r.members:
            used[node] |= {r.port, r.port + 1}
    return used


def _next_port(
    spec: ClusterSpec, model: Model, node: str, used: dict[str, set[int]], count: int
) -> int | None:
    ports = spec.profiles[model.profile].ports
    for port in range(ports.first, ports.last + 2 - count):
        if all(p not in used[node] for p in range(port, port + count)):
            used[node] |= set(range(port, port + count))
            return port
    return None


def _nccl(spec: ClusterSpec, facts: dict[str, NodeFacts], node: str) -> str:
    status = fabric_status(spec.node(node), facts[node])
    active = [f"{p.hca}:{p.port}" for p in status.ports]
    return "=" + ",".join(active) if active else ""


def _units(
    spec: ClusterSpec,
    facts: dict[str, NodeFacts],
    model: Model,
    replica: PlacedReplica,
    *,
    index: int,
    port: int,
) -> tuple[UnitFile, ...]:
    nodes = {n.name: n for n in spec.nodes}
    members = tuple(
        Member(nodes[slot.node], rank, slot.uuids, _nccl(spec, facts, slot.node))
        for rank, slot in enumerate(replica.slots)
    )
    units = (
        replica_unit(spec, model, replica=index, member=m, port=port, members=members, dist_port=port + 1)
        for m in members
    )
    return tuple(UnitFile(node=u.node, name=u.name, text=u.text) for u in units)


@dataclass
class _Sorted:
    """Running replicas sorted by what happens to them."""

    delete: list[Action] = field(default_factory=list)
    keep: list[Running] = field(default_factory=list)
    replace: dict[str, list[Running]] = field(default_factory=lambda: defaultdict(list))


def _sort_running(spec: ClusterSpec, running: list[Running]) -> _Sorted:
    models = {m.name: m for m in spec.models}
    out = _Sorted()
    for r in running:
        model = models.get(r.model)
        if model is None or model.mode is ScalingMode.off:
            why = "model removed from the cluster file" if model is None else "model is switched off"
            removal = tuple((n, r.unit) for n in r.members)
            out.delete.append(
                Action(op="-", model=r.model, replica=r.replica, nodes=r.members, reason=why, remove=removal)
            )
        elif r.spec_hash != spec_hash(spec, model) or r.down:
            out.replace[r.model].append(r)
        else:
            out.keep.append(r)
    return out


def _keep_actions(spec: ClusterSpec, keep: list[Running]) -> list[Action]:
    counts = Counter(r.model for r in keep)
    actions = []
    for r in keep:
        model = spec.model(r.model)
        if model.mode is not ScalingMode.always:
            reason = "on demand: started and stopped by the gateway"
        elif model.scaling and counts[r.model] > model.scaling.min:
            reason = "above min: the gateway scales it back when idle"
        else:
            reason = "unchanged"
        actions.append(
            Action(op="=", model=r.model, replica=r.replica, nodes=r.members, reason=reason, port=r.port)
        )
    return actions


def _wanted(spec: ClusterSpec, sorted_: _Sorted) -> dict[str, int]:
    """New replicas per model: one per replacement, plus always-on models up to ``min``."""
    counts = Counter(r.model for r in sorted_.keep)
    want = {name: len(rs) for name, rs in sorted_.replace.items()}
    for model in spec.models:
        if model.mode is ScalingMode.always and model.scaling:
            missing = model.scaling.min - counts[model.name] - len(sorted_.replace.get(model.name, []))
            want[model.name] = want.get(model.name, 0) + max(missing, 0)
    return want


def _placed_actions(
    spec: ClusterSpec,
    facts: dict[str, NodeFacts],
    placement: Placement,
    running: list[Running],
    *,
    used: dict[str, set[int]],
    replace: dict[str, list[Running]],
) -> tuple[list[Action], list[tuple[str, str]]]:
    """A ``+`` (or ``~`` for a replica in ``replace``) action per placed replica, with its
    port and replica index; plus what could not be placed and why. ``replace`` is consumed."""
    taken: dict[str, set[int]] = defaultdict(set)
    for r in running:
        taken[r.model].add(r.replica)
    unplaced = [(u.model, u.reason) for u in placement.unplaced]
    actions: list[Action] = []
    for replica in placement.replicas:
        model = spec.model(replica.model)
        head = replica.slots[0].node
        port = _next_port(spec, model, head, used, 2 if model.nodes > 1 else 1)
        if port is None:
            unplaced.append((model.name, f"no free port in profile {model.profile}'s range on {head}"))
            continue
        old = replace.get(model.name, [])
        previous = old.pop(0) if old else None
        index = (
            previous.replica if previous else min(set(range(len(taken[model.name]) + 1)) - taken[model.name])
        )
        taken[model.name].add(index)
        writes = _units(spec, facts, model, replica, index=index, port=port)
        nodes = tuple(s.node for s in replica.slots)
        stale: tuple[tuple[str, str], ...] = ()
        if previous is None:
            op: Op = "+"
            reason = "below min" if model.mode is ScalingMode.always else "requested"
        else:
            op = "~"
            reason = (
                "not running; started again"
                if previous.spec_hash == spec_hash(spec, model)
                else "spec changed"
            )
            written = {(w.node, w.name) for w in writes}
            stale = tuple((n, previous.unit) for n in previous.members if (n, previous.unit) not in written)
        actions.append(
            Action(
                op=op,
                model=model.name,
                replica=index,
                nodes=nodes,
                write=writes,
                remove=stale,
                port=port,
                reason=reason,
                gpus={s.node: s.uuids for s in replica.slots},
            )
        )
    return actions, unplaced


def grow_plan(
    spec: ClusterSpec,
    facts: dict[str, NodeFacts],
    model: str,
    count: int = 1,
    *,
    reserved: Sequence[Action] = (),
    avoid: frozenset[str] = frozenset(),
) -> Plan:
    """Start ``count`` more replicas of ``model`` around everything on the nodes (an
    on-demand start, a scale-out, a replacement), with the placement rules of ``apply``.
    Nothing else changes: every unit found holds its cards, running or not.

    ``reserved``: starts planned earlier whose units are not on the nodes yet (their
    weights are still being fetched): their cards, ports and replica numbers count as
    taken. ``avoid``: GPU UUIDs not to use (the cards of a unit systemd gave up on)."""
    running = running_replicas(facts)
    held = [_as_replica(facts, r) for r in running] + [
        _holding(facts, a.model, a.nodes, a.gpus) for a in reserved
    ]
    placement = place(spec, _without(facts, avoid), held, {model: count})
    used = _used_ports(running)
    for a in reserved:
        if a.port is not None:
            used[a.nodes[0]] |= {a.port, a.port + 1}
    indices = running + [_placeholder(a) for a in reserved]
    actions, unplaced = _placed_actions(spec, facts, placement, indices, used=used, replace={})
    warnings = tuple(dict.fromkeys(w for rep in placement.replicas for w in rep.warnings))
    return Plan(
        actions=tuple(actions), unplaced=tuple(unplaced), warnings=warnings, facts_digest=facts_digest(facts)
    )


def _placeholder(action: Action) -> Running:
    """A reserved start as a Running value: only its model and replica number are read."""
    return Running(
        model=action.model,
        replica=action.replica,
        spec_hash="",
        port=action.port or 0,
        members=action.nodes,
        unit="",
        units={},
    )


def _without(facts: dict[str, NodeFacts], avoid: frozenset[str]) -> dict[str, NodeFacts]:
    """``facts`` with the cards in ``avoid`` marked faulty, so placement passes them by."""
    if not avoid:
        return facts
    out = {}
    for name, f in facts.items():
        if any(g.uuid in avoid for g in f.gpus):
            gpus = [
                g.model_copy(update={"health": GpuHealth.faulty}) if g.uuid in avoid else g for g in f.gpus
            ]
            out[name] = f.model_copy(update={"gpus": gpus})
        else:
            out[name] = f
    return out


def conflicts(facts: dict[str, NodeFacts], action: Action) -> str | None:
    """Why ``action``, planned on older facts, can no longer go where it was placed: a
    unit found now holds one of its cards or its port, or one of its cards is faulty.
    None when it still fits. (A plan made before a lock was taken is checked under it.)"""
    running = running_replicas(facts)
    for node in action.nodes:
        mine = set(action.gpus.get(node, ()))
        for r in running:
            if (r.model, r.replica) == (action.model, action.replica) and not action.remove:
                return f"replica {action.replica} of {action.model} exists already"
            taken = mine & set(r.gpus.get(node, ()))
            if taken:
                return f"{node}: card(s) {', '.join(sorted(taken))} now held by {r.model} replica {r.replica}"
        f = facts.get(node)
        if f is None or f.error:
            return f"{node}: not reachable"
        bad = [g.uuid for g in f.gpus if g.uuid in mine and g.health is not GpuHealth.healthy]
        if bad:
            return f"{node}: card(s) {', '.join(bad)} now faulty"
    if action.port is not None:
        head = action.nodes[0]
        ports = {action.port, action.port + 1}
        for r in running:
            if head in r.members and ports & {r.port, r.port + 1}:
                return f"{head}: port {action.port} now used by {r.model} replica {r.replica}"
    return None


def stop_plan(facts: dict[str, NodeFacts], model: str, replica: int, reason: str) -> Plan:
    """Stop one replica and remove its units on every member (idle, evicted, scaled back)."""
    found = [r for r in running_replicas(facts) if (r.model, r.replica) == (model, replica)]
    actions = tuple(
        Action(
            op="-",
            model=r.model,
            replica=r.replica,
            nodes=r.members,
            reason=reason,
            remove=tuple((n, r.unit) for n in r.members),
            port=r.port,
        )
        for r in found
    )
    return Plan(actions=actions, unplaced=(), warnings=(), facts_digest=facts_digest(facts))


def make_plan(spec: ClusterSpec, facts: dict[str, NodeFacts]) -> Plan:
    """The plan that brings the nodes to the spec: ``min`` replicas of each always-on model,
    nothing lost or restarted that already matches."""
    running = running_replicas(facts)
    sorted_ = _sort_running(spec, running)
    actions = sorted_.delete + _keep_actions(spec, sorted_.keep)
    placement = place(spec, facts, [_as_replica(facts, r) for r in sorted_.keep], _wanted(spec, sorted_))
    created, unplaced = _placed_actions(
        spec, facts, placement, running, used=_used_ports(sorted_.keep), replace=sorted_.replace
    )
    actions += created
    for name, left in sorted_.replace.items():
        unplaced += [
            (name, f"replica {r.replica} needs replacing but does not fit; left as it is") for r in left
        ]
    order = {"-": 0, "~": 1, "+": 2, "=": 3}
    actions.sort(key=lambda a: (order[a.op], a.model, a.replica))
    warnings = tuple(dict.fromkeys(w for rep in placement.replicas for w in rep.warnings))
    return Plan(
        actions=tuple(actions), unplaced=tuple(unplaced), warnings=warnings, facts_digest=facts_digest(facts)
    )
