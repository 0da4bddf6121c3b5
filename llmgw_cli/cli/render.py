"""`llmgw render ...`: files llmgw generates, printed for inspection or for hand installs."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from llmgw_cli.cli.common import DEFAULT_FILE, ClusterFile, read_cluster
from llmgw_cli.core.units import gateway_unit

app = typer.Typer(help="Render files llmgw generates (systemd units) to stdout.", no_args_is_help=True)


def _llmgw_bin() -> str:
    """This very llmgw (not whichever one is first on PATH), as the unit should run it."""
    argv0 = Path(sys.argv[0])
    if argv0.name == "llmgw":
        return str(argv0.absolute())
    return f"{sys.executable} -m llmgw_cli"


@app.command("gateway-unit")
def gateway_unit_cmd(
    file: ClusterFile = DEFAULT_FILE,
    config_path: Annotated[
        str, typer.Option(help="Where the cluster file will be on the gateway host.")
    ] = "/etc/llmgw/cluster.yaml",
    llmgw_bin: Annotated[
        str | None, typer.Option(help="Path of llmgw on the gateway host. Default: this llmgw.")
    ] = None,
    user: Annotated[str, typer.Option(help="Account the gateway runs as.")] = "llmgw",
) -> None:
    """Print the llmgw-gateway.service unit for the cluster file."""
    spec = read_cluster(file)
    unit = gateway_unit(spec, llmgw_bin=llmgw_bin or _llmgw_bin(), config_path=config_path, user=user)
    sys.stdout.write(unit)
