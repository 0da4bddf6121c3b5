"""`llmgw doctor`: what would stop each node from serving, with the fix for each."""

import json as json_module
import sys
import time
from typing import Annotated

import typer

from llmgw_cli.cli.common import (
    DEFAULT_FILE,
    ClusterFile,
    NodesOption,
    chosen_nodes,
    node_progress,
    read_cluster,
    stdout_console,
)


def doctor(
    file: ClusterFile = DEFAULT_FILE,
    nodes: NodesOption = None,
    json: Annotated[bool, typer.Option("--json", help="Print the findings as JSON, for scripts.")] = False,
) -> None:
    """Check every node (and the gateway settings) for what would stop serving: engines that
    cannot load, CPUs without AVX2/FMA, memlock, InfiniBand ports, the NVSwitch fabric
    manager, weight folders, taken ports, clock skew, gateway timeouts. Each finding comes
    with its fix.

    Exit code 0 when no finding is an error (warnings allowed), 1 when one is.
    """
    from rich.console import Console

    from llmgw_cli.cli.rendering import rendered, to_report
    from llmgw_cli.cli.session import Session
    from llmgw_cli.cli.views import doctor_view
    from llmgw_cli.core.doctor import Severity, diagnose
    from llmgw_cli.remote.doctor import collect

    spec = read_cluster(file)
    chosen = chosen_nodes(spec, nodes, file)
    started = time.monotonic()
    total = len(chosen) if chosen is not None else len(spec.nodes)
    with (
        Session(spec, file.resolve().parent) as session,
        node_progress(Console(stderr=True), "checking", total) as update,
    ):
        collected = session.run(
            rendered(lambda events: collect(spec, session.conns, chosen, events), to_report(update))
        )
    seconds = time.monotonic() - started
    findings = diagnose(spec, collected)
    checked = [c.facts.node for c in collected]
    failed = any(f.severity is Severity.error for f in findings)
    if json:
        report = {
            "nodes": checked,
            "seconds": round(seconds, 3),
            "errors": sum(1 for f in findings if f.severity is Severity.error),
            "warnings": sum(1 for f in findings if f.severity is Severity.warning),
            "findings": [f.model_dump(mode="json") for f in findings],
        }
        sys.stdout.write(json_module.dumps(report, indent=2) + "\n")
    else:
        stdout_console().print(doctor_view(findings, checked, seconds))
    if failed:
        raise typer.Exit(1)
