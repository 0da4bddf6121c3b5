"""What a probe cannot say about a replica's health (``core/observe/health.py``), asked of its
nodes by ``plan``, ``apply`` and ``status``: whether a replica that runs answers its
health check, and the last line of the journal of one that is not ready.

Both are read as the operator (root on the node); a node that does not answer leaves
the replica's entry out: the state is then decided from systemd's facts alone."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.observe.facts import NodeFacts
from llmgw_cli.core.observe.health import ReplicaState, telling_line
from llmgw_cli.core.planning.plan import Answers, Running, running_replicas
from llmgw_cli.errors import NodeError
from llmgw_cli.remote.connect import Connections
from llmgw_cli.remote.execute import metrics_page, read_engine_key, ready_status, redact_keys
from llmgw_cli.remote.nodeops import NodeOps

Key = tuple[str, int]  # (model, replica)
JOURNAL_LINES = 30  # read of a replica's journal for the line that says why (``telling_line``)


async def health_answers(spec: ClusterSpec, conns: Connections, facts: dict[str, NodeFacts]) -> Answers:
    """(model, replica) -> whether its health check answers ready, for every replica that
    systemd's facts alone call starting (younger than its start timeout): the others are
    decided without it. Asked on the head node itself, as ``apply`` waits: the engines'
    firewall lets in only their nodes."""
    models = {m.name: m for m in spec.models}
    running = [
        r
        for r in running_replicas(facts)
        if r.health() is ReplicaState.starting and r.model in models and r.members[0] in facts
    ]

    async def one(r: Running) -> tuple[Key, bool | None]:
        readiness = spec.profiles[models[r.model].profile].readiness
        node = spec.node(r.members[0])
        try:
            status = await ready_status(conns.to(node), node.engine_host, r.port, readiness.path)
        except NodeError:
            return (r.model, r.replica), None
        return (r.model, r.replica), status == 200

    found = await asyncio.gather(*(one(r) for r in running))
    return {key: ready for key, ready in found if ready is not None}


async def engine_pages(spec: ClusterSpec, conns: Connections, replicas: Iterable[Running]) -> dict[Key, str]:
    """(model, replica) -> the /metrics page its engine serves, asked on its head node with
    that node's engine key (the engines' firewall lets in only the nodes); left out where
    the node or the engine did not answer."""
    chosen = [r for r in replicas if r.members]
    heads = sorted({r.members[0] for r in chosen})
    found_keys = await asyncio.gather(*(read_engine_key(conns.to(spec.node(n))) for n in heads))
    keys = dict(zip(heads, found_keys, strict=True))

    async def one(r: Running) -> tuple[Key, str | None]:
        node = spec.node(r.members[0])
        try:
            page = await metrics_page(conns.to(node), node.engine_host, r.port, keys[node.name])
        except NodeError:
            page = None
        return (r.model, r.replica), page

    found = await asyncio.gather(*(one(r) for r in chosen))
    return {key: page for key, page in found if page is not None}


async def last_lines(conns: Connections, replicas: Iterable[Running]) -> dict[Key, str]:
    """(model, replica) -> the line of its worst member's journal that says why it is not
    ready (``core/health.telling_line``; engine keys replaced), for each of
    ``replicas``; left out where the journal could not be read."""

    async def one(r: Running) -> tuple[Key, str]:
        node = next((n for n in r.members if n in r.units and not r.units[n].up), r.members[0])
        try:
            t = conns.to(node)
            tail = await NodeOps(t).journal(r.unit, "-", JOURNAL_LINES)
            key = await read_engine_key(t)
        except NodeError:
            return (r.model, r.replica), ""
        return (r.model, r.replica), telling_line(redact_keys(tail, [key] if key else []))

    found = await asyncio.gather(*(one(r) for r in replicas))
    return {key: line for key, line in found if line}
