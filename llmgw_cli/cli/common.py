"""What every command shares: the -f option and reading the cluster file."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from llmgw_cli.core.load import parse_cluster
from llmgw_cli.core.spec import ClusterSpec
from llmgw_cli.errors import InputError

ClusterFile = Annotated[
    Path,
    typer.Option(
        "--file",
        "-f",
        envvar="LLMGW_CLUSTER",
        help="Cluster file (YAML). Also read from $LLMGW_CLUSTER.",
        show_default=True,
    ),
]
DEFAULT_FILE = Path("cluster.yaml")


def read_cluster(path: Path) -> ClusterSpec:
    """Read and validate a cluster file; every problem is raised at once as a SpecError."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{path}: no such file (give the cluster file with -f FILE)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot read: {exc}") from None
    return parse_cluster(text, str(path))
