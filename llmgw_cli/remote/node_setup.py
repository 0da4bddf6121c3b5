"""The step of ``apply`` that gives the gateway its own, restricted way into the nodes:
the gateway's key pair on the gateway host, then the node helper, its account, its sudo
rule and the key's restricted ``authorized_keys`` line on every reachable node that
lacks them (``node_access.py``). The operator's key stays on the operator's machine.
"""

from __future__ import annotations

from collections.abc import Mapping

from llmgw_cli.core.facts import NodeFacts
from llmgw_cli.core.spec import ClusterSpec
from llmgw_cli.errors import NodeError
from llmgw_cli.progress import Report
from llmgw_cli.remote import node_access
from llmgw_cli.remote.connect import Connections
from llmgw_cli.remote.execute import Outcome
from llmgw_cli.remote.gateway_install import SUBJECT, gateway_public_key


async def stale_nodes(
    spec: ClusterSpec, conns: Connections, nodes: list[str], facts: Mapping[str, NodeFacts] | None = None
) -> list[str]:
    """The nodes (of ``nodes``) that ``prepare`` would change, from the probe's ``facts``
    where it read them; changes nothing."""
    try:
        public_key, _ = await gateway_public_key(spec, conns, create=False)
    except NodeError:
        public_key = None
    if spec.gateway.install and public_key is None:
        return list(nodes)  # the key is made first: every node gets its line
    return await node_access.check(spec, conns, nodes, public_key, facts)


async def prepare(
    spec: ClusterSpec,
    conns: Connections,
    nodes: list[str],
    report: Report,
    facts: Mapping[str, NodeFacts] | None = None,
) -> list[Outcome]:
    """Make the gateway's key (when missing), then bring the helper to the stale nodes
    (judged from the probe's ``facts`` where it read them)."""
    try:
        public_key, path = await gateway_public_key(spec, conns, create=True)
    except NodeError as exc:
        report(SUBJECT, f"failed: {exc.reason}")
        return [Outcome(SUBJECT, False, exc.reason)]
    if public_key is not None:
        report(SUBJECT, f"its SSH key: {path} on {spec.gateway.host}")
    stale = await node_access.check(spec, conns, nodes, public_key, facts)
    return await node_access.install(spec, conns, stale, public_key, report) if stale else []
