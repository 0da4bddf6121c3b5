"""`llmgw gateway run`: the OpenAI-compatible gateway daemon."""

from __future__ import annotations

import importlib
import os
import select
import sys
from collections.abc import Callable, Coroutine
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypedDict

import typer

from llmgw_cli.cli.common import DEFAULT_FILE, ClusterFile, read_cluster
from llmgw_cli.core.hosts.paths import ENGINE_ENV_FILE, ENGINE_KEY_VAR, ENGINE_KEYS_FILE

if TYPE_CHECKING:
    from llmgw_cli.core.clusterfile.spec import ClusterSpec

app = typer.Typer(help="The OpenAI-compatible gateway.", no_args_is_help=True)


class EventLoop(StrEnum):
    auto = "auto"
    asyncio = "asyncio"
    uvloop = "uvloop"


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
    follow: Annotated[
        bool,
        typer.Option(
            "--follow",
            help="Never lead: route to the replica set the leading gateway process publishes in "
            "the store, and ask it for on-demand starts. Needs no SSH key (no access to the nodes).",
        ),
    ] = False,
    engine_keys_file: Annotated[
        Path | None,
        typer.Option(
            "--engine-keys-file",
            envvar="LLMGW_ENGINE_KEYS_FILE",
            help="The engine keys by node, as `apply` writes them on the gateway host "
            f"({ENGINE_KEYS_FILE}); read again on SIGHUP.",
        ),
    ] = None,
    engine_key_file: Annotated[
        Path,
        typer.Option(
            "--engine-key-file",
            envvar="LLMGW_ENGINE_KEY_FILE",
            readable=False,  # read only without a map and $LLMGW_ENGINE_KEY, with a clear error then
            help="Without --engine-keys-file: env file with LLMGW_ENGINE_KEY=..., one key for "
            "every engine ($LLMGW_ENGINE_KEY, when set, is used instead).",
        ),
    ] = Path(ENGINE_ENV_FILE),
    identity_file: Annotated[
        Path | None,
        typer.Option(
            "--identity-file",
            help="The gateway's own SSH key: it logs in to the nodes as llmgw-gateway, where "
            "it may run the node helper only (the installed unit passes the key apply made "
            "on the gateway host). Without it, the cluster file's ssh settings are used.",
        ),
    ] = None,
    known_hosts: Annotated[
        Path | None,
        typer.Option("--known-hosts", help="known_hosts file instead of the cluster file's ssh.known_hosts."),
    ] = None,
    discover_every: Annotated[
        float | None,
        typer.Option(
            min=0.001,
            help="Seconds between probes of the nodes, instead of gateway.discover_every (15s). "
            "With --replicas: an hour.",
        ),
    ] = None,
    health_every: Annotated[
        float | None,
        typer.Option(
            min=0.001, help="Seconds between health checks of replicas, instead of gateway.health_every (2s)."
        ),
    ] = None,
    flush_every: Annotated[
        float | None,
        typer.Option(
            min=0.001, help="Seconds between writes of usage totals, instead of gateway.flush_every (5s)."
        ),
    ] = None,
    access_log: Annotated[bool, typer.Option(help="One JSON line per request on stderr.")] = True,
    workers: Annotated[
        int | None,
        typer.Option(
            "--workers",
            min=1,
            max=64,
            help="Gateway processes accepting on the same listeners (overrides "
            "gateway.workers; unset there: one per core, at most 8). 1: this process serves.",
        ),
    ] = None,
    worker: Annotated[
        int | None,
        typer.Option(
            "--worker", min=0, hidden=True, help="Set by the supervisor: this process is that worker."
        ),
    ] = None,
    event_loop: Annotated[
        EventLoop,
        typer.Option(
            "--event-loop",
            envvar="LLMGW_EVENT_LOOP",
            help="auto: uvloop when it is installed, else asyncio's own loop.",
        ),
    ] = EventLoop.auto,
) -> None:
    """Serve the OpenAI API on `gateway.listen`, routing to the cluster's replicas.

    SIGHUP reloads the cluster file; SIGTERM drains requests in flight, then exits.
    With several workers this process supervises them and passes those signals on.
    Several processes share the cluster through its store: one leads (probes the nodes,
    starts and stops replicas), the others follow.
    """
    # The gateway's stack, loaded by this command only (cli/common.py).
    import logging

    from llmgw_cli.core.planning.drain import routes_dir
    from llmgw_cli.gateway.control.sources import ProbeSource, PublishedSource, ReplicaSource, StaticSource
    from llmgw_cli.gateway.control.state import Gateway, read_engine_key, read_engine_keys
    from llmgw_cli.gateway.control.workers import default_count
    from llmgw_cli.gateway.serving.accesslog import LIMIT, AccessLog
    from llmgw_cli.gateway.serving.server import redact_log, serve
    from llmgw_cli.gateway.store.sqlite import open_store
    from llmgw_cli.remote.cluster_lock import gateway_lock
    from llmgw_cli.remote.connect import GatewayAccess

    if follow and replicas is not None:
        raise typer.BadParameter("--follow reads the published replica set: not with --replicas")

    runner = _runner(event_loop)
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format="%(message)s" if worker is None else f"[worker {worker}] %(message)s",
    )

    def load() -> ClusterSpec:
        # the commits apply chose, from the pins file beside the cluster file: at start and
        # on SIGHUP, never asked of the Hub
        spec = load_pinned(file)
        ssh = {"known_hosts": str(known_hosts.absolute())} if known_hosts is not None else {}
        return spec.model_copy(update={"ssh": spec.ssh.model_copy(update=ssh)}) if ssh else spec

    spec = load()
    count = workers or spec.gateway.workers or default_count()
    if worker is None and count > 1:
        # This process becomes the supervisor: a fresh interpreter without the CLI and the
        # serving stack (gateway/supervisor.py); each worker runs this command line with
        # --worker I.
        from llmgw_cli.gateway.supervisor import become_supervisor

        become_supervisor([sys.executable, *sys.orig_argv[1:]], count, spec.gateway.state_dir)
    # $LLMGW_ENGINE_KEY first: a systemd unit can pass the root-only engine.env with
    # EnvironmentFile= to a gateway that runs unprivileged and cannot read the file itself.
    keys_file = engine_keys_file
    if keys_file is None and engine_key_file == Path(ENGINE_ENV_FILE):
        # where apply puts the map: beside the installed gateway's files, else (a gateway
        # run by hand) in its state folder
        own = Path(spec.gateway.state_dir) / "engine-keys.json"
        keys_file = next((p for p in (Path(ENGINE_KEYS_FILE), own) if p.is_file()), None)
    engine_keys = (lambda: read_engine_keys(keys_file)) if keys_file is not None else None
    engine_key = (
        "" if engine_keys is not None else os.environ.get(ENGINE_KEY_VAR) or read_engine_key(engine_key_file)
    )
    access = (
        GatewayAccess(identity_file.absolute(), known_hosts.absolute() if known_hosts else None)
        if identity_file is not None
        else None
    )
    store = open_store(spec)
    probe = ProbeSource(file.parent, access) if replicas is None and not follow else None
    source: ReplicaSource
    if follow:
        source = PublishedSource(store)
    elif probe is not None:
        source = probe
    else:
        source = StaticSource.from_file(replicas or Path())
    # Every worker (and every host) with node access may lead; the one that leads alone
    # starts and stops replicas (gateway/control/coordination.py): the others route.
    manages = probe is not None and spec.gateway.manage_replicas
    # asyncssh says "Opening SSH connection", "Requesting new SSH session"... at INFO for
    # every probe: most of the journal. Its warnings and errors still show.
    logging.getLogger("asyncssh").setLevel(logging.WARNING)
    gateway = Gateway(
        spec,
        source,
        store,
        engine_key,
        engine_keys=engine_keys,
        reload_spec=load,
        **interval_flags(discover_every, health_every, flush_every, fixed_replicas=replicas is not None),
        # several workers share stderr: whole lines in writes no other process can cut
        access_log=AccessLog(sys.stderr.buffer, LIMIT if worker is None else select.PIPE_BUF)
        if access_log
        else None,
        # Starts, stops and replacements need the nodes: only with a probed cluster, not
        # with a fixed replica list (the controller then only observes).
        manage_replicas=manages,
        # the cluster lock in its state folder: apply takes the same one before it writes units
        lock=gateway_lock(spec) if manages else None,
        # what it routes, for apply (core/planning/drain.py): <state_dir>/routes/<pid>.json
        routes=Path(routes_dir(spec.gateway.state_dir)),
    )
    for handler in logging.getLogger().handlers:  # no secret in the journal (core/serving/redact.py)
        redact_log(handler, gateway)
    runner(serve(gateway, worker=worker))


