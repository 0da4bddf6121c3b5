"""Gather facts from every node at once: one connection and one script per node.

Gather first, then decide: the result is one frozen snapshot that placement, planning
and the views read; nothing probes again in the middle of a decision.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

from llmgw_cli.core.facts import NodeFacts
from llmgw_cli.core.parse.probe import BAD_OUTPUT, complete, parse_probe, printable, probe_script
from llmgw_cli.core.spec import ClusterSpec, Node
from llmgw_cli.errors import NodeError
from llmgw_cli.progress import Report
from llmgw_cli.remote.connect import GatewayAccess, transport_for
from llmgw_cli.remote.nodeops import NodeOps


@dataclass(frozen=True)
class Snapshot:
    nodes: tuple[NodeFacts, ...]
    seconds: float

    def node(self, name: str) -> NodeFacts:
        return next(n for n in self.nodes if n.node == name)


async def _probe_one(
    spec: ClusterSpec, node: Node, base: Path, progress: Report, access: GatewayAccess | None = None
) -> NodeFacts:
    started = time.monotonic()
    transport = transport_for(spec, node, base, access)
    progress(node.name, "connecting")
    try:
        if access is None:
            result = await transport.run("sh -s", stdin=probe_script(spec, node))
        else:  # the gateway: the script apply installed on the node, through the helper
            result = await NodeOps(transport, root=False).probe()
        if not complete(result.stdout):
            reason = "probe output ended early: " + printable(_stderr_line(result.stderr))
            raise NodeError(node.name, BAD_OUTPUT, reason)
        facts = parse_probe(node, result.stdout)
        progress(node.name, "done" if facts.reachable else "failed")
        return facts.model_copy(update={"probe_seconds": time.monotonic() - started})
    except NodeError as exc:
        progress(node.name, "failed")
        return NodeFacts(
            node=node.name, error=exc.reason, error_kind=exc.kind, probe_seconds=time.monotonic() - started
        )
    except Exception as exc:  # one node's surprise is that node's error, not every node's
        progress(node.name, "failed")
        return NodeFacts(
            node=node.name,
            error=f"probe failed: {type(exc).__name__}: {printable(str(exc)[:200])}",
            error_kind=BAD_OUTPUT,
            probe_seconds=time.monotonic() - started,
        )
    finally:
        await transport.close()


def _stderr_line(stderr: str) -> str:
    lines = [line for line in stderr.split("\n") if line.strip()]
    return lines[-1][:200] if lines else "no error message"


async def gather(
    spec: ClusterSpec,
    base: Path,
    nodes: list[str] | None = None,
    progress: Report | None = None,
    access: GatewayAccess | None = None,
) -> Snapshot:
    """Probe ``nodes`` (default: all), at most ``ssh.max_parallel`` at once; ``progress``
    hears (node, event) with the events "connecting", then "done" or "failed"."""
    started = time.monotonic()
    chosen = [n for n in spec.nodes if nodes is None or n.name in nodes]
    limit = asyncio.Semaphore(spec.ssh.max_parallel)
    report = progress or (lambda _node, _event: None)

    async def bounded(node: Node) -> NodeFacts:
        async with limit:
            return await _probe_one(spec, node, base, report, access)

    facts = await asyncio.gather(*(bounded(n) for n in chosen))
    return Snapshot(nodes=tuple(facts), seconds=time.monotonic() - started)
