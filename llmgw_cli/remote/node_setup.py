"""The step of ``apply`` that gives the gateways their own, restricted way into the nodes:
a key pair on every gateway host (``gateway.all_hosts``), then the node helper, its
account, its sudo rule and one restricted ``authorized_keys`` line per gateway host on
every reachable node that lacks them (``node_access.py``). The operator's key stays on
the operator's machine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.observe.facts import NodeFacts
from llmgw_cli.errors import NodeError
from llmgw_cli.progress import Phase, Report
from llmgw_cli.remote import node_access
from llmgw_cli.remote.connect import Connections
from llmgw_cli.remote.execute import Outcome
from llmgw_cli.remote.gateway_install import gateway_public_key, gateway_public_keys, host_subject


async def stale_nodes(
    spec: ClusterSpec, conns: Connections, nodes: list[str], facts: Mapping[str, NodeFacts] | None = None
) -> list[str]:
    """The nodes (of ``nodes``) that ``prepare`` would change, from the probe's ``facts``
    where it read them; changes nothing."""
    try:
        found = await gateway_public_keys(spec, conns, create=False)
    except NodeError:
        found = {}
    keys = [key for key, _ in found.values() if key is not None]
    if spec.gateway.install and len(keys) < len(spec.gateway.all_hosts):
        return list(nodes)  # a host's key is made first: every node gets its line
    return await node_access.check(spec, conns, nodes, keys, facts)


async def prepare(
    spec: ClusterSpec,
    conns: Connections,
    nodes: list[str],
    report: Report,
    facts: Mapping[str, NodeFacts] | None = None,
) -> list[Outcome]:
    """Make each gateway host's key (when missing), then bring the helper and every host's
    key line to the stale nodes (judged from the probe's ``facts`` where it read them).
    When a host's key cannot be made or read, the nodes are left as they are: writing the
    others' keys alone would lock that host's running gateway out."""

    async def one(host: str) -> tuple[str | None, str] | NodeError:
        try:
            return await gateway_public_key(spec, conns, create=True, host=host)
        except NodeError as exc:
            return exc

    hosts = spec.gateway.all_hosts
    outcomes: list[Outcome] = []
    keys: list[str] = []
    for host, found in zip(hosts, await asyncio.gather(*(one(h) for h in hosts)), strict=True):
        who = host_subject(spec, host)
        if isinstance(found, NodeError):
            report(who, f"failed: {found.reason}", Phase.failed)
            outcomes.append(Outcome(who, False, found.reason))
            continue
        public_key, path = found
        if public_key is not None:
            keys.append(public_key)
            report(who, f"its SSH key: {path} on {host}", Phase.done)
    if outcomes:
        return outcomes
    stale = await node_access.check(spec, conns, nodes, keys, facts)
    return await node_access.install(spec, conns, stale, keys, report) if stale else []
