"""The host steps of a plan: everything ``apply`` changes beside the replicas.

A ``Plan`` (``core/planning/plan.py``) lists its replica ``Action``s and these steps, so that
``plan`` shows the whole change and ``plan --out`` saves it. Each step names its kind,
its target (a node or a gateway host), what it does there, why, and the steps it waits
on (``depends``, by ``HostStep.id``). The kinds, in the order apply carries them out:

- ``node_helper`` (node, ``install`` or ``update``): the helper the gateway reaches the
  node through, and the gateway hosts' SSH key lines; first, as everything after goes
  through it;
- ``engine_key`` (node, ``write`` or ``rotate``): the key the node's engines check. The
  models' secret environment files are written beside it on every node each time (their
  text comes from the cluster file alone, which the plan's cluster digest covers), so
  they are no step of their own;
- ``weights`` (node, ``fetch`` or ``check``; ``detail``: the model, its source and the
  pinned revision): what a replica the plan starts needs on its nodes;
- ``gateway`` (host, how the running gateway takes its new files: ``reload``,
  ``handover``, ``restart``; ``none`` when nothing changes, ``skip`` when nothing is
  installed there; ``detail``: the files written), after the engine keys, whose map it
  is given.

Apply never migrates the store: the SQLite store migrates itself when the gateway opens
it, and a PostgreSQL store is migrated by ``llmgw store migrate``; so no step kind does.

A replica started on node N depends on N's ``node_helper``, ``engine_key`` and
``weights`` steps (``needs``).
"""

from __future__ import annotations

from typing import Literal

from llmgw_cli.core.observe.facts import Fact

StepKind = Literal["node_helper", "engine_key", "weights", "gateway"]
KINDS: tuple[StepKind, ...] = ("node_helper", "engine_key", "weights", "gateway")
QUIET = ("none", "skip")  # gateway steps that change nothing; shown, never carried out


class HostStep(Fact):
    kind: StepKind
    target: str  # the node, or the gateway host
    action: str
    reason: str
    detail: tuple[str, ...] = ()
    depends: tuple[str, ...] = ()  # ids of the steps it waits on

    @property
    def id(self) -> str:
        """``kind:target``, and the model for a weights step (one per model and node)."""
        tail = f":{self.detail[0]}" if self.kind == "weights" and self.detail else ""
        return f"{self.kind}:{self.target}{tail}"

    @property
    def changes(self) -> bool:
        return self.action not in QUIET


class GatewayState(Fact):
    """What the shell read on a gateway host: how installing would change it (``how``:
    ``none``, ``reload``, ``handover``, ``restart``, or ``skip`` when nothing is installed
    there), the files it would write (path, the state they must show), and the line that
    says so."""

    host: str
    how: str
    files: tuple[tuple[str, str], ...] = ()
    said: str = ""


class HostFacts(Fact):
    """What the shell gathered beside the node probe, from which the host steps come: the
    nodes whose helper is missing or out of date (``helper_missing``: those of them with
    none at all, where it can tell), the nodes without an engine key, whether every key
    is rotated, and each gateway host's state."""

    stale_helper: tuple[str, ...] = ()
    helper_missing: tuple[str, ...] = ()
    keyless: tuple[str, ...] = ()
    rotate: tuple[str, ...] = ()  # the reachable nodes, with --rotate-engine-key
    gateways: tuple[GatewayState, ...] = ()


def needs(steps: tuple[HostStep, ...], nodes: tuple[str, ...], model: str) -> tuple[str, ...]:
    """The ids of the steps a replica of ``model`` on ``nodes`` waits on."""
    return tuple(
        s.id
        for s in steps
        if s.target in nodes
        and s.changes
        and (s.kind in ("node_helper", "engine_key") or (s.kind == "weights" and s.detail[:1] == (model,)))
    )


def host_lines(steps: tuple[HostStep, ...]) -> list[tuple[str, bool]]:
    """What ``plan`` and ``apply`` print of the host steps, each line with whether it
    changes something: one line per gateway host, then one per other kind and action
    naming its nodes (``node helper: install or update on a, b``), then one per model
    whose weights are brought."""
    lines = [(s.reason, s.changes) for s in steps if s.kind == "gateway"]
    helper = [s.target for s in steps if s.kind == "node_helper"]
    if helper:
        lines.append((f"node helper: install or update on {', '.join(helper)}", True))
    for verb in ("rotate", "write"):
        keyed = [s.target for s in steps if s.kind == "engine_key" and s.action == verb]
        if keyed:
            # a rotation renews every reachable node's key
            where = "every node" if verb == "rotate" else ", ".join(keyed)
            lines.append((f"engine key: {verb} on {where}", True))
    models: dict[tuple[str, ...], list[str]] = {}
    for s in steps:
        if s.kind == "weights":
            models.setdefault((s.action, *s.detail), []).append(s.target)
    for (verb, model, *rest), nodes in models.items():
        source = " ".join(rest)
        lines.append((f"weights of {model}: {verb} {source} on {', '.join(nodes)}", True))
    return lines
