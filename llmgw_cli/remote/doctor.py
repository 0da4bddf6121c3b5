"""Gather what `llmgw doctor` needs: one script per node (the probe plus the doctor's
sections), one round trip, nodes in parallel; on a node with failing replica units, a
second round, in parallel, for their journals. Deciding is the core's (core/doctor)."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from llmgw_cli.core.clusterfile.spec import ClusterSpec, Node
from llmgw_cli.core.doctor import Collected, DoctorFacts
from llmgw_cli.core.doctor.checks import JOURNAL_LINES, failing_units
from llmgw_cli.core.doctor.collect import doctor_script, parse_doctor
from llmgw_cli.core.observe.facts import NodeFacts
from llmgw_cli.core.observe.health import journal_tail
from llmgw_cli.core.observe.parse.probe import BAD_OUTPUT, complete, parse_probe, printable
from llmgw_cli.errors import NodeError
from llmgw_cli.progress import Phase, Report, silent
from llmgw_cli.remote.connect import Connections
from llmgw_cli.remote.execute import read_engine_key, redact_keys
from llmgw_cli.remote.nodeops import NodeOps
from llmgw_cli.remote.transport import Transport

JOURNAL_READ = 30  # lines read of a failing unit's journal, for its engine's last JOURNAL_LINES


async def failing_journals(c: Collected, transport: Transport) -> dict[str, tuple[str, ...]]:
    """The last lines of each failing replica unit's journal, read as root through the
    node helper (the script runs as the login account, which may not read system units'
    journals), engine keys replaced: an engine that prints its environment would put the
    key there. A journal that cannot be read is left out; the finding still names the unit."""
    units = [u.name for u in failing_units(c)]
    if not units:
        return {}
    try:
        key = await read_engine_key(transport)
        ops = NodeOps(transport)
        tails = await asyncio.gather(*(ops.journal(unit, "-", JOURNAL_READ) for unit in units))
    except NodeError:
        return {}
    return {
        unit: journal_tail(redact_keys(tail, [key] if key else []), JOURNAL_LINES)
        for unit, tail in zip(units, tails, strict=True)
    }


async def _collect_one(spec: ClusterSpec, node: Node, transport: Transport, progress: Report) -> Collected:
    progress(node.name, "connecting")
    # Wall-clock times (not monotonic): they are compared with the node's clock.
    sent = time.time()
    try:
        result = await transport.run("sh -s", stdin=doctor_script(spec, node))
        received = time.time()
        if not (complete(result.stdout) and complete(result.stdout, "doctor-end")):
            raise NodeError(node.name, BAD_OUTPUT, "doctor output ended early")
        facts = parse_probe(node, result.stdout).model_copy(update={"probe_seconds": received - sent})
        seen = Collected(facts, parse_doctor(node.name, result.stdout), sent, received)
        if facts.reachable:
            seen = dataclasses.replace(seen, journals=await failing_journals(seen, transport))
            progress(node.name, "done", Phase.done)
        else:
            progress(node.name, "failed", Phase.failed)
        return seen
    except NodeError as exc:
        progress(node.name, "failed", Phase.failed)
        facts = NodeFacts(node=node.name, error=exc.reason, error_kind=exc.kind)
        return Collected(facts, DoctorFacts(node=node.name), sent, time.time())
    except Exception as exc:  # one node's surprise is that node's error, not every node's
        progress(node.name, "failed", Phase.failed)
        reason = f"doctor failed: {type(exc).__name__}: {printable(str(exc)[:200])}"
        facts = NodeFacts(node=node.name, error=reason, error_kind=BAD_OUTPUT)
        return Collected(facts, DoctorFacts(node=node.name), sent, time.time())


async def collect(
    spec: ClusterSpec, conns: Connections, nodes: list[str] | None = None, progress: Report | None = None
) -> list[Collected]:
    """Collect ``nodes`` (default: all) through ``conns``, at most ``ssh.max_parallel`` at once."""
    chosen = [n for n in spec.nodes if nodes is None or n.name in nodes]
    report = progress or silent

    async def one(node: Node, transport: Transport) -> Collected:
        return await _collect_one(spec, node, transport, report)

    return await conns.each(chosen, one)
