"""The steps of `llmgw fetch` (``cli/fetch.py`` declares its options): load -> probe ->
plan -> fetch -> report. Imported when it runs."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
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

from llmgw_cli.cli.common import chosen_nodes, confirm, probe_with_progress, read_cluster, unknown_names
from llmgw_cli.cli.repos import pinned
from llmgw_cli.cli.session import Session
from llmgw_cli.cli.views import fetch_plan_view, fetch_results_view, plain
from llmgw_cli.core.weights.fetch import FetchPlan, Peers, held_in_facts, plan_fetch, plan_report, select
from llmgw_cli.core.weights.snapshot import Snapshot
from llmgw_cli.errors import FetchFailed, UsageError
from llmgw_cli.progress import FetchEvent
from llmgw_cli.remote.fetch import Fetcher, FetchResult, verified

out = Console()
err = Console(stderr=True)


def _progress() -> tuple[Progress, Callable[[FetchEvent], None]]:
    """One progress bar per (model, node) on a terminal, lines otherwise; and what the
    fetcher calls with each event."""
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
        files = f": {e.files or 0}/{e.files_total} files" if e.files_total is not None else ""
        state = f"{e.state} ({where}){files}" + (f": {e.message}" if e.message else "")
        if key not in tasks:
            tasks[key] = bars.add_task(f"{e.model} -> {e.node}", total=None, state=state)
        bars.update(tasks[key], completed=e.bytes, total=e.total, state=state)
        if not err.is_terminal and last.get(key) != state:
            err.print(plain(f"  {e.model} -> {e.node}: {state}"), highlight=False)
        last[key] = state

    return bars, on_event


async def _run(
    fetcher: Fetcher,
    plan: FetchPlan,
    bars: Progress,
    *,
    repositories: dict[str, Snapshot],
    peers: Peers,
    token: str | None,
) -> list[FetchResult]:
    """The files, and the repositories' snapshots beside them."""
    from llmgw_cli.remote.snapshot_fetch import bring_snapshots

    wanted = {r.model: list(r.nodes) for r in plan.repos}
    endpoint = os.environ.get("HF_ENDPOINT") or None
    with bars:
        files, snapshots = await asyncio.gather(
            fetcher.run(plan),
            bring_snapshots(
                fetcher,
                fetcher.spec,
                wanted,
                repositories,
                peers=peers,
                endpoint=endpoint,
                token=token,
            ),
        )
    return files + snapshots


def fetch(
    models: list[str],
    file: Path,
    nodes: str | None,
    peers: Peers,
    token_env: str,
    *,
    dry_run: bool = False,
    yes: bool = False,
    json_out: bool = False,
) -> None:
    """``llmgw fetch`` (its help says what it does)."""
    spec, repositories = pinned(read_cluster(file), err, token_env)
    # wrong names stop here, before any node is probed
    chosen = chosen_nodes(spec, nodes, file)
    known = [m.name for m in spec.models]
    unknown = [m for m in models if m not in known]
    if unknown:
        raise UsageError(f"{unknown_names('model', unknown, known)} in {file}")
    said = err if json_out else out
    # One session: the probe's connections carry the fetch jobs too.
    with Session(spec, file.resolve().parent) as session:
        snapshot = probe_with_progress(spec, file, None, err, session)
        facts = {f.node: f for f in snapshot.nodes}
        try:
            wanted = select(spec, facts, models or None, chosen)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        unreachable = {f.node for f in snapshot.nodes if not f.reachable}
        bars, on_event = _progress()
        token = os.environ.get(token_env) or None
        fetcher = Fetcher(
            spec,
            session.conns.base,
            on_event,
            token=token,
            hf_endpoint=os.environ.get("HF_ENDPOINT"),
            conns=session.conns,
        )
        # The held files of models that pin a sha256 are checked first (reading only): a
        # file that does not match is fetched again, and the dry run shows that too.
        held = session.run(verified(fetcher, spec, held_in_facts(spec, facts)))
        plan = plan_fetch(spec, wanted, held, unreachable, peers)
        if dry_run:
            if json_out:
                sys.stdout.write(json.dumps(plan_report(plan), indent=2) + "\n")
            else:
                out.print(fetch_plan_view(plan), soft_wrap=True)
            return
        if plan.spreads or plan.repos:
            said.print(fetch_plan_view(plan), soft_wrap=True)
            confirm("Fetch these weights?", yes=yes, to="fetch")
        results = session.run(_run(fetcher, plan, bars, repositories=repositories, peers=peers, token=token))
    if json_out:
        report = {"results": [dataclasses.asdict(r) for r in results], **plan_report(plan)}
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        out.print(fetch_results_view(plan, results), soft_wrap=True)
    failed = [r for r in results if not r.ok] + [s for s in plan.skipped if s.reason == "unreachable"]
    if failed:
        raise FetchFailed(f"{len(failed)} of {len(results) + len(plan.skipped)} model/node pairs failed")
    if not results and not plan.skipped:
        said.print(
            "Nothing to fetch: no model with an https source or a fetched repository is wanted on these nodes."
        )
