"""The whole plan: the replica actions of ``make_plan`` with the host steps
(``core/planning/steps.py``) and the digests a saved plan is checked against.

A saved plan (``plan --out``, format ``PLAN_FORMAT``) carries three digests:

- ``cluster_digest``: of the cluster file as parsed (its canonical form, as the plan was
  made from it, not its bytes: a comment or an indentation edit changes nothing apply
  does, so it does not invalidate a plan); with one digest per model, node, profile and
  the rest (``cluster_parts``), so a refusal names what differs;
- ``facts_digest``: of the nodes' facts the replica actions come from
  (``core/planning/plan.py``), with one per node (``node_digests``);
- ``host_digest``: of what the shell read beside them (``HostFacts``: stale helpers,
  nodes without a key, each gateway host's files), from which the host steps come.

``apply PLAN`` carries the plan out when all three still hold. When the cluster file
differs it refuses. When the facts differ but a plan made now changes nothing (every
step of the saved one is done: it was applied already), there is nothing to do; else it
refuses, naming the nodes and steps that differ.
"""

from __future__ import annotations

from collections.abc import Mapping

from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.observe.facts import NodeFacts
from llmgw_cli.core.planning.plan import Plan, digest, facts_digest
from llmgw_cli.core.planning.steps import HostFacts, HostStep, needs
from llmgw_cli.core.serving.redact import redact
from llmgw_cli.core.weights.fetch import plan_weights

PLAN_FORMAT = 2
"""The saved plan's layout: 2 lists host steps and the cluster and host digests (a plan
without ``format`` is 1, from before them)."""


def cluster_parts(spec: ClusterSpec) -> dict[str, str]:
    """A digest per model, node and profile of the parsed cluster file, and one of the
    rest (``cluster``): what a refusal can name."""
    data = spec.model_dump(mode="json")
    parts: dict[str, str] = {}
    for key, label in (("models", "model"), ("nodes", "node")):
        for item in data.pop(key, []):
            parts[f"{label} {item['name']}"] = digest(item)
    for name, profile in data.pop("profiles", {}).items():
        parts[f"profile {name}"] = digest(profile)
    parts["cluster"] = digest(data)
    return parts


def changed_parts(then: Mapping[str, str], now: Mapping[str, str]) -> list[str]:
    """The parts (``model m``, ``node n``, ...) added, removed or changed."""
    return sorted(k for k in then.keys() | now.keys() if then.get(k) != now.get(k))


def node_digests(facts: dict[str, NodeFacts]) -> dict[str, str]:
    return {name: facts_digest({name: f}) for name, f in facts.items()}


def host_digest(host: HostFacts) -> str:
    return digest(host.model_dump(mode="json"))


def host_steps(spec: ClusterSpec, plan: Plan, host: HostFacts) -> tuple[HostStep, ...]:
    """Every step apply takes beside the replica actions of ``plan``, from ``host``."""
    missing = set(host.helper_missing)
    steps = [
        HostStep(
            kind="node_helper",
            target=node,
            action="install" if node in missing else "update",
            reason="no node helper yet" if node in missing else "node helper or key lines out of date",
        )
        for node in host.stale_helper
    ]
    rotate = set(host.rotate)
    for node in dict.fromkeys((*host.keyless, *host.rotate)):
        why = "--rotate-engine-key" if node in rotate else "no engine key yet"
        steps.append(
            HostStep(
                kind="engine_key", target=node, action="rotate" if node in rotate else "write", reason=why
            )
        )
    steps += _weights(spec, plan)
    keyed = tuple(s.id for s in steps if s.kind == "engine_key")
    steps += [
        HostStep(
            kind="gateway",
            target=g.host,
            action=g.how,
            reason=g.said,
            detail=tuple(path for path, _ in g.files),
            depends=keyed if g.how not in ("none", "skip") else (),
        )
        for g in host.gateways
    ]
    return tuple(steps)


