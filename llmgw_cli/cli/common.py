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
        data = path.read_bytes()
    except FileNotFoundError:
        raise InputError(f"{path}: no such file (give the cluster file with -f FILE)") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc}") from None
    # Bytes, not text: a byte that is not UTF-8 is reported at its line and column.
    return parse_cluster(data, str(path))
