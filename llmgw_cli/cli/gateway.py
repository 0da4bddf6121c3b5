"""`llmgw gateway run`: the OpenAI-compatible gateway daemon."""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Annotated, Any

import typer

from llmgw_cli.cli.common import DEFAULT_FILE, ClusterFile, read_cluster
from llmgw_cli.core.engines import ENGINE_ENV_FILE, ENGINE_KEY_VAR
from llmgw_cli.core.spec import ClusterSpec
from llmgw_cli.gateway.accesslog import AccessLog
from llmgw_cli.gateway.server import serve
from llmgw_cli.gateway.sources import ProbeSource, ReplicaSource, StaticSource
from llmgw_cli.gateway.state import Gateway, read_engine_key
from llmgw_cli.gateway.store import SqliteStore
from llmgw_cli.gateway.supervisor import Supervisor

app = typer.Typer(help="The OpenAI-compatible gateway.", no_args_is_help=True)


@app.command()
def run(
    *,
    file: ClusterFile = DEFAULT_FILE,
    replicas: Annotated[
        Path | None,
        typer.Option(
            "--replicas",
            help="YAML/JSON file `model: [host:port, ...]`: use these replicas instead of "
            "probing the nodes (engines outside llmgw, tests, benchmarks).",
        ),
    ] = None,
    engine_key_file: Annotated[
        Path,
        typer.Option(
            "--engine-key-file",
            envvar="LLMGW_ENGINE_KEY_FILE",
            readable=False,  # read only without $LLMGW_ENGINE_KEY, with a clear error then
            help="Env file with LLMGW_ENGINE_KEY=..., the key the engines require "
            "($LLMGW_ENGINE_KEY, when set, is used instead).",
        ),
    ] = Path(ENGINE_ENV_FILE),
    identity_file: Annotated[
        Path | None,
        typer.Option(
            "--identity-file",
            help="SSH key for the nodes instead of the cluster file's ssh.identity_file "
            "(the installed unit passes its systemd credential here).",
        ),
    ] = None,
    known_hosts: Annotated[
        Path | None,
        typer.Option("--known-hosts", help="known_hosts file instead of the cluster file's ssh.known_hosts."),
    ] = None,
    discover_every: Annotated[float, typer.Option(help="Seconds between probes of the nodes.")] = 15.0,
    health_every: Annotated[float, typer.Option(help="Seconds between health checks of replicas.")] = 2.0,
    flush_every: Annotated[float, typer.Option(help="Seconds between writes of usage totals.")] = 5.0,
    access_log: Annotated[bool, typer.Option(help="One JSON line per request on stderr.")] = True,
) -> None:
    """Serve the OpenAI API on `gateway.listen`, routing to the cluster's replicas.

    SIGHUP reloads the cluster file; SIGTERM drains requests in flight, then exits.
    """

    def load() -> ClusterSpec:
        spec = read_cluster(file)
        ssh = {
            k: str(v.absolute())
            for k, v in (("identity_file", identity_file), ("known_hosts", known_hosts))
            if v is not None
        }
        return spec.model_copy(update={"ssh": spec.ssh.model_copy(update=ssh)}) if ssh else spec

    spec = load()
    # $LLMGW_ENGINE_KEY first: a systemd unit can pass the root-only engine.env with
    # EnvironmentFile= to a gateway that runs unprivileged and cannot read the file itself.
    engine_key = os.environ.get(ENGINE_KEY_VAR) or read_engine_key(engine_key_file)
    probe = ProbeSource(file.parent) if replicas is None else None
    source: ReplicaSource = probe if probe is not None else StaticSource.from_file(replicas or Path())
    store = SqliteStore(spec.gateway.state_dir)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")
    gateway = Gateway(
        spec,
        source,
        store,
        engine_key,
        reload_spec=load,
        discover_every=discover_every if replicas is None else 3600.0,
        health_every=health_every,
        flush_every=flush_every,
        access_log=AccessLog(sys.stderr.buffer) if access_log else None,
    )
    if probe is not None and spec.gateway.manage_replicas:
        # On-demand starts, idle stops, eviction and scale-out need the nodes: only with a
        # probed cluster, not with a fixed replica list.
        gateway.supervisor = Supervisor(gateway, probe, file.parent, saved_last_use=store.last_use())
    try:  # optional: uvloop makes the event loop cheaper when it is installed
        runner: Callable[[Coroutine[Any, Any, None]], None] = importlib.import_module("uvloop").run
    except ImportError:
        runner = asyncio.run
    runner(serve(gateway))
