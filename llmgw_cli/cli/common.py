"""What the commands share: the -f and --nodes options, reading the cluster file, probing
the nodes with a progress bar, the gateway's store, and the console the results go to.

Every command imports what it needs when it runs, not when ``llmgw`` starts: this module
and the command modules import typer and the standard library only at their top, so
``llmgw --version`` or ``llmgw validate`` never load SSH, HTTP or the gateway's server.
The modules whose functions typer reads at every start (the commands and their options)
do without ``from __future__ import annotations``: typer would evaluate each annotation's
text again; there, a type known only to the type checker is written in quotes."""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer

from llmgw_cli.errors import InputError, UsageError

if TYPE_CHECKING:
    from rich.console import Console

    from llmgw_cli.cli.session import Session
    from llmgw_cli.core.clusterfile.spec import ClusterSpec
    from llmgw_cli.gateway.store.sqlite import Store
    from llmgw_cli.progress import Report
    from llmgw_cli.remote.probe import Snapshot

T = TypeVar("T")

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

NodesOption = Annotated[
    str | None, typer.Option("--nodes", help="Comma-separated node names (default: every node).")
]

StoreDir = Annotated[
    Path | None,
    typer.Option(
        "--store-dir",
        hidden=True,
        help="The SQLite store in this folder of this host (what llmgw runs on the gateway host).",
    ),
]


def read_cluster(path: Path) -> ClusterSpec:
    """Read and validate a cluster file; every problem is raised at once as a SpecError."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise InputError(f"{path}: no such file (give the cluster file with -f FILE)") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc}") from None
    from llmgw_cli.core.clusterfile.load import parse_cluster

    # Bytes, not text: a byte that is not UTF-8 is reported at its line and column.
    return parse_cluster(data, str(path))


def chosen_nodes(spec: ClusterSpec, nodes: str | None, file: Path) -> list[str] | None:
    """The nodes ``--nodes`` names, in its order (None: the option was not given, every
    node), checked against the cluster file before anything is probed. A name the file
    does not declare, or an option that names none, is a UsageError that says which nodes
    the file has, and the one meant where a name is close to a declared one."""
    if nodes is None:
        return None
    declared = [n.name for n in spec.nodes]
    chosen = list(dict.fromkeys(n.strip() for n in nodes.split(",") if n.strip()))
    if not chosen:
        raise UsageError(
            f"--nodes {nodes!r} names no node: give names separated by commas, from {_some(declared)} "
            "(or leave --nodes out for every node)"
        )
    unknown = [n for n in chosen if n not in declared]
    if unknown:
        raise UsageError(
            f"--nodes: {unknown_names('node', unknown, declared)} in {file}; its nodes are {_some(declared)}"
        )
    return chosen


def unknown_names(what: str, unknown: list[str], known: list[str]) -> str:
    """``no node nod01 (did you mean node01?), x``: each unknown name, with the known one
    it is closest to when one is close."""
    said = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=1)
        said.append(f"{name} (did you mean {close[0]}?)" if close else name)
    return f"no {what} {', '.join(said)}"


def _some(names: list[str], most: int = 12) -> str:
    """The names, or the first ``most`` of them and how many there are in all."""
    if len(names) <= most:
        return ", ".join(names)
    return f"{', '.join(names[:most])}, ... ({len(names)} in all)"


def confirm(question: str, *, yes: bool, to: str) -> None:
    """Go on when ``yes`` (``--yes``) or when the person at the terminal says so (the
    question on stderr: stdout holds what the command reports). Without a terminal nobody
    can answer: an InputError that says to pass ``--yes`` ``to`` do it."""
    if yes:
        return
    if not sys.stdin.isatty():
        raise InputError(f"not a terminal: pass --yes to {to} without confirmation")
    typer.confirm(question, abort=True, err=True)


def probe_with_progress(
    spec: ClusterSpec, file: Path, nodes: list[str] | None, console: Console, session: Session | None = None
) -> Snapshot:
    """Probe ``nodes`` (None: every node) with a live progress bar on ``console`` (hidden
    when it is not a terminal), through ``session``'s connections (kept for the command's
    next steps), or through connections of its own."""
    from llmgw_cli.cli.rendering import rendered, to_report
    from llmgw_cli.cli.session import Session
    from llmgw_cli.remote.probe import gather

    if session is None:
        with Session(spec, file.resolve().parent) as own:
            return probe_with_progress(spec, file, nodes, console, own)
    total = len([n for n in spec.nodes if nodes is None or n.name in nodes])
    with node_progress(console, "probing", total) as update:
        return session.run(
            rendered(lambda events: gather(spec, session.conns, nodes, events), to_report(update))
        )


@contextmanager
def node_progress(console: Console, doing: str, total: int) -> Iterator[Report]:
    """A progress bar on ``console`` for work on ``total`` nodes, drawn by the ``Report``
    given (the renderer of the work's events, ``cli/rendering.py``): a node counts once its
    phase is done or failed. Hidden when ``console`` is not
    a terminal, so scripts and logs see only the result."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from llmgw_cli.progress import Phase

    with Progress(
        TextColumn(doing, markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}", markup=False),  # node names and events, not markup
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    ) as bar:
        task = bar.add_task("", total=total)

        def update(node: str, message: str, phase: Phase = Phase.working, /) -> None:
            if phase is not Phase.working:
                bar.update(task, advance=1, description=f"{node} {message}")

        yield update


def stdout_console() -> Console:
    """The console for a command's tables: the terminal's width, or 160 columns when the
    output is piped (a log, a pager) and $COLUMNS does not say, instead of rich's 80."""
    from rich.console import Console

    width = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 160
    return Console(width=width)


def with_store(spec: ClusterSpec, call: Callable[[Store], Awaitable[T]]) -> T:
    """``call`` on the store the cluster file names, opened and closed around it."""
    import asyncio

    from llmgw_cli.gateway.store.sqlite import open_store

    async def run() -> T:
        store = open_store(spec)
        try:
            return await call(store)
        finally:
            await store.close()

    return asyncio.run(run())