def load_pinned(file: Path) -> ClusterSpec:
    """The cluster file as the gateway runs it: each repository llmgw fetches at the commit
    of the pins file beside it (``core/pins.with_pins_file``). One left unresolved (no pins
    file, as for a gateway run by hand before any apply, or no valid pin for its source)
    is logged: the gateway will not start it, every other model runs."""
    import logging

    from llmgw_cli.core.weights.pins import pins_file, unpinned, with_pins_file

    spec = with_pins_file(read_cluster(file), file)
    for name in unpinned(spec):
        logging.getLogger("llmgw.gateway").warning(
            "model %s: %s is not resolved to a commit (no pin for it in %s): the gateway will not "
            "start it; run `llmgw apply`, which pins it",
            name,
            spec.model(name).source,
            pins_file(file),
        )
    return spec


class Intervals(TypedDict):
    """Gateway's interval arguments: seconds, or None for the cluster file's."""

    discover_every: float | None
    health_every: float | None
    flush_every: float | None


def interval_flags(
    discover_every: float | None,
    health_every: float | None,
    flush_every: float | None,
    *,
    fixed_replicas: bool,
) -> Intervals:
    """The Gateway's interval arguments from the flags: a flag given replaces the cluster
    file's value, one left out (None) keeps the file's, reloads included
    (``state.job_intervals``). A fixed replica list (``--replicas``) leaves nothing to
    probe: discovery then runs hourly unless the flag says otherwise."""
    if discover_every is None and fixed_replicas:
        discover_every = 3600.0
    return Intervals(discover_every=discover_every, health_every=health_every, flush_every=flush_every)


def _runner(loop: EventLoop) -> Callable[[Coroutine[Any, Any, None]], None]:
    """``asyncio.run`` on the chosen event loop."""
    import asyncio

    if loop is EventLoop.asyncio:
        return asyncio.run
    try:
        run: Callable[[Coroutine[Any, Any, None]], None] = importlib.import_module("uvloop").run
    except ImportError:
        if loop is EventLoop.uvloop:
            raise typer.BadParameter("uvloop is not installed", param_hint="--event-loop") from None
        return asyncio.run
    return run
