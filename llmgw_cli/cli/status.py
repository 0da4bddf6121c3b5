"""`llmgw status`: probe every node and show the fleet."""

from __future__ import annotations

import asyncio
import json as json_module
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from llmgw_cli.cli.common import DEFAULT_FILE, ClusterFile, read_cluster
from llmgw_cli.cli.views import status_view
from llmgw_cli.core.spec import ClusterSpec
from llmgw_cli.core.summary import summarize
from llmgw_cli.remote.probe import Snapshot, gather

NodesOption = Annotated[
    str | None, typer.Option("--nodes", help="Comma-separated node names (default: every node).")
]


def probe_with_progress(spec: ClusterSpec, file: Path, nodes: str | None, console: Console) -> Snapshot:
    """Probe the nodes with a live progress bar on stderr (hidden when not a terminal)."""
    chosen = [n.strip() for n in nodes.split(",")] if nodes else None
    total = len([n for n in spec.nodes if chosen is None or n.name in chosen])
    with Progress(
        TextColumn("probing"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}", markup=False),  # node names and events, not markup
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    ) as bar:
        task = bar.add_task("", total=total)

        def update(node: str, event: str) -> None:
            if event in ("done", "failed"):
                bar.update(task, advance=1, description=f"{node} {event}")

        return asyncio.run(gather(spec, file.resolve().parent, chosen, update))


def status(
    file: ClusterFile = DEFAULT_FILE,
    nodes: NodesOption = None,
    json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON, for scripts.")] = False,
) -> None:
    """Probe every node over SSH and show nodes, GPUs by class, fabrics and models.

    Unreachable nodes are listed with the reason. Exit code 0 even when some nodes fail:
    the table says which; use --json to act on it in scripts.
    """
    err = Console(stderr=True)
    spec = read_cluster(file)
    snapshot = probe_with_progress(spec, file, nodes, err)
    summary = summarize(spec, {f.node: f for f in snapshot.nodes})
    if json:
        report = {"probe_seconds": round(snapshot.seconds, 3), **summary.model_dump(mode="json")}
        sys.stdout.write(json_module.dumps(report, indent=2) + "\n")
        return
    # Piped output (a log, a pager) gets room for the tables instead of rich's 80 columns.
    width = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 160
    Console(width=width).print(status_view(summary, snapshot.seconds))
