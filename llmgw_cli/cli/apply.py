"""`llmgw plan` and `llmgw apply`: their options and help. The steps they take
(``cli/apply_steps.py``) are imported when one of them runs."""

from pathlib import Path
from typing import Annotated

import typer

from llmgw_cli.cli.common import DEFAULT_FILE, ClusterFile

REPLACE_HELP = (
    "Replace this running replica (MODEL#N, as `llmgw status` and the plan name it) even "
    "though it is unchanged: its successor starts first when cards are free. Repeatable."
)
ALLOW_DOWNTIME_HELP = (
    "Carry out replacements that leave a model with no serving replica for its load time "
    "(no free cards to start the new replica first). Without it apply refuses such a plan "
    "before changing anything."
)


def plan(
    file: ClusterFile = DEFAULT_FILE,
    save: Annotated[
        Path | None, typer.Option("--out", "-o", help="Save the plan as JSON for `apply PLAN`.")
    ] = None,
    replace: Annotated[
        list[str] | None, typer.Option("--replace", metavar="MODEL#N", help=REPLACE_HELP)
    ] = None,
    json_out: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Print the plan as JSON (what --out saves, for scripts or `apply PLAN`); "
            "the rest goes to stderr.",
        ),
    ] = False,
) -> None:
    """Probe the nodes and show what `apply` would do, changing nothing."""
    from llmgw_cli.cli import apply_steps

    apply_steps.plan(file, save, replace or [], json_out=json_out)


def apply(
    saved: Annotated[Path | None, typer.Argument(help="A plan saved by `llmgw plan --out`.")] = None,
    *,
    file: ClusterFile = DEFAULT_FILE,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show the plan and stop.")] = False,
    replace: Annotated[
        list[str] | None, typer.Option("--replace", metavar="MODEL#N", help=REPLACE_HELP)
    ] = None,
    allow_downtime: Annotated[bool, typer.Option("--allow-downtime", help=ALLOW_DOWNTIME_HELP)] = False,
    wait: Annotated[bool, typer.Option(help="Wait until started replicas answer their health check.")] = True,
    rotate_engine_key: Annotated[
        bool,
        typer.Option(
            "--rotate-engine-key",
            help="Give every node a new engine key: the gateway holds old and new keys while "
            "every replica is replaced (its successor first, then the old one drained).",
        ),
    ] = False,
    lock_timeout: Annotated[
        float,
        typer.Option(
            "--lock-timeout",
            min=0,
            help="Seconds to wait for the cluster lock while the gateway (or another apply) "
            "starts or stops replicas.",
        ),
    ] = 600.0,
    no_lock: Annotated[
        bool,
        typer.Option(
            "--no-lock",
            help="Do not take the cluster lock on the gateway host (when it cannot be reached "
            "and no gateway starts replicas meanwhile).",
        ),
    ] = False,
) -> None:
    """Bring the nodes to the cluster file: start, replace and stop replicas, then wait for health.

    A second run changes nothing. Exit code 0 when everything applied and became ready,
    1 when something failed.

    With a saved PLAN (`llmgw plan --out`): refuses when its format is not this llmgw's
    or the cluster file changed since (as parsed: comments and layout do not count),
    saying what changed. When the nodes changed since (their facts, helpers, keys or
    gateway files), a plan is made now: if it changes nothing, the saved plan was carried
    out already and apply says "Nothing to do" (exit 0), else it refuses naming what
    changed. Otherwise it carries out exactly the saved plan's steps.

    A serving replica is replaced by rolling it: its successor starts first on free cards
    (a new replica number and port), and once the gateway routes it the old one is taken
    out of rotation, given up to `drain_timeout` to finish its requests, and stopped. With
    no free cards beside it, it is replaced in place; when that leaves its model with no
    serving replica the plan says so and apply refuses unless --allow-downtime is given.

    One writer at a time: after the confirmation, apply takes the cluster lock on every
    gateway host, in sorted order (in `gateway.state_dir`, also with `gateway.install:
    false`), probes again under it and shows the plan again if the nodes changed meanwhile.
    It holds the lock until its units are started, not during the readiness wait. A
    gateway host that cannot be reached is an error unless --no-lock is given.
    """
    from llmgw_cli.cli import apply_steps

    apply_steps.apply(
        saved,
        file=file,
        yes=yes,
        dry_run=dry_run,
        replace=replace or [],
        allow_downtime=allow_downtime,
        wait=wait,
        rotate_engine_key=rotate_engine_key,
        lock_timeout=lock_timeout,
        no_lock=no_lock,
    )
