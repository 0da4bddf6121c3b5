"""`llmgw plan` and `llmgw apply`: load -> gather -> plan -> view -> confirm -> execute."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.live import Live
from rich.text import Text

from llmgw_cli.cli.common import DEFAULT_FILE, ClusterFile, read_cluster
from llmgw_cli.cli.status import probe_with_progress
from llmgw_cli.cli.views import plan_view, progress_view
from llmgw_cli.core.plan import Plan, facts_digest, make_plan
from llmgw_cli.core.spec import ClusterSpec
from llmgw_cli.errors import InputError, LlmgwError
from llmgw_cli.remote.connect import transport_for
from llmgw_cli.remote.execute import Outcome, cluster_engine_key, execute
from llmgw_cli.remote.gateway_install import GatewayPreview, gateway_transport, install, preview

out = Console()
err = Console(stderr=True)


class ApplyFailed(LlmgwError):
    """Some node or replica failed; the others were applied."""


async def _execute_with_progress(
    spec: ClusterSpec,
    file: Path,
    chosen: Plan,
    *,
    wait: bool,
    gateway: GatewayPreview,
    unreachable: set[str],
) -> list[Outcome]:
    """Run the plan, then install the gateway, with a live table of nodes and replicas on
    a terminal, lines otherwise."""
    states: dict[str, str] = {}
    live = Live(console=err, transient=False, auto_refresh=False) if err.is_terminal else None

    def report(subject: str, message: str) -> None:
        states[subject] = message
        if live is None:
            # Messages carry node output (journal tails): printed as text, never as markup.
            err.print(Text(f"  {subject}: {message}"), highlight=False, soft_wrap=True)
        else:
            live.update(progress_view(states), refresh=True)

    base = file.resolve().parent

    async def run() -> list[Outcome]:
        # Every node, not only those the plan touches: a node with no key yet must get the
        # one the others (and the gateway) already hold.
        transports = [transport_for(spec, n, base) for n in spec.nodes if n.name not in unreachable]
        if gateway.changes:
            transports.append(gateway_transport(spec, base))
        try:
            key = await cluster_engine_key(transports)
        finally:
            await asyncio.gather(*(t.close() for t in transports))
        outcomes = (
            await execute(spec, base, chosen, report, wait=wait, engine_key=key) if chosen.changes else []
        )
        if gateway.changes:
            outcomes.append(await install(spec, base, gateway, key, report))
        return outcomes

    if live is None:
        return await run()
    with live:
        return await run()


def _unplaced_is_failure(chosen: Plan) -> None:
    if chosen.unplaced:
        raise ApplyFailed(f"{len(chosen.unplaced)} replica(s) could not be placed; the plan above says why")


def plan(
    file: ClusterFile = DEFAULT_FILE,
    save: Annotated[
        Path | None, typer.Option("--out", "-o", help="Save the plan as JSON for `apply PLAN`.")
    ] = None,
) -> None:
    """Probe the nodes and show what `apply` would do, changing nothing."""
    spec = read_cluster(file)
    snapshot = probe_with_progress(spec, file, None, err)
    result = make_plan(spec, {f.node: f for f in snapshot.nodes})
    gateway = asyncio.run(preview(spec, file.resolve().parent, file.read_text(encoding="utf-8")))
    out.print(plan_view(result), soft_wrap=True)
    out.print(
        Text(gateway.describe(), style="yellow" if gateway.changes else "dim"),
        highlight=False,
        soft_wrap=True,
    )
    if save:
        save.write_text(result.model_dump_json(indent=2), encoding="utf-8")
        out.print(Text(f"Saved to {save}; apply it with: llmgw apply -f {file} {save}"), highlight=False)


def apply(
    saved: Annotated[Path | None, typer.Argument(help="A plan saved by `llmgw plan --out`.")] = None,
    file: ClusterFile = DEFAULT_FILE,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show the plan and stop.")] = False,
    wait: Annotated[bool, typer.Option(help="Wait until started replicas answer their health check.")] = True,
) -> None:
    """Bring the nodes to the cluster file: start, replace and stop replicas, then wait for health.

    A second run changes nothing. With a saved PLAN, refuses when the nodes changed since.
    Exit code 0 when everything applied and became ready, 1 when something failed.
    """
    spec = read_cluster(file)
    snapshot = probe_with_progress(spec, file, None, err)
    facts = {f.node: f for f in snapshot.nodes}
    if saved is not None:
        chosen = Plan.model_validate_json(saved.read_text(encoding="utf-8"))
        if chosen.facts_digest != facts_digest(facts):
            raise InputError(f"{saved}: the nodes changed since this plan was made; run `llmgw plan` again")
    else:
        chosen = make_plan(spec, facts)
    gateway = asyncio.run(preview(spec, file.resolve().parent, file.read_text(encoding="utf-8")))
    out.print(plan_view(chosen, show_unchanged=False), soft_wrap=True)
    out.print(
        Text(gateway.describe(), style="yellow" if gateway.changes else "dim"),
        highlight=False,
        soft_wrap=True,
    )
    unreachable = [f.node for f in snapshot.nodes if not f.reachable]
    if unreachable:
        err.print(Text(f"unreachable, left out: {', '.join(unreachable)}", style="yellow"))
    if dry_run:
        return
    if not chosen.changes and not gateway.changes:
        _unplaced_is_failure(chosen)
        return
    if not yes:
        if not sys.stdin.isatty():
            raise InputError("not a terminal: pass --yes to apply without confirmation")
        typer.confirm("Apply these changes?", abort=True)

    outcomes = asyncio.run(
        _execute_with_progress(spec, file, chosen, wait=wait, gateway=gateway, unreachable=set(unreachable))
    )
    failed = [o for o in outcomes if not o.ok]
    for o in failed:
        err.print(Text(f"FAILED {o.subject}: {o.message}", style="red"))
    if failed:
        raise ApplyFailed(f"{len(failed)} of {len(outcomes)} steps failed; fix them and run apply again")
    _unplaced_is_failure(chosen)
    done = f"Applied: {len(chosen.changes)} change(s), every started replica is ready."
    gateway_outcome = next((o for o in outcomes if o.subject == "gateway"), None)
    if gateway_outcome is not None:
        done += f" Gateway: {gateway_outcome.message}."
    out.print(Text(done, style="green"), soft_wrap=True)
