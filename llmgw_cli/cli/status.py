"""`llmgw status`: probe every node and show the fleet."""

import json as json_module
import sys
from typing import Annotated

import typer

from llmgw_cli.cli.common import (
    DEFAULT_FILE,
    ClusterFile,
    NodesOption,
    chosen_nodes,
    probe_with_progress,
    read_cluster,
    stdout_console,
)


def status(
    file: ClusterFile = DEFAULT_FILE,
    nodes: NodesOption = None,
    json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON, for scripts.")] = False,
) -> None:
    """Probe every node over SSH and show nodes, GPUs by class, fabrics and models.

    With --nodes, only those nodes are probed and shown, with what runs on them.
    Unreachable nodes are listed with the reason. Exit code 0 even when some nodes fail:
    the table says which; use --json to act on it in scripts.
    """
    from rich.console import Console

    from llmgw_cli.cli.views import status_view
    from llmgw_cli.core.summary import summarize

    spec = read_cluster(file)
    chosen = chosen_nodes(spec, nodes, file)  # a wrong name stops here, before any probe
    snapshot = probe_with_progress(spec, file, chosen, Console(stderr=True))
    summary = summarize(spec, {f.node: f for f in snapshot.nodes}, scope=chosen)
    if json:
        report = {"probe_seconds": round(snapshot.seconds, 3), **summary.model_dump(mode="json")}
        sys.stdout.write(json_module.dumps(report, indent=2) + "\n")
        return
    stdout_console().print(status_view(summary, snapshot.seconds))
