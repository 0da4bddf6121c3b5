"""Readings of the replicas the probe found, for the gateway's controller: the state of
a replica's units, which replica serves at an address, why a model cannot be started, the
label of a start. Pure: facts and the cluster file in, values out."""

from __future__ import annotations

from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.observe.facts import NodeFacts
from llmgw_cli.core.observe.health import ReplicaState
from llmgw_cli.core.planning.controller import Start, UnitCondition
from llmgw_cli.core.planning.plan import Plan, Running, held_faults, running_replicas
from llmgw_cli.core.serving.routing import serving_address
from llmgw_cli.core.weights.pins import needs_pin


def unpinned(spec: ClusterSpec, model: str) -> str:
    """Why ``model`` cannot be started by the gateway: a repository llmgw fetches whose
    revision no pin resolves (no pins file beside the cluster file, or none for its source
    as written now). The gateway never asks the Hub itself: the commit is apply's to
    choose. "" when it can be started."""
    m = spec.model(model)
    if not needs_pin(m):
        return ""
    return (
        f"{m.source} is not resolved to a commit: run `llmgw apply`, which pins it "
        "(the gateway starts a fetched repository only at the commit apply chose)"
    )


def systemd_restarts(r: Running) -> int:
    return sum(u.state.n_restarts for u in r.units.values() if u.state is not None)


def _restarting(r: Running) -> bool:
    """Its engine died and systemd is bringing it back: a unit on its way down after its
    engine exited (a real engine's worker processes take seconds to go), or waiting out
    its restart pause."""
    return any(
        u.state is not None
        and (u.state.active_state == "deactivating" or u.state.sub_state.startswith("auto-restart"))
        for u in r.units.values()
    )


def unit_condition(
    r: Running, facts: dict[str, NodeFacts], unreachable: set[str], *, served: bool = False
) -> UnitCondition:
    """The replica's units as the last probe saw them. ``served``: this gateway saw it
    ready. An engine that served and then died is systemd's to restart (the unit's
    StartLimitBurst bounds that): a crash loop is an engine that dies before it serves.
    A replica whose units are up on a card the probe finds faulty is ``faulty_card``
    (``held_faults``): its engine may still answer, but the card is out."""
    if any(n in unreachable or n not in facts for n in r.members):
        return UnitCondition.lost
    if any(n in r.units and r.units[n].active_state == "failed" for n in r.members):
        return UnitCondition.gave_up
    if served and _restarting(r):
        up = UnitCondition.up
    elif r.health() is ReplicaState.crash_looping:
        return UnitCondition.crash_looping
    else:
        up = UnitCondition.up if r.up else UnitCondition.down
    return UnitCondition.faulty_card if up is UnitCondition.up and held_faults(r, facts) else up


def replica_at(spec: ClusterSpec, facts: dict[str, NodeFacts], model: str, address: str) -> Running | None:
    """The replica of ``model`` serving at ``address`` on the nodes, if any."""
    nodes = {n.name: n for n in spec.nodes}
    for r in running_replicas(facts):
        if r.model != model or not r.members or r.members[0] not in nodes:
            continue
        if serving_address(nodes[r.members[0]].engine_host, r.port) == address:
            return r
    return None


def replica_found(facts: dict[str, NodeFacts], model: str, replica: int) -> Running | None:
    return next((r for r in running_replicas(facts) if (r.model, r.replica) == (model, replica)), None)


def unplaced_text(plan: Plan) -> str:
    return "; ".join(r for _, r in plan.unplaced) or "no room"


def start_label(start: Start) -> str:
    """A bounded label for the metric from a start's reason."""
    reason = start.reason.lower()
    if start.avoid:
        return "gave-up"
    if reason == "requested":
        return "requested"
    for prefix, label in (("scale out", "scale-out"), ("restart", "unhealthy")):
        if reason.startswith(prefix):
            return label
    for word, label in (("lost", "node-lost"), ("not running", "down"), ("below min", "below-min")):
        if word in reason:
            return label
    return "other"
