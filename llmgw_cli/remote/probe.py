"""Gather facts from every node at once: one script per node, over the node's connection
held by ``Connections`` (a second gather through the same owner connects no more).

Gather first, then decide: the result is one frozen snapshot that placement, planning
and the views read; nothing probes again in the middle of a decision.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from llmgw_cli.core.clusterfile.spec import ClusterSpec, Node
from llmgw_cli.core.observe.facts import NodeFacts
from llmgw_cli.core.observe.parse.probe import BAD_OUTPUT, complete, parse_probe, printable, probe_script
from llmgw_cli.errors import NodeError
from llmgw_cli.progress import Phase, Report, silent
from llmgw_cli.remote.connect import Connections
from llmgw_cli.remote.nodeops import NodeOps
from llmgw_cli.remote.transport import Transport


@dataclass(frozen=True)
class Snapshot:
    nodes: tuple[NodeFacts, ...]
    seconds: float

    def node(self, name: str) -> NodeFacts:
        return next(n for n in self.nodes if n.node == name)


async def _probe_one(
    spec: ClusterSpec, node: Node, transport: Transport, progress: Report, *, helper: bool
) -> NodeFacts:
    started = time.monotonic()
    progress(node.name, "connecting")
    try:
        if not helper:
            result = await transport.run("sh -s", stdin=probe_script(spec, node))
        else:  # the gateway: the script apply installed on the node, through the helper
            result = await NodeOps(transport, root=False).probe()
        if not complete(result.stdout):
            reason = "probe output ended early: " + printable(_stderr_line(result.stderr))
            raise NodeError(node.name, BAD_OUTPUT, reason)
        facts = parse_probe(node, result.stdout)
        if facts.reachable:
            progress(node.name, "done", Phase.done)
        else:
            progress(node.name, "failed", Phase.failed)
        return facts.model_copy(update={"probe_seconds": time.monotonic() - started})
    except NodeError as exc:
        progress(node.name, "failed", Phase.failed)
        return NodeFacts(
            node=node.name, error=exc.reason, error_kind=exc.kind, probe_seconds=time.monotonic() - started
        )
    except Exception as exc:  # one node's surprise is that node's error, not every node's
        progress(node.name, "failed", Phase.failed)
        return NodeFacts(
            node=node.name,
            error=f"probe failed: {type(exc).__name__}: {printable(str(exc)[:200])}",
            error_kind=BAD_OUTPUT,
            probe_seconds=time.monotonic() - started,
        )


def _stderr_line(stderr: str) -> str:
    lines = [line for line in stderr.split("\n") if line.strip()]
    return lines[-1][:200] if lines else "no error message"


async def gather(
    spec: ClusterSpec,
    conns: Connections,
    nodes: list[str] | None = None,
    progress: Report | None = None,
) -> Snapshot:
    """Probe ``nodes`` (default: all) through ``conns``, at most ``ssh.max_parallel`` at
    once; ``progress`` hears (node, event) with the events "connecting", then "done" or
    "failed". With the gateway's access, through the script apply installed on each node."""
    started = time.monotonic()
    chosen = [n for n in spec.nodes if nodes is None or n.name in nodes]
    report = progress or silent
    helper = conns.access is not None

    async def one(node: Node, transport: Transport) -> NodeFacts:
        return await _probe_one(spec, node, transport, report, helper=helper)

    facts = await conns.each(chosen, one)
    return Snapshot(nodes=tuple(facts), seconds=time.monotonic() - started)
