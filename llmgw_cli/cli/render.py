"""`llmgw render ...`: files llmgw generates, printed for inspection or for hand installs."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from llmgw_cli.cli.common import DEFAULT_FILE, ClusterFile, read_cluster

if TYPE_CHECKING:
    from llmgw_cli.core.engine.commands import EngineCommand

app = typer.Typer(
    help="Render files llmgw generates (systemd units, monitoring) and engine commands to stdout.",
    no_args_is_help=True,
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
    from llmgw_cli.core.hosts.gateway_install import installed_gateway_unit

    spec = read_cluster(file)
    binary = llmgw_bin or spec.gateway.llmgw_bin or _llmgw_bin()
    sys.stdout.write(installed_gateway_unit(spec, llmgw_bin=binary, handover=handover))


@app.command("gateway-socket")
def gateway_socket_cmd(file: ClusterFile = DEFAULT_FILE) -> None:
    """Print llmgw-gateway.socket, the gateway's listeners, as `apply` installs it."""
    from llmgw_cli.core.hosts.units import gateway_socket_unit

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
    from llmgw_cli.core.views.grafana import DEFAULT_PROMETHEUS_URL
    from llmgw_cli.core.views.monitoring import monitoring_files

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


@app.command("commands")
def commands_cmd(
    file: ClusterFile = DEFAULT_FILE,
    model: Annotated[str | None, typer.Option("--model", help="Only this model (its name).")] = None,
    json_out: Annotated[
        bool,
        typer.Option(
            "--json",
            help="A JSON list, in the file's model order, of {model, engine, node, rank, nodes, "
            "port, argv, pre_argv, env, notes}.",
        ),
    ] = False,
) -> None:
    """Print each model's engine command line and environment as `apply` renders them
    into its replica unit (ExecStart=, Environment=, EnvironmentFile=), asking no node.

    Every model is shown, those with scaling off too. A model's command depends on its
    node: it is rendered for the first node of the file whose declared GPUs fit it (the
    model's gpu_class, at least tensor_parallel cards), else the first node; a multi-node
    model as rank 0, the member that serves the API. What only apply knows is a
    placeholder: the GPU UUIDs (<gpu-uuid-N>), the port (the profile's first), the commit
    of a repository not pinned to one (<commit:REVISION> in its snapshot folder); and
    every value from the root-only files (the engine key, the model's secret env) is
    <secret>.
    """
    from llmgw_cli.cli.common import unknown_names
    from llmgw_cli.core.engine.commands import engine_command
    from llmgw_cli.errors import InputError, UsageError

    spec = read_cluster(file)
    names = [m.name for m in spec.models]
    if model is not None and model not in names:
        raise UsageError(
            f"--model: {unknown_names('model', [model], names)} in {file}; its models are {', '.join(names)}"
        )
    if not spec.nodes:
        raise InputError(f"{file} declares no node: a command is rendered for a node")
    found = [engine_command(spec, m) for m in spec.models if model is None or m.name == model]
    if json_out:
        sys.stdout.write(json.dumps([c.as_json() for c in found], indent=2) + "\n")
    else:
        sys.stdout.write("\n".join(_command_block(c) for c in found))


def _command_block(command: EngineCommand) -> str:
    """One model, copyable: the argv shell-quoted, each variable as NAME=value."""
    rank = f" rank {command.rank} of {command.nodes}," if command.nodes > 1 else ""
    lines = [f"# {command.model}: {command.engine} on {command.node},{rank} port {command.port}"]
    lines += [f"# note: {note}" for note in command.notes]
    lines += [f"{name}={shlex.quote(value)}" for name, value in command.env.items()]
    if command.pre_argv:
        lines.append(f"# before it (ExecStartPre=): {shlex.join(command.pre_argv)}")
    lines.append(shlex.join(command.argv))
    return "\n".join(lines) + "\n"
