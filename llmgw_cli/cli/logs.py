"""`llmgw logs` and `llmgw restart`: one replica's engines without SSH and systemctl by hand.

Both probe the nodes for the replicas that run (their units, by model and replica
labels), then reach the member nodes through the operator's own SSH access, as `apply`
does: the journals are read and the units restarted as root there.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from llmgw_cli.cli.common import DEFAULT_FILE, ClusterFile, read_cluster

if TYPE_CHECKING:
    from rich.console import Console

    from llmgw_cli.cli.session import Session
    from llmgw_cli.core.clusterfile.spec import ClusterSpec
    from llmgw_cli.core.observe import journal
    from llmgw_cli.core.planning.plan import Running
    from llmgw_cli.remote.connect import Connections

Reference = Annotated[
    str,
    typer.Argument(metavar="MODEL[#N]", help="A model (every replica that runs) or one replica, MODEL#N."),
]


def _replicas(spec: ClusterSpec, file: Path, ref: journal.Ref, session: Session) -> list[Running]:
    from rich.console import Console

    from llmgw_cli.cli.common import probe_with_progress
    from llmgw_cli.core.engine.engines import unit_name
    from llmgw_cli.core.observe import journal
    from llmgw_cli.core.planning.plan import running_replicas
    from llmgw_cli.errors import NodeError

    snapshot = probe_with_progress(spec, file, None, Console(stderr=True), session)
    found = journal.chosen(ref, running_replicas({f.node: f for f in snapshot.nodes}))
    for r in found:
        if r.unit != unit_name(r.model, r.replica):  # the probe's names are the nodes' word
            raise NodeError(
                r.members[0], "bad-output", f"unit {journal.clean(r.unit)!r} is not {r.model}#{r.replica}'s"
            )
    return found


def _units(found: list[Running]) -> list[tuple[Running, str]]:
    return [(r, node) for r in found for node in r.members if node in r.units]


Command = Callable[[str], str]  # unit -> its journalctl command


async def _read(conns: Connections, units: list[tuple[Running, str]], command: Command) -> list[journal.Line]:
    import asyncio

    from llmgw_cli.core.observe import journal

    async def one(replica: Running, node: str) -> list[journal.Line]:
        done = await conns.to(node).run(command(replica.unit), root=True)
        label = journal.label(replica, node)
        if not done.ok:
            why = journal.clean((done.stderr or done.stdout).strip())
            return [journal.Line(time.time(), label, f"(journalctl failed: {why})")]
        parsed = (journal.parse_line(label, raw) for raw in done.stdout.splitlines())
        return [line for line in parsed if line is not None]

    read = await asyncio.gather(*(one(r, node) for r, node in units))
    return journal.merged([line for lines in read for line in lines])


async def _follow(conns: Connections, units: list[tuple[Running, str]], command: Command) -> None:
    """Every unit's new lines as they come, labelled, until interrupted."""
    import asyncio

    from llmgw_cli.core.observe import journal
    from llmgw_cli.errors import NodeError
    from llmgw_cli.remote.transport import Spawns

    async def one(replica: Running, node: str) -> None:
        t = conns.to(node)
        if not isinstance(t, Spawns):
            raise NodeError(node, "failed", "this connection cannot follow a journal")
        spawned = await t.spawn(command(replica.unit), root=True)
        label = journal.label(replica, node)
        try:
            while raw := await spawned.readline():
                line = journal.parse_line(label, raw)
                if line is not None:
                    sys.stdout.write(line.show() + "\n")
                    sys.stdout.flush()
        finally:
            await spawned.close()

    await asyncio.gather(*(one(r, node) for r, node in units))


