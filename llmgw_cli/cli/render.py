"""`llmgw render ...`: files llmgw generates, printed for inspection or for hand installs."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from llmgw_cli.cli.common import DEFAULT_FILE, ClusterFile, read_cluster

app = typer.Typer(
    help="Render files llmgw generates (systemd units, monitoring) to stdout.", no_args_is_help=True
)


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
    from llmgw_cli.core.units import gateway_unit

    spec = read_cluster(file)
    unit = gateway_unit(spec, llmgw_bin=llmgw_bin or _llmgw_bin(), config_path=config_path, user=user)
    sys.stdout.write(unit)


@app.command("monitoring")
def monitoring_cmd(
    file: ClusterFile = DEFAULT_FILE,
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="Write prometheus.yml and llmgw-alerts.yml into this folder."),
    ] = None,
    admin_key_file: Annotated[
        str,
        typer.Option(
            help="Where Prometheus reads an admin key, when it must scrape the admin listener "
            "(no gateway.metrics_listen)."
        ),
    ] = "/etc/prometheus/llmgw-admin.key",
) -> None:
    """A Prometheus configuration that scrapes the gateway, and the llmgw alert rules.

    Without --out both files go to stdout, each after a `# ==> NAME <==` line.
    """
    from llmgw_cli.core.monitoring import monitoring_files

    spec = read_cluster(file)
    files = monitoring_files(spec, admin_key_file)
    if out is None:
        sys.stdout.write("".join(f"# ==> {name} <==\n{text}" for name, text in files.items()))
        return
    out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out / name).write_text(text, encoding="utf-8")
        sys.stderr.write(f"wrote {out / name}\n")
