"""The steps of `llmgw fetch` (``cli/fetch.py`` declares its options): load -> probe ->
plan -> fetch -> report. Imported when it runs."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from llmgw_cli.cli.common import chosen_nodes, probe_with_progress, read_cluster, unknown_names
from llmgw_cli.cli.views import fetch_results_view, plain
from llmgw_cli.core.fetch import FetchPlan, Peers, held_in_facts, plan_fetch, select
from llmgw_cli.core.spec import ClusterSpec
from llmgw_cli.errors import FetchFailed, UsageError
from llmgw_cli.remote.connect import Connections, Session
from llmgw_cli.remote.fetch import Fetcher, FetchEvent, FetchResult, verified

out = Console()
err = Console(stderr=True)


async def _run(
    spec: ClusterSpec,
    conns: Connections,
    plan_for: Callable[[set[tuple[str, str]]], FetchPlan],
    held: set[tuple[str, str]],
    token: str | None,
) -> tuple[FetchPlan, list[FetchResult]]:
    """Check the held files of models that pin a sha256 (a file that does not match is
    fetched again), then run the plan with one progress bar per (model, node) on a
    terminal, lines otherwise."""
    bars = Progress(
        # Model and node names, and states holding remote error text: never markup.
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[state]}", markup=False),
        console=err,
        disable=not err.is_terminal,
    )
    tasks: dict[tuple[str, str], TaskID] = {}
    last: dict[tuple[str, str], str] = {}

    def on_event(e: FetchEvent) -> None:
        key = (e.model, e.node)
        where = "origin" if e.source == "origin" else f"from {e.source}"
        state = f"{e.state} ({where})" + (f": {e.message}" if e.message else "")
        if key not in tasks:
            tasks[key] = bars.add_task(f"{e.model} -> {e.node}", total=None, state=state)
        bars.update(tasks[key], completed=e.bytes, total=e.total, state=state)
        if not err.is_terminal and last.get(key) != state:
            err.print(plain(f"  {e.model} -> {e.node}: {state}"), highlight=False)
        last[key] = state

    fetcher = Fetcher(
        spec, conns.base, on_event, token=token, hf_endpoint=os.environ.get("HF_ENDPOINT"), conns=conns
    )
    plan = plan_for(await verified(fetcher, spec, held))
    with bars:
        return plan, await fetcher.run(plan)


def fetch(models: list[str], file: Path, nodes: str | None, peers: Peers, token_env: str) -> None:
    """``llmgw fetch`` (its help says what it does)."""
    spec = read_cluster(file)
    # wrong names stop here, before any node is probed
    chosen = chosen_nodes(spec, nodes, file)
    known = [m.name for m in spec.models]
    unknown = [m for m in models if m not in known]
    if unknown:
        raise UsageError(f"{unknown_names('model', unknown, known)} in {file}")
    # One session: the probe's connections carry the fetch jobs too.
    with Session(spec, file.resolve().parent) as session:
        snapshot = probe_with_progress(spec, file, None, err, session)
        facts = {f.node: f for f in snapshot.nodes}
        try:
            wanted = select(spec, facts, models or None, chosen)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        unreachable = {f.node for f in snapshot.nodes if not f.reachable}
        plan, results = session.run(
            _run(
                spec,
                session.conns,
                lambda held: plan_fetch(spec, wanted, held, unreachable, peers),
                held_in_facts(spec, facts),
                os.environ.get(token_env) or None,
            )
        )
    out.print(fetch_results_view(plan, results), soft_wrap=True)
    failed = [r for r in results if not r.ok] + [s for s in plan.skipped if s.reason == "unreachable"]
    if failed:
        raise FetchFailed(f"{len(failed)} of {len(results) + len(plan.skipped)} model/node pairs failed")
    if not results and not plan.skipped:
        out.print("Nothing to fetch: no model with an https source is wanted on these nodes.")
