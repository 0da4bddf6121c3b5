"""The weights a plan's new replicas need, brought onto their nodes before their units
start: single files (``remote/fetch.py``) and whole repository snapshots
(``remote/snapshot_fetch.py``), each from its origin once per fabric."""

from __future__ import annotations

import asyncio
import os

from llmgw_cli.core.fetch import Peers, plan_fetch
from llmgw_cli.core.plan import Plan
from llmgw_cli.core.snapshot import DEFAULT_ENDPOINT, Snapshot
from llmgw_cli.core.spec import ClusterSpec, SourceKind
from llmgw_cli.progress import Report
from llmgw_cli.remote.connect import Connections
from llmgw_cli.remote.fetch import Fetcher, FetchResult, _progress_lines, held_on_nodes
from llmgw_cli.remote.hub import HubError, resolve
from llmgw_cli.remote.snapshot_fetch import bring_snapshots


async def ensure_for_plan(
    spec: ClusterSpec, plan: Plan, conns: Connections, report: Report, *, by_model: bool = False
) -> dict[str, str]:
    """Fetch the URL-sourced weights of every replica the plan starts, onto its nodes,
    before its units start. Returns node -> why its weights could not be brought.
    ``by_model``: progress lines about the least advanced node of each model, not one row
    per node (``_progress_lines``)."""
    wanted: dict[str, list[str]] = {}
    repos: dict[str, list[str]] = {}
    for action in plan.changes:
        model = next((m for m in spec.models if m.name == action.model), None)
        if not action.write or model is None:
            continue
        into = wanted if model.source_kind is SourceKind.url else repos if model.selection else None
        if into is not None:
            nodes = into.setdefault(model.name, [])
            nodes += [n for n in action.nodes if n not in nodes]
    if not wanted and not repos:
        return {}
    token, endpoint = os.environ.get("HF_TOKEN"), os.environ.get("HF_ENDPOINT")
    fetcher = Fetcher(
        spec,
        conns.base,
        _progress_lines(report, by_model=by_model),
        token=token,
        hf_endpoint=endpoint,
        conns=conns,
    )
    try:
        results: list[FetchResult] = []
        if wanted:
            held = await held_on_nodes(fetcher, spec, wanted)
            results += await fetcher.run(plan_fetch(spec, wanted, held, set(), Peers.fabric))
        if repos:
            results += await _bring_repositories(fetcher, spec, repos, token, endpoint)
    finally:
        await fetcher.close()
    return {r.node: f"weights of {r.model}: {r.message}" for r in results if not r.ok}


async def _bring_repositories(
    fetcher: Fetcher, spec: ClusterSpec, repos: dict[str, list[str]], token: str | None, endpoint: str | None
) -> list[FetchResult]:
    """The snapshots of the repository models in ``repos`` onto their nodes; a model whose
    files the Hub cannot list fails on each of its nodes, with the Hub's reason."""
    hub = endpoint or DEFAULT_ENDPOINT
    snapshots: dict[str, Snapshot] = {}
    results: list[FetchResult] = []
    for name, nodes in repos.items():
        ref, selection = spec.model(name).repo_ref, spec.model(name).selection
        assert ref is not None
        try:  # the token goes to the Hub's endpoint only (remote/hub.py)
            snapshots[name] = await asyncio.to_thread(resolve, ref, token, hub, selection)
        except HubError as exc:
            results += [fetcher.fail(name, n, "origin", str(exc), exc.kind) for n in nodes]
    found = {n: nodes for n, nodes in repos.items() if n in snapshots}
    if found:
        results += await bring_snapshots(fetcher, spec, found, snapshots, endpoint=hub, token=token)
    return results
