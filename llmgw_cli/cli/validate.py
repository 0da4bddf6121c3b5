"""`llmgw validate` and `llmgw schema`: the cluster file checked, and its JSON Schema."""

import sys
from pathlib import Path
from typing import Annotated

import typer

from llmgw_cli.cli.common import DEFAULT_FILE, ClusterFile, read_cluster


def validate(file: ClusterFile = DEFAULT_FILE) -> None:
    """Check a cluster file: every problem is reported at once, with line and column.

    Exit code 0 when valid, 2 when it has problems.
    """
    from rich.console import Console

    from llmgw_cli.cli.views import spec_headline, spec_summary

    spec = read_cluster(file)
    out = Console()
    out.print(spec_headline(spec, str(file)), soft_wrap=True)
    out.print(spec_summary(spec))


def schema(
    output: Annotated[
        Path | None, typer.Option("--out", "-o", help="Write to this file instead of stdout.")
    ] = None,
) -> None:
    """Print the JSON Schema of the cluster file (for editors and CI)."""
    from llmgw_cli.core.docgen import json_schema

    text = json_schema()
    if output is None:
        sys.stdout.write(text)
    else:
        output.write_text(text, encoding="utf-8")
