"""The weights a plan's new replicas need, brought onto their nodes before their units
start: single files (``remote/fetch.py``) and whole repository snapshots
(``remote/snapshot_fetch.py``), each from its origin once per fabric; a path source is
not brought but checked on each node (``core/weights/path_sources.py``), and so is each unit's
engine program (``core/engine/engine_programs.py``)."""

from __future__ import annotations

import asyncio
import os

from llmgw_cli.core.clusterfile.spec import Adapter, ClusterSpec
from llmgw_cli.core.engine import engine_programs
from llmgw_cli.core.planning.plan import Plan
from llmgw_cli.core.serving.adapters import adapter_needs
from llmgw_cli.core.weights.fetch import Peers, plan_fetch, plan_weights
from llmgw_cli.core.weights.path_sources import checks_for
from llmgw_cli.core.weights.snapshot import DEFAULT_ENDPOINT, Selection, Snapshot
from llmgw_cli.errors import HubError, NodeError
from llmgw_cli.progress import Report
from llmgw_cli.remote.connect import Connections
from llmgw_cli.remote.fetch import Fetcher, FetchResult, _progress_lines, held_on_nodes
from llmgw_cli.remote.snapshot_fetch import bring_snapshots


async def ensure_for_plan(
    spec: ClusterSpec, plan: Plan, conns: Connections, report: Report, *, by_model: bool = False
) -> dict[str, str]:
    """Bring the weights of every replica the plan starts onto its nodes, before its units
    start: URL-sourced files and repository snapshots are fetched, path sources are checked
    on each node (a non-empty file or folder, ``core/weights/path_sources.py``). Returns node ->
    why its weights could not be brought (``weights of M: ...``). ``by_model``: progress
    lines about the least advanced node of each model, not one row per node
    (``_progress_lines``). A node whose engine account may not run a unit's engine
    program, or whose unit's sandbox hides it, fails too (``engine of M: ...``)."""
    need = plan_weights(spec, plan)
    checks = engine_programs.program_checks(plan)
    adapters = adapter_needs(spec, plan)
    if not (need.files or need.repos or need.paths or checks or adapters):
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
        failed = await check_programs(fetcher, checks)
        results: list[FetchResult] = []
        if need.paths:
            results += await fetcher.check_paths(checks_for(spec, need.paths))
        if need.files:
            held = await held_on_nodes(fetcher, spec, need.files)
            results += await fetcher.run(plan_fetch(spec, need.files, held, set(), Peers.fabric))
        if need.repos:
            results += await _bring_repositories(fetcher, spec, need.repos, token, endpoint)
        if adapters:
            results += await _bring_adapters(fetcher, spec, adapters, token, endpoint)
    finally:
        await fetcher.close()
    for r in results:
        if not r.ok:
            failed.setdefault(r.node, f"weights of {r.model}: {r.message}")
    return failed


async def _bring_repositories(
    fetcher: Fetcher, spec: ClusterSpec, repos: dict[str, list[str]], token: str | None, endpoint: str | None
) -> list[FetchResult]:
    """The snapshots of the repository models in ``repos`` onto their nodes; a model whose
    files the Hub cannot list fails on each of its nodes, with the Hub's reason."""
    from llmgw_cli.remote.hub import resolve  # noqa: PLC0415 (huggingface_hub: only to fetch)

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


async def _bring_adapters(
    fetcher: Fetcher,
    spec: ClusterSpec,
    adapters: dict[str, tuple[Adapter, list[str]]],
    token: str | None,
    endpoint: str | None,
) -> list[FetchResult]:
    """The snapshots of repo id adapters (each at its commit, llmgw's default files) onto
    the nodes of their models, as a repository model's are (``_bring_repositories``)."""
    from llmgw_cli.remote.hub import resolve  # noqa: PLC0415 (huggingface_hub: only to fetch)

    hub = endpoint or DEFAULT_ENDPOINT
    snapshots: dict[str, Snapshot] = {}
    results: list[FetchResult] = []
    for name, (adapter, nodes) in adapters.items():
        ref = adapter.repo_ref
        assert ref is not None
        try:
            snapshots[name] = await asyncio.to_thread(resolve, ref, token, hub, Selection())
        except HubError as exc:
            results += [fetcher.fail(name, n, "origin", str(exc), exc.kind) for n in nodes]
    found = {name: nodes for name, (_, nodes) in adapters.items() if name in snapshots}
    if found:
        results += await bring_snapshots(fetcher, spec, found, snapshots, endpoint=hub, token=token)
    return results


async def check_programs(
    fetcher: Fetcher, checks: tuple[engine_programs.ProgramCheck, ...]
) -> dict[str, str]:
    """node -> why a unit's engine account may not run its engine program there
    (``engine of M: ...``), one question per node, all nodes at once."""
    asked = engine_programs.by_node(checks)
    found = await asyncio.gather(*(fetcher.ask_exists(n, words) for n, words in asked.items()))
    answers = dict(zip(asked, found, strict=True))
    failed: dict[str, str] = {}
    for c in checks:
        answer = answers.get(c.node, {})
        if isinstance(answer, NodeError):
            failed.setdefault(c.node, f"engine of {c.model}: cannot check {c.program}: {answer.reason}")
        elif why := engine_programs.judge(answer, c):
            failed.setdefault(c.node, f"engine of {c.model} on {c.node}: {why}")
    return failed
