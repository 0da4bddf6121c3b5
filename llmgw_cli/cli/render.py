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
    llmgw_bin: Annotated[
        str | None,
        typer.Option(help="Path of llmgw on the gateway host. Default: gateway.llmgw_bin, else this llmgw."),
    ] = None,
    handover: Annotated[
        bool, typer.Option(help="The hand-over twin apply runs beside it while it upgrades the gateway.")
    ] = False,
) -> None:
    """Print llmgw-gateway.service as `apply` installs it on the gateway host.

    It runs as llmgw-gateway with the files apply puts under /etc/llmgw/gateway (the
    cluster file, the gateway's SSH key, known_hosts, the engine keys) and takes its
    listeners from llmgw-gateway.socket (`llmgw render gateway-socket`).
    """
    from llmgw_cli.core.gateway_install import installed_gateway_unit

    spec = read_cluster(file)
    binary = llmgw_bin or spec.gateway.llmgw_bin or _llmgw_bin()
    sys.stdout.write(installed_gateway_unit(spec, llmgw_bin=binary, handover=handover))


@app.command("gateway-socket")
def gateway_socket_cmd(file: ClusterFile = DEFAULT_FILE) -> None:
    """Print llmgw-gateway.socket, the gateway's listeners, as `apply` installs it."""
    from llmgw_cli.core.units import gateway_socket_unit

    sys.stdout.write(gateway_socket_unit(read_cluster(file)))


@app.command("monitoring")
def monitoring_cmd(
    file: ClusterFile = DEFAULT_FILE,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out", "-o", help="Write prometheus.yml, llmgw-alerts.yml and grafana/ into this folder."
        ),
    ] = None,
    admin_key_file: Annotated[
        str,
        typer.Option(
            help="Where Prometheus reads an admin key, when it must scrape the admin listener "
            "(no gateway.metrics_listen)."
        ),
    ] = "/etc/prometheus/llmgw-admin.key",
    prometheus_url: Annotated[
        str | None,
        typer.Option(
            help="The Prometheus Grafana reads (the provisioned datasource's URL). Default: http://localhost:9090."
        ),
    ] = None,
) -> None:
    """A Prometheus configuration that scrapes the gateway, the llmgw alert rules, and a
    Grafana dashboard with its provisioning files.

    Without --out every file goes to stdout, each after a `# ==> NAME <==` line.
    """
    from llmgw_cli.core.grafana import DEFAULT_PROMETHEUS_URL
    from llmgw_cli.core.monitoring import monitoring_files

    spec = read_cluster(file)
    files = monitoring_files(spec, admin_key_file, prometheus_url=prometheus_url or DEFAULT_PROMETHEUS_URL)
    if out is None:
        sys.stdout.write("".join(f"# ==> {name} <==\n{text}" for name, text in files.items()))
        return
    out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text, encoding="utf-8")
        sys.stderr.write(f"wrote {out / name}\n")
