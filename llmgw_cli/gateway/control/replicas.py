"""The controller's replicas on the nodes: the ``Nodes`` seam, and the controller's seams
of the one executor (``remote/executor.py``) over it.

``Nodes`` is what the controller does to the nodes (the probe, the weights fetch, the
writes of ``remote/execute.py``, the watch of a unit); ``RemoteNodes`` over SSH, a fake
in the unit tests. ``StartSteps`` and ``StopSteps`` are the executor's ``Steps`` for one
start and one stop of the controller, ``PoolRouting`` its ``Routing``: what this process
routes is its own pool, so a ready replica is routed and one out of the pool is drained.
The order of the steps is the executor's; the controller's records are kept by the hooks
it gives these.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol

from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.observe.facts import NodeFacts
from llmgw_cli.core.planning.plan import Action, Plan, Retired
from llmgw_cli.core.serving.routing import Pool
from llmgw_cli.errors import StartFailed
from llmgw_cli.gateway.control.sources import ProbeSource
from llmgw_cli.progress import Report
from llmgw_cli.remote.cluster_lock import Hold
from llmgw_cli.remote.execute import Outcome, UnitWatch, execute
from llmgw_cli.remote.executor import Drained, one_plan, subject
from llmgw_cli.remote.nodeops import NodeOps
from llmgw_cli.remote.weights import ensure_for_plan


class UnitFailure(Protocol):
    async def failure(self) -> str | None:
        """Why the watched unit failed (with its journal's last lines), or None."""
        ...


class Nodes(Protocol):
    """What the controller does to the nodes."""

    @property
    def facts(self) -> dict[str, NodeFacts]:
        """The last probe's facts (discovery probes every round)."""
        ...

    async def probe(self, spec: ClusterSpec) -> dict[str, NodeFacts]: ...

    async def fetch(self, spec: ClusterSpec, plan: Plan, report: Report) -> dict[str, str]:
        """Bring the weights of ``plan``'s starts: node -> why they could not be brought."""
        ...

    async def execute(
        self, spec: ClusterSpec, plan: Plan, report: Report, *, fetch: bool = False
    ) -> list[Outcome]:
        """Write, start or stop the plan's units; no readiness wait. ``fetch``: bring the
        weights first (a start brings them itself, outside the lock, before this)."""
        ...

    async def watch(self, spec: ClusterSpec, action: Action, since: str = "") -> UnitFailure:
        """Begin watching the head unit of a replica just started (``since``: the head
        node's clock before the start, ``Outcome.since``)."""
        ...


class RemoteNodes:
    """The nodes over SSH, through the connections discovery holds."""

    def __init__(self, source: ProbeSource) -> None:
        self.source = source

    @property
    def facts(self) -> dict[str, NodeFacts]:
        return self.source.facts

    async def probe(self, spec: ClusterSpec) -> dict[str, NodeFacts]:
        # Nodes the last probe could not read are not waited on again: discovery's rounds
        # see them come back.
        return await self.source.probe(spec, skip_lost=True)

    async def fetch(self, spec: ClusterSpec, plan: Plan, report: Report) -> dict[str, str]:
        # One progress text per model (what a waiting client reads): its least advanced node.
        conns = await self.source.connections(spec)
        return await ensure_for_plan(spec, plan, conns, report, by_model=True)

    async def execute(
        self, spec: ClusterSpec, plan: Plan, report: Report, *, fetch: bool = False
    ) -> list[Outcome]:
        conns = await self.source.connections(spec)
        return await execute(spec, conns, plan, report, wait=False, fetch=fetch)

    async def watch(self, spec: ClusterSpec, action: Action, since: str = "") -> UnitFailure:
        head = action.nodes[0]
        unit = next(w.name for w in action.write if w.node == head)
        conns = await self.source.connections(spec)
        return await UnitWatch.start(NodeOps(conns.to(head)), unit, since)


# --- the controller's seams of the executor ----------------------------------------------


@dataclass
class StartSteps:
    """One start's ``Steps``: the controller's lock; the weights of the plan it was placed
    by, outside the lock; under it, ``place`` (where it goes now: placed again when its
    cards or port were taken meanwhile, the start recorded), the units written and
    ``written`` (the replica in the pool, loading); outside it, ``watch`` until ready.
    The hooks raise ``StartFailed`` when the start cannot go on. ``stop``: where the
    replica a successor replaces is stopped (its ``-``)."""

    spec: ClusterSpec
    nodes: Nodes
    lock: Hold
    plan: Plan
    place: Callable[[Action], Awaitable[Action]]
    written: Callable[[Action, list[Outcome]], Awaitable[None]]
    watch: Callable[[Action], Awaitable[None]]
    stop: StopSteps | None = None
    moved: bool = False  # placed again under the lock: its weights come with the write

    def locked(self, why: str) -> AbstractAsyncContextManager[None]:
        return self.lock.hold(why)

    async def weights(self, action: Action, report: Report) -> str | None:
        missing = await self.nodes.fetch(self.spec, self.plan, report)
        if missing:
            raise StartFailed("; ".join(f"{node}: {why}" for node, why in sorted(missing.items())))
        return None

    async def placed(self, action: Action) -> Action | str:
        found = await self.place(action)
        self.moved = found is not action
        return found

    async def write(self, actions: Sequence[Action], report: Report) -> list[Outcome]:
        (action,) = actions
        if action.op == "-" and self.stop is not None:
            return await self.stop.write(actions, report)
        plan = self.plan.model_copy(update={"actions": (action,)})
        outcomes = await self.nodes.execute(self.spec, plan, report, fetch=self.moved)
        await self.written(action, outcomes)
        return outcomes

    async def ready(self, actions: Sequence[Action], done: list[Outcome], report: Report) -> list[Outcome]:
        (action,) = actions
        await self.watch(action)
        return [Outcome(subject(action.model, action.replica), True, "ready")]


@dataclass
class StopSteps:
    """One stop's ``Steps``: the controller holds its lock already (over the probe that
    found the replica), so it is not taken again; ``before`` records the stop once the
    replica is out of rotation; the nodes are probed again after its units went."""

    spec: ClusterSpec
    nodes: Nodes
    before: Callable[[], None]

    def locked(self, why: str) -> AbstractAsyncContextManager[None]:
        return contextlib.nullcontext()

    async def weights(self, action: Action, report: Report) -> str | None:
        return None

    async def placed(self, action: Action) -> Action | str:
        return action

    async def write(self, actions: Sequence[Action], report: Report) -> list[Outcome]:
        self.before()
        outcomes = await self.nodes.execute(self.spec, one_plan(actions), report)
        await self.nodes.probe(self.spec)
        return outcomes

    async def ready(self, actions: Sequence[Action], done: list[Outcome], report: Report) -> list[Outcome]:
        return []


@dataclass
class PoolRouting:
    """The controller's ``Routing``: its pool. A replica is out of rotation once out of
    the pool, unless a request is in flight on it and ``force`` is not given (it is put
    back then); nothing is left to drain after that (no request was in flight, or the
    stop is forced)."""

    pool: Pool
    address: str
    force: bool

    async def routed(self, action: Action, report: Report) -> list[Outcome]:
        return []  # a replica the controller saw ready is in its pool: routed

    async def mark(self, model: str, old: Retired) -> str | None:
        replica = self.pool.remove(model, self.address)
        if replica is not None and replica.outstanding and not self.force:
            self.pool.replicas.setdefault(model, {})[self.address] = replica
            return "a request is in flight on it"
        return None

    async def drained(self, model: str, old: Retired, report: Report) -> Drained:
        return Drained(0, 0.0)