def remade(spec: ClusterSpec, plan: Plan, first: Plan) -> Plan:
    """``plan``, made again under the cluster lock from a new probe, carrying the host
    steps of ``first`` (what the shell gathered of helpers, keys and gateway hosts holds
    still: the lock guards the replicas only), with the weights steps of its own actions."""
    kept = [s for s in first.steps if s.kind != "weights"]
    weights = _weights(spec, plan)
    at = next((i for i, s in enumerate(kept) if s.kind == "gateway"), len(kept))
    return plan.model_copy(update={"steps": (*kept[:at], *weights, *kept[at:])})


def _weights(spec: ClusterSpec, plan: Plan) -> list[HostStep]:
    need = plan_weights(spec, plan)
    commits = dict(plan.commits)
    steps = []
    for verb, found in (("fetch", need.files), ("fetch", need.repos), ("check", need.paths)):
        for model, nodes in sorted(found.items()):
            source = redact(spec.model(model).source)
            pinned = (f"at {commits[model]}",) if model in commits else ()
            why = "its replicas start there" if verb == "fetch" else "its path must hold the weights"
            for node in nodes:
                detail = (model, source, *pinned)
                steps.append(HostStep(kind="weights", target=node, action=verb, reason=why, detail=detail))
    return steps


def whole(
    spec: ClusterSpec,
    plan: Plan,
    facts: dict[str, NodeFacts],
    host: HostFacts,
    *,
    written: ClusterSpec | None = None,
) -> Plan:
    """``plan`` (its replica actions, made from ``facts`` and ``spec``) as the whole
    change: its host steps and the digests a saved copy is checked against. ``written``:
    the cluster file as written, before its revisions were resolved to commits (the
    plan's ``commits`` are checked on their own, and say which repository moved);
    default ``spec``."""
    parts = cluster_parts(written or spec)
    return plan.model_copy(
        update={
            "format": PLAN_FORMAT,
            "steps": host_steps(spec, plan, host),
            "cluster_parts": parts,
            "cluster_digest": digest(parts),
            "node_digests": node_digests(facts),
            "host_digest": host_digest(host),
        }
    )


def action_needs(plan: Plan) -> dict[tuple[str, int], tuple[str, ...]]:
    """(model, replica) of each action that starts units -> the host steps it waits on."""
    return {(a.model, a.replica): needs(plan.steps, a.nodes, a.model) for a in plan.changes if a.write}


def has_work(plan: Plan) -> bool:
    """Carrying ``plan`` out changes something."""
    return bool(plan.changes) or any(s.changes for s in plan.steps)


def saved_refusal(saved: Plan, spec: ClusterSpec) -> str | None:
    """Why a saved plan cannot be carried out against the cluster file ``spec`` (its
    format, or the file changed since), or None."""
    if saved.format != PLAN_FORMAT:
        return (
            f"this plan has format {saved.format}, this llmgw reads format {PLAN_FORMAT}; "
            "run `llmgw plan --out` again"
        )
    now = cluster_parts(spec)
    if saved.cluster_digest == digest(now):
        return None
    what = ", ".join(changed_parts(saved.cluster_parts, now)) or (
        f"digest {saved.cluster_digest}, now {digest(now)}"
    )
    return f"the cluster file changed since this plan was made ({what}); run `llmgw plan` again"


def what_changed(saved: Plan, now: Plan) -> str:
    """The nodes whose facts and the host steps that differ between ``saved`` and a plan
    made ``now`` from the same cluster file, in a few words."""
    nodes = changed_parts(saved.node_digests, now.node_digests)
    said = [f"facts of {', '.join(nodes)}"] if nodes else []
    steps = {s.id for s in saved.steps if s.changes} ^ {s.id for s in now.steps if s.changes}
    if steps:
        said.append(f"steps {', '.join(sorted(steps))}")
    return "; ".join(said)