def logs(
    ref: Reference,
    file: ClusterFile = DEFAULT_FILE,
    follow: Annotated[bool, typer.Option("--follow", help="Keep printing new lines (Ctrl-C ends).")] = False,
    since: Annotated[
        str | None,
        typer.Option(
            "--since",
            help="From this time on, as journalctl reads it: 10m (ago), 'today', '2026-12-01 10:00'.",
        ),
    ] = None,
    lines: Annotated[
        int, typer.Option("--lines", "-n", min=1, max=100000, help="At most this many lines per unit.")
    ] = 100,
) -> None:
    """The replicas' engine journals, merged in time order and labelled by node and replica.

    Each line: the time, the node, MODEL#N, then the journal's line (control characters
    shown as \\xNN). A multi-node replica shows every member's unit.
    """
    from llmgw_cli.cli.session import Session
    from llmgw_cli.core.observe import journal

    spec = read_cluster(file)
    parsed = journal.parse_ref(spec, ref)
    after = journal.since_value(since)
    with Session(spec, file.resolve().parent) as session:
        units = _units(_replicas(spec, file, parsed, session))

        def command(unit: str) -> str:  # with --follow: the last lines first, then new ones
            return journal.journal_command(unit, since=after, lines=lines, follow=follow)

        if follow:
            session.run(_follow(session.conns, units, command))
            return
        for line in session.run(_read(session.conns, units, command)):
            sys.stdout.write(line.show() + "\n")


async def _restart(spec: ClusterSpec, conns: Connections, replica: Running, report: Console) -> bool:
    """Restart every member's unit (all at once: a multi-node replica's ranks start
    together), then wait until the head's engine answers its readiness path."""
    import asyncio
    import shlex

    from llmgw_cli.core.observe import journal
    from llmgw_cli.polling import attempts
    from llmgw_cli.remote.execute import ready_status

    model = spec.model(replica.model)
    readiness = spec.profiles[model.profile].readiness
    subject = f"{replica.model}#{replica.replica}"
    quoted = shlex.quote(replica.unit)
    done = await asyncio.gather(
        *(conns.to(node).run(f"systemctl restart {quoted}", root=True) for node in replica.members)
    )
    for node, result in zip(replica.members, done, strict=True):
        if not result.ok:
            report.print(
                f"{subject}: restart on {node} failed: {journal.clean(result.stderr.strip())}", markup=False
            )
            return False
    head = replica.members[0]
    host = spec.node(head).engine_host
    began = time.monotonic()

    async def step() -> bool | None:
        status = await ready_status(conns.to(head), host, replica.port, readiness.path)
        return True if status == 200 else None

    ready = None
    async for _ in attempts(readiness.start_timeout, 0.5):
        if (ready := await step()) is not None:
            break
    took = time.monotonic() - began
    if ready:
        report.print(
            f"{subject}: restarted, ready on {head}:{replica.port} after {took:.1f}s",
            markup=False,
            soft_wrap=True,
        )
        return True
    report.print(
        f"{subject}: restarted, not ready after {took:.0f}s (see llmgw logs {subject})", markup=False
    )
    return False


def restart(
    ref: Reference,
    file: ClusterFile = DEFAULT_FILE,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Say which units would restart; change nothing.")
    ] = False,
) -> None:
    """Restart a replica's engines in place (systemctl restart on every member node), then
    wait until each answers its readiness check.

    In place: requests in flight on that replica are cut and it serves nothing until it is
    ready again. For a fresh replica beside the old one, first, use `llmgw apply --replace
    MODEL#N`. Exit code 1 when a replica is not ready within its profile's start_timeout.
    """
    from llmgw_cli.cli.common import stdout_console
    from llmgw_cli.cli.session import Session
    from llmgw_cli.core.observe import journal
    from llmgw_cli.errors import InputError

    spec = read_cluster(file)
    parsed = journal.parse_ref(spec, ref)
    out = stdout_console()
    with Session(spec, file.resolve().parent) as session:
        found = _replicas(spec, file, parsed, session)
        for r in found:
            out.print(
                f"~ {r.model}#{r.replica}: restart {r.unit} on {', '.join(r.members)}",
                markup=False,
                soft_wrap=True,
            )
        if dry_run:
            return
        if not yes:
            if not sys.stdin.isatty():
                raise InputError("not a terminal: pass --yes to restart without confirmation")
            typer.confirm("Restart these replicas in place?", abort=True)
        results = [session.run(_restart(spec, session.conns, r, out)) for r in found]
    if not all(results):
        raise typer.Exit(1)
