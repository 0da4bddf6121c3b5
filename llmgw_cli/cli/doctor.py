"""`llmgw doctor`: what would stop each node from serving, with the fix for each."""

from __future__ import annotations

import asyncio
import json as json_module
import os
import sys
import time
from typing import Annotated

import typer
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from llmgw_cli.cli.common import DEFAULT_FILE, ClusterFile, read_cluster
from llmgw_cli.cli.status import NodesOption
from llmgw_cli.cli.views import plain
from llmgw_cli.core.doctor import Finding, Severity, diagnose
from llmgw_cli.errors import UsageError
from llmgw_cli.remote.doctor import collect

STYLE = {Severity.error: "red", Severity.warning: "yellow", Severity.info: "cyan"}


def doctor_view(findings: list[Finding], nodes: list[str], seconds: float) -> RenderableType:
    """One row per finding (a node without any gets an "ok" row), then the counts."""
    table = Table(title=f"Doctor ({len(nodes)} nodes checked in {seconds:.2f}s)", title_justify="left")
    for col in ("node", "severity", "check"):
        table.add_column(col, no_wrap=True)
    table.add_column("finding", overflow="fold", ratio=3)
    table.add_column("fix", overflow="fold", ratio=2)
    for f in findings:
        if f.node is None:
            table.add_row(
                "(gateway)",
                Text(f.severity.value, STYLE[f.severity]),
                plain(f.check),
                plain(f.message),
                plain(f.fix),
            )
    for node in nodes:
        mine = [f for f in findings if f.node == node]
        if not mine:
            table.add_row(plain(node), Text("ok", "green"), "", "", "")
        for f in mine:
            # Findings quote what the node said (folder names, process names): text, not markup.
            table.add_row(
                plain(node),
                Text(f.severity.value, STYLE[f.severity]),
                plain(f.check),
                plain(f.message),
                plain(f.fix),
            )
    errors = sum(1 for f in findings if f.severity is Severity.error)
    warnings = sum(1 for f in findings if f.severity is Severity.warning)
    verdict = (
        Text(f"{errors} error(s), {warnings} warning(s): serving would break", "bold red")
        if errors
        else Text(f"no errors, {warnings} warning(s)", "bold green" if not warnings else "bold yellow")
    )
    return Group(table, verdict)


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
    spec = read_cluster(file)
    chosen = [n.strip() for n in nodes.split(",") if n.strip()] if nodes else None
    unknown = sorted(set(chosen or []) - {n.name for n in spec.nodes})
    if unknown:
        raise UsageError(f"--nodes: no node {', '.join(unknown)} in {file}")
    started = time.monotonic()
    collected = asyncio.run(collect(spec, file.resolve().parent, chosen))
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
        width = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 160
        Console(width=width).print(doctor_view(findings, checked, seconds))
    if failed:
        raise typer.Exit(1)
