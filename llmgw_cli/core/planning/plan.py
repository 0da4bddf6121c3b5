"""Desired vs actual -> a Plan: a value listing every action with its reason.

``+`` create a replica, ``~`` replace one whose spec changed (or restart one that failed),
``-`` delete one whose model was removed or switched off, ``=`` leave one alone and say
why.

A serving replica is replaced by rolling it: its successor starts first, on free cards
(a new replica number and port), and the old one is drained and stopped once the
successor serves (``surge``); its cards are then free for the model's next successor.
Only when no successor fits beside it is it replaced in place (stopped, then started on
its own cards), and when that leaves its model with no serving replica the action says so
(``downtime``): ``apply`` refuses it unless told otherwise. What ``--dry-run`` prints is exactly what ``apply`` executes; a plan saved as JSON
carries a digest of the facts it was made from, so applying it later refuses when the
nodes have changed since.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field

from llmgw_cli.core.clusterfile.spec import ClusterSpec, Model, ScalingMode, SourceKind
from llmgw_cli.core.engine.engines import Member, replica_unit, spec_hash
from llmgw_cli.core.observe.facts import Fact, GpuHealth, NodeFacts, ReplicaUnit
from llmgw_cli.core.observe.hardware import fabric_status
from llmgw_cli.core.observe.health import ReplicaState, describe, worst
from llmgw_cli.core.observe.parse.units import replica_units
from llmgw_cli.core.planning.placement import PlacedReplica, Placement, Placer, Slot, place
from llmgw_cli.core.planning.steps import HostStep
from llmgw_cli.core.weights.pins import pinned_commits

Op = Literal["+", "~", "-", "="]
Answers = Mapping[tuple[str, int], bool]
"""What replicas' health checks answered: (model, replica) -> ready."""


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
    # Being retired (a drain marker on a member node): its deadline, node clock. None: not.
    draining: float | None = None

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
        """Every member's unit is ready or starting (a multi-node replica serves only with
        all of them): the one rule for plan, apply and status (``core/observe/health.py``)."""
        return self.health().alive

    def health(self, healthy: bool | None = None) -> ReplicaState:
        """Its state: its worst member's (``core/observe/health.py``); a member without its unit
        is stopped. ``healthy``: the last answer of its health check, None: not known."""
        return worst(self._member_health(healthy).values())

    def _member_health(self, healthy: bool | None) -> dict[str, ReplicaState]:
        head = self.members[0] if self.members else ""
        return {
            n: self.units[n].health(healthy if n == head else None)
            if n in self.units
            else ReplicaState.stopped
            for n in self.members
        }

    def describe(self, healthy: bool | None = None) -> str:
        """``crash-looping (7 restarts, exit status 2)``, from its worst member's unit."""
        states = self._member_health(healthy)
        state = worst(states.values())
        node = next((n for n, s in states.items() if s is state), "")
        unit = self.units.get(node)
        return describe(state, unit.state if unit else None)

    def serving(self, unreachable: frozenset[str] = frozenset()) -> bool:
        """The replica may take requests: its rank-0 unit (which serves the API) is up, and
        every other member's unit is up or unseen because its node, in ``unreachable``,
        could not be read this time (an SSH hiccup is not a failed engine; the health
        checks still judge it). The same ``ReplicaUnit.up`` as ``up``, which plan and
        status use. A draining replica does not serve: it is being retired."""
        head = self.units.get(self.members[0]) if self.members else None
        return (
            self.draining is None
            and head is not None
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
    # `~` of a replica that is not ready nor starting: its state as systemd says it
    # (``crash-looping (7 restarts, exit status 2)``); apply starts it again once.
    unhealthy: str = ""
    # `=` of a replica that runs but was not seen ready yet
    starting: bool = False


class Plan(Fact):
    actions: tuple[Action, ...]
    unplaced: tuple[tuple[str, str], ...]  # (model, reason)
    warnings: tuple[str, ...]
    facts_digest: str
    # (model, commit) of each repository llmgw fetches, as the plan was made for it: a saved
    # plan is refused once a revision names another commit (``core/weights/pins.py``)
    commits: tuple[tuple[str, str], ...] = ()
    # The whole change, for `plan` and a saved plan (``core/planning/whole_plan.py``): the host
    # steps beside the actions, and the digests a saved plan is checked against.
    format: int = 1
    steps: tuple[HostStep, ...] = ()
    cluster_digest: str = ""
    cluster_parts: dict[str, str] = Field(default_factory=dict)
    node_digests: dict[str, str] = Field(default_factory=dict)
    host_digest: str = ""

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
    return [_with_marker(facts, found[k]) for k in sorted(found)]


def held_faults(r: Running, facts: dict[str, NodeFacts]) -> tuple[str, ...]:
    """The faulty cards ``r``'s units hold, one line each (node, card, why): a card the
    probe marks faulty, or one nvidia-smi no longer lists while it answers for the others
    or names a card it cannot open (fallen off the bus). Nodes not read say nothing."""
    found: list[str] = []
    for node, uuids in r.gpus.items():
        f = facts.get(node)
        if f is None or not f.reachable:
            continue
        listed = {g.uuid: g for g in f.gpus}
        for uuid in uuids:
            g = listed.get(uuid)
            if g is None and (f.gpus or f.lost_gpus):
                found.append(f"{node}: card {uuid} is gone from nvidia-smi's list (fallen off the bus)")
            elif g is not None and g.health is GpuHealth.faulty:
                found.append(f"{node} GPU {g.index}: {'; '.join(g.reasons) or 'faulty'}")
    return tuple(found)


def _with_marker(facts: dict[str, NodeFacts], r: Running) -> Running:
    """``r`` with the earliest deadline of the drain markers its members' nodes hold."""
    deadlines = [facts[n].draining[r.unit] for n in r.members if n in facts and r.unit in facts[n].draining]
    return r.model_copy(update={"draining": min(deadlines)}) if deadlines else r


def digest(value: Any) -> str:
    """A short digest of a JSON value, the same whatever the order of its keys: what a
    saved plan carries to be checked against what holds when it is applied."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


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
    return digest(view)


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


def _sort_running(
    spec: ClusterSpec,
    running: list[Running],
    replace: frozenset[tuple[str, int]] = frozenset(),
    answers: Answers | None = None,
    facts: dict[str, NodeFacts] | None = None,
) -> _Sorted:
    models = {m.name: m for m in spec.models}
    out = _Sorted()
    for r in running:
        model = models.get(r.model)
        if model is None or model.mode is ScalingMode.off or r.draining is not None:
            if model is None:
                why = "model removed from the cluster file"
            elif model.mode is ScalingMode.off:
                why = "model is switched off"
            else:
                why = "left draining by an interrupted apply"
            removal = tuple((n, r.unit) for n in r.members)
            out.delete.append(
                Action(op="-", model=r.model, replica=r.replica, nodes=r.members, reason=why, remove=removal)
            )
        elif (
            r.spec_hash != spec_hash(spec, model)
            or not r.health((answers or {}).get((r.model, r.replica))).alive
            or (r.model, r.replica) in replace
            or held_faults(r, facts or {})
        ):
            out.replace[r.model].append(r)
        else:
            out.keep.append(r)
    return out


def _keep_actions(spec: ClusterSpec, keep: list[Running], answers: Answers) -> list[Action]:
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
        healthy = answers.get((r.model, r.replica))
        starting = r.health(healthy) is ReplicaState.starting
        if starting:
            reason = f"{r.describe(healthy)}: not seen ready yet"
        actions.append(
            Action(
                op="=",
                model=r.model,
                replica=r.replica,
                nodes=r.members,
                reason=reason,
                port=r.port,
                starting=starting,
            )
        )
    return actions


def _wanted(spec: ClusterSpec, sorted_: _Sorted) -> dict[str, int]:
    """New replicas per always-on model up to ``min``, beside the kept and the replaced ones
    (replaced or left as they are, each still counts once)."""
    counts = Counter(r.model for r in sorted_.keep)
    want = {}
    for model in spec.models:
        if model.mode is ScalingMode.always and model.scaling:
            missing = model.scaling.min - counts[model.name] - len(sorted_.replace.get(model.name, []))
            if missing > 0:
                want[model.name] = missing
    return want


def _placed_actions(
    spec: ClusterSpec,
    facts: dict[str, NodeFacts],
    placement: Placement,
    running: list[Running],
    *,
    used: dict[str, set[int]],
) -> tuple[list[Action], list[tuple[str, str]]]:
    """A ``+`` action per placed replica, with its port and the lowest replica number not
    in ``running``; plus what could not be placed and why."""
    taken: dict[str, set[int]] = defaultdict(set)
    for r in running:
        taken[r.model].add(r.replica)
    unplaced = [(u.model, u.reason) for u in placement.unplaced]
    actions: list[Action] = []
    for replica in placement.replicas:
        model = spec.model(replica.model)
        head = replica.slots[0].node
        port = _next_port(spec, model, head, used, _port_count(model))
        if port is None:
            unplaced.append((model.name, f"no free port in profile {model.profile}'s range on {head}"))
            continue
        index = min(set(range(len(taken[model.name]) + 1)) - taken[model.name])
        taken[model.name].add(index)
        actions.append(
            Action(
                op="+",
                model=model.name,
                replica=index,
                nodes=tuple(s.node for s in replica.slots),
                write=_units(spec, facts, model, replica, index=index, port=port),
                port=port,
                reason="below min" if model.mode is ScalingMode.always else "requested",
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
    shun: frozenset[str] = frozenset(),
    cordoned: frozenset[str] = frozenset(),
) -> Plan:
    """Start ``count`` more replicas of ``model`` around everything on the nodes (an
    on-demand start, a scale-out, a replacement), with the placement rules of ``apply``.
    Nothing else changes: every unit found holds its cards, running or not.

    ``reserved``: starts planned earlier whose units are not on the nodes yet (their
    weights are still being fetched): their cards, ports and replica numbers count as
    taken. ``avoid``: GPU UUIDs not to use (the cards of a unit systemd gave up on).
    ``shun``: nodes whose cards are used only when the replicas fit nowhere else (where
    the model crash-looped or failed to start: the node itself can be the cause).
    ``cordoned``: nodes out for maintenance, never used."""
    if shun:
        shunned = {g.uuid for name in shun if name in facts for g in facts[name].gpus}
        plan = grow_plan(
            spec, facts, model, count, reserved=reserved, avoid=avoid | shunned, cordoned=cordoned
        )
        if plan.changes and not plan.unplaced:
            return plan
    running = running_replicas(facts)
    held = [_as_replica(facts, r) for r in running] + [
        _holding(facts, a.model, a.nodes, a.gpus) for a in reserved
    ]
    placement = place(spec, _without(facts, avoid), held, {model: count}, cordoned)
    used = _used_ports(running)
    for a in reserved:
        if a.port is not None:
            used[a.nodes[0]] |= {a.port, a.port + 1}
    indices = running + [_placeholder(a) for a in reserved]
    actions, unplaced = _placed_actions(spec, facts, placement, indices, used=used)
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
    unit found now holds one of its cards or its port, or one of its cards is faulty; the
    replica it retires (``~``) is not in its way. None when it still fits. (A plan made before a lock was taken is checked under it.)"""
    retired = (action.model, action.retire.replica) if action.retire else None
    running = [r for r in running_replicas(facts) if (r.model, r.replica) != retired]
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
        ports = _ports(action.port, action.nodes)
        for r in running:
            if head in r.members and ports & _ports(r.port, r.members):
                return f"{head}: port {action.port} now used by {r.model} replica {r.replica}"
    return None


def stop_action(r: Running, reason: str, downtime: str = "") -> Action:
    """The step that stops running replica ``r`` and removes its units on every member."""
    return Action(
        op="-",
        model=r.model,
        replica=r.replica,
        nodes=r.members,
        reason=reason,
        remove=tuple((n, r.unit) for n in r.members),
        port=r.port,
        downtime=downtime,
    )


def stop_plan(facts: dict[str, NodeFacts], model: str, replica: int, reason: str) -> Plan:
    """Stop one replica and remove its units on every member (idle, evicted, scaled back)."""
    found = [r for r in running_replicas(facts) if (r.model, r.replica) == (model, replica)]
    actions = tuple(stop_action(r, reason) for r in found)
    return Plan(actions=actions, unplaced=(), warnings=(), facts_digest=facts_digest(facts))


def make_plan(
    spec: ClusterSpec,
    facts: dict[str, NodeFacts],
    *,
    replace: frozenset[tuple[str, int]] = frozenset(),
    answers: Answers | None = None,
    cordoned: frozenset[str] = frozenset(),
) -> Plan:
    """The plan that brings the nodes to the spec: ``min`` replicas of each always-on model,
    nothing lost or restarted that already matches; a replica that is not ready nor
    starting (``core/observe/health.py``) is started again in place. ``replace``: (model, replica)
    pairs to replace even though they match (the caller checks that they run).
    ``answers``: the health checks' answers the caller has, (model, replica) -> ready.
    ``cordoned``: nodes that take no new replica (the ones there are left as they are)."""
    running = running_replicas(facts)
    sorted_ = _sort_running(spec, running, replace, answers, facts)
    actions = sorted_.delete + _keep_actions(spec, sorted_.keep, answers or {})
    roll = _Rolling(spec, facts, running, sorted_, cordoned)
    actions += roll.actions
    unplaced = roll.unplaced
    # `+` for always-on models below min, around what runs once the replacements are done
    final = sorted_.keep + roll.left
    held = [_as_replica(facts, r) for r in final] + roll.successors
    placement = place(spec, facts, held, _wanted(spec, sorted_), cordoned)
    indices = running + [_placeholder(a) for a in roll.actions]
    created, missed = _placed_actions(spec, facts, placement, indices, used=roll.used)
    actions += created
    unplaced += missed
    order = {"-": 0, "~": 1, "+": 2, "=": 3}
    actions.sort(key=lambda a: (order[a.op], a.model, a.retire.replica if a.retire else a.replica))
    warnings = tuple(
        dict.fromkeys(
            [
                *roll.warnings,
                *(w for rep in placement.replicas for w in rep.warnings),
                *unpinned_warnings(spec),
            ]
        )
    )
    return Plan(
        actions=tuple(actions),
        unplaced=tuple(unplaced),
        warnings=warnings,
        facts_digest=facts_digest(facts),
        commits=pinned_commits(spec),
    )


def move_plan(
    spec: ClusterSpec,
    facts: dict[str, NodeFacts],
    moving: frozenset[tuple[str, int]],
    cordoned: frozenset[str],
) -> tuple[list[Action], list[tuple[Running, str]]]:
    """Successors for the running replicas ``moving`` (model, replica: each of a model in
    the spec), placed off the ``cordoned`` nodes as ``make_plan`` rolls a replacement
    (successor first where one fits), every other replica keeping its cards: the ``~``
    actions, and the replicas that fit nowhere with why (``llmgw drain``)."""
    running = running_replicas(facts)
    s = _Sorted()
    for r in running:
        if (r.model, r.replica) in moving:
            s.replace[r.model].append(r)
        else:
            s.keep.append(r)
    roll = _Rolling(spec, facts, running, s, cordoned)
    left = []
    for old in roll.left:
        tried = roll.placer.one(spec.model(old.model))
        if isinstance(tried, PlacedReplica):  # the cards are there, a port is not
            roll.placer.release(tried)
            head = tried.slots[0].node
            why = f"no free port in profile {spec.model(old.model).profile}'s range on {head}"
        else:
            why = tried.reason
        left.append((old, why))
    return roll.actions, left


class _Rolling:
    """The replacements of a plan, simulated one at a time per model, in replica order, as
    the executor carries them out (models side by side, each model's one after another).

    A serving replica's successor is placed with everything still holding its cards (the
    kept replicas, the successors so far and every replica not replaced yet, this one
    included), on its own nodes first: if it fits, it starts first (surge); the old one's
    cards are then free for that model's next successor (never another model's: models
    are replaced side by side). If not, it is replaced in place on its own cards freed,
    which leaves the model with no serving replica meanwhile when no other one serves. A
    replica that is down serves nothing: it is replaced in place."""

    def __init__(
        self,
        spec: ClusterSpec,
        facts: dict[str, NodeFacts],
        running: list[Running],
        s: _Sorted,
        cordoned: frozenset[str] = frozenset(),
    ):
        self.spec, self.facts = spec, facts
        olds = [r for rs in s.replace.values() for r in rs]
        self.placer = Placer(spec, facts, [_as_replica(facts, r) for r in s.keep + olds], cordoned)
        # ports: an old replica keeps its own until the end (a successor of another model
        # may start while it still runs); one replaced in place gives its own to its successor
        self.used = _used_ports(s.keep + olds)
        self.taken: dict[str, set[int]] = defaultdict(set)
        for r in running:
            self.taken[r.model].add(r.replica)
        self.actions: list[Action] = []
        self.successors: list[PlacedReplica] = []
        self.left: list[Running] = []  # not replaced: does not fit
        self.unplaced: list[tuple[str, str]] = []
        self.warnings: list[str] = []
        serving = Counter(r.model for r in s.keep)
        models = sorted(
            (spec.model(name) for name in s.replace),
            key=lambda m: (-m.nodes, -m.tensor_parallel, spec.models.index(m)),
        )
        for model in models:
            self._model(model, sorted(s.replace[model.name], key=lambda r: r.replica), serving[model.name])

    def _model(self, model: Model, olds: list[Running], kept: int) -> None:
        done = 0  # successors so far: each one serves before the next replacement begins
        retired: list[PlacedReplica] = []
        for i, old in enumerate(olds):
            others = (
                kept + done + sum(1 for o in (*olds[i + 1 :], *self.left) if o.model == model.name and o.up)
            )
            held = _as_replica(self.facts, old)
            action = self._surge(model, old) if old.up else None
            if action is None:
                self.placer.release(held)
                action = self._in_place(model, old, others)
                if action is None:
                    self.placer.take(held)
                    self.left.append(old)
                    self.unplaced.append(
                        (model.name, f"replica {old.replica} needs replacing but does not fit; left as it is")
                    )
                    continue
            else:
                self.placer.release(held)
                retired.append(held)
            self.actions.append(action)
            done += 1
        # A retired replica's cards were free for this model's successors only: the other
        # models' replacements run at the same time, maybe before it is stopped.
        mine = {(s.node, u) for rep in self.successors for s in rep.slots for u in s.uuids}
        for gone in retired:
            left = {s.node: tuple(u for u in s.uuids if (s.node, u) not in mine) for s in gone.slots}
            self.placer.take(_holding(self.facts, "", tuple(left), left))

    def _surge(self, model: Model, old: Running) -> Action | None:
        result = self.placer.one(model, prefer=old.members)
        if not isinstance(result, PlacedReplica):
            return None
        port = _next_port(self.spec, model, result.slots[0].node, self.used, _port_count(model))
        if port is None:
            self.placer.release(result)
            return None
        index = min(set(range(len(self.taken[model.name]) + 1)) - self.taken[model.name])
        why = f"{_cause(self.spec, model, old, self.facts)}; new replica first, then #{old.replica} drained and stopped"
        return self._action(model, old, result, index=index, port=port, reason=why, surge=True)

    def _in_place(self, model: Model, old: Running, others: int) -> Action | None:
        result = self.placer.one(model, prefer=old.members)
        if not isinstance(result, PlacedReplica):
            return None
        head = result.slots[0].node
        mine = {old.port, old.port + 1} if head in old.members else set()
        self.used[head] -= mine
        port = _next_port(self.spec, model, head, self.used, _port_count(model))
        if port is None:
            self.used[head] |= mine
            self.placer.release(result)
            return None
        cause = _cause(self.spec, model, old, self.facts)
        downtime = ""
        if not old.up:
            why = cause
        elif others:
            serve = "1 other replica serves" if others == 1 else f"{others} other replicas serve"
            why = f"{cause}; replaced in place: no free cards, {serve}"
        else:
            why = f"{cause}; replaced in place: no free cards, no other replica serves"
            cards = f"{model.gpu_class} cards" if model.gpu_class else "cards"
            downtime = (
                f"{model.name} will be unavailable for its load time: no free {cards} to start "
                "the new replica first"
            )
        return self._action(
            model, old, result, index=old.replica, port=port, reason=why, surge=False, downtime=downtime
        )

    def _action(
        self,
        model: Model,
        old: Running,
        placed: PlacedReplica,
        *,
        index: int,
        port: int,
        reason: str,
        surge: bool,
        downtime: str = "",
    ) -> Action:
        self.taken[model.name].add(index)
        self.successors.append(placed)
        self.warnings += placed.warnings
        writes = _units(self.spec, self.facts, model, placed, index=index, port=port)
        written = {(w.node, w.name) for w in writes}
        stale = tuple((n, old.unit) for n in old.members if (n, old.unit) not in written)
        return Action(
            op="~",
            model=model.name,
            replica=index,
            nodes=tuple(s.node for s in placed.slots),
            write=writes,
            remove=stale,
            port=port,
            reason=reason,
            gpus={s.node: s.uuids for s in placed.slots},
            retire=Retired(replica=old.replica, nodes=old.members, unit=old.unit, port=old.port),
            surge=surge,
            downtime=downtime,
            unhealthy=old.describe() if old.down else "",
        )


def unpinned_warnings(spec: ClusterSpec) -> list[str]:
    """One line per model whose URL source pins no sha256: its file is then checked only
    against what the node that downloaded it (the seed) received from the origin."""
    return [
        f"{m.name}: {m.source} has no sha256: the copies between nodes are checked only against "
        "what the seed node downloaded, not against a known file; pin it with `sha256: <hex>` "
        "beside the model's source"
        for m in spec.models
        if m.source_kind is SourceKind.url and not m.sha256
    ]


def _cause(spec: ClusterSpec, model: Model, old: Running, facts: dict[str, NodeFacts]) -> str:
    if old.spec_hash != spec_hash(spec, model):
        return "spec changed"
    if old.down:
        return f"{old.describe()}; started again"
    faults = held_faults(old, facts)
    return f"on a faulty card ({'; '.join(faults)})" if faults else "replace requested"


def _ports(port: int, members: tuple[str, ...]) -> set[int]:
    """The ports a replica listens on at its head node (see ``_port_count``)."""
    return {port, port + 1} if len(members) > 1 else {port}


def _port_count(model: Model) -> int:
    """Ports a replica takes on its head node: the API, and the rendezvous of a multi-node one."""
    return 2 if model.nodes > 1 else 1


def successor_first(grown: Action, old: Running, reason: str) -> Action:
    """The ``~`` that replaces ``old`` by ``grown`` (a ``+`` of ``grow_plan``, on cards and
    a port of its own) successor first: ``old`` is drained and stopped once its successor
    is ready (the gateway's restart of a replica failing its health check)."""
    return grown.model_copy(
        update={
            "op": "~",
            "reason": reason,
            "retire": Retired(replica=old.replica, nodes=old.members, unit=old.unit, port=old.port),
            "surge": True,
        }
    )
