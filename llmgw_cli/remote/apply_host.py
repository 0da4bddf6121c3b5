"""apply's seam of the executor for a whole plan (``remote/executor.py``'s ``HostWork``):
how each kind of host step, and the plan's replica changes, are carried out over SSH.

The executor calls these in the order of the step kinds; this module only says how:
the node helper (``remote/node_setup.py``), the engine keys (``remote/engine_keys.py``),
the replica changes (``remote/rollout.py``'s ``carry_out``, through the same executor),
the gateway hosts (``remote/gateway_install.py``) and a key rotation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.observe.facts import NodeFacts
from llmgw_cli.core.planning.plan import Plan
from llmgw_cli.core.planning.steps import HostStep
from llmgw_cli.progress import Report
from llmgw_cli.remote.cluster_lock import ApplyHold, LockTerms
from llmgw_cli.remote.connect import Connections
from llmgw_cli.remote.engine_keys import distribute_engine_keys, rotate_engine_keys
from llmgw_cli.remote.execute import Outcome
from llmgw_cli.remote.gateway_install import GatewayPreviews, install
from llmgw_cli.remote.node_setup import prepare
from llmgw_cli.remote.rollout import carry_out

if TYPE_CHECKING:
    from llmgw_cli.remote.executor import Executor


@dataclass(kw_only=True)
class ApplyHost:
    """apply's ``HostWork`` for ``plan``. ``fetched``: the plan's weights were brought
    before the lock (node -> why they could not be; None: each start brings its own).
    ``lock``: the cluster lock apply holds, released once the plan's plain starts are
    written. ``keys``: every reachable node's engine key, once the engine key step ran
    (the units and the gateways are given them)."""

    spec: ClusterSpec
    conns: Connections
    plan: Plan
    gateway: GatewayPreviews
    facts: dict[str, NodeFacts]
    reachable: list[str]
    take_lock: LockTerms | None
    lock: ApplyHold | None
    fetched: dict[str, str] | None
    wait: bool
    allow_downtime: bool
    keys: dict[str, str] = field(default_factory=dict)
    cordoned: frozenset[str] = frozenset()  # nodes a key rotation's successors avoid

    async def helpers(self, steps: Sequence[HostStep], report: Report) -> list[Outcome]:
        # the gateway's key and the node helper first: the units go through it
        return await prepare(self.spec, self.conns, [s.target for s in steps], report, self.facts)

    async def engine_keys(self, steps: Sequence[HostStep], report: Report) -> list[Outcome]:
        # Every reachable node, not only those the steps write a key to: each one's key is
        # read for the units and the gateways, and the models' secret environment files
        # go everywhere (the gateway starts on-demand replicas anywhere and never writes
        # keys or secrets itself). A node with a key keeps it.
        transports = [self.conns.to(name) for name in self.reachable]
        keys, failed = await distribute_engine_keys(self.spec, transports, report)
        self.keys.update(keys)
        return failed

    async def replicas(self, executor: Executor) -> list[Outcome]:
        fetched = self.fetched or {}
        outcomes = [Outcome(node, False, why) for node, why in sorted(fetched.items())]
        return outcomes + await carry_out(
            self.spec,
            self.conns,
            self.plan if self.fetched is None else without(self.plan, fetched),
            executor.report,
            facts=self.facts,
            lock=self.lock,
            take_lock=self.take_lock,
            engine_keys=self.keys,
            fetch=self.fetched is None,
            wait=self.wait,
            executor=executor,
        )

    async def gateways(self, steps: Sequence[HostStep], report: Report) -> list[Outcome]:
        hosts = {s.target for s in steps}
        previews = GatewayPreviews(tuple(p for p in self.gateway.hosts if p.host in hosts))
        return await install(self.spec, self.conns, previews, {n: (k,) for n, k in self.keys.items()}, report)

    async def rotate(self, steps: Sequence[HostStep], report: Report) -> list[Outcome]:
        """New engine keys on the nodes ``steps`` name, every installed gateway holding
        both keys meanwhile (``remote/engine_keys.py`` says how no request is lost)."""
        # The gateways' files were installed just before: only their key maps change now.
        settled = self.gateway.settled()

        async def give_gateway(keys: dict[str, tuple[str, ...]]) -> Outcome:
            given = await install(self.spec, self.conns, settled, keys, report)
            failed = [o for o in given if not o.ok]
            if len(given) == 1:
                return given[0]
            if not failed:
                return Outcome("gateway", True, "every gateway host has the keys")
            return Outcome("gateway", False, "; ".join(f"{o.subject}: {o.message}" for o in failed))

        return await rotate_engine_keys(
            self.spec,
            self.conns,
            self.facts,
            give_gateway,
            report,
            transports={s.target: self.conns.to(s.target) for s in steps},
            take_lock=self.take_lock,
            allow_downtime=self.allow_downtime,
            cordoned=self.cordoned,
        )


def without(plan: Plan, failed: dict[str, str]) -> Plan:
    """``plan`` without the starts on nodes whose weights could not be brought."""
    kept = tuple(a for a in plan.actions if not (a.write and set(a.nodes) & failed.keys()))
    return plan.model_copy(update={"actions": kept})
