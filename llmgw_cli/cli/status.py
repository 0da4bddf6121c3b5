"""`llmgw status`: probe every node and show the fleet."""

from __future__ import annotations

import json as json_module
import sys
from typing import TYPE_CHECKING, Annotated

import typer

from llmgw_cli.cli.common import (
    DEFAULT_FILE,
    ClusterFile,
    NodesOption,
    chosen_nodes,
    probe_with_progress,
    read_cluster,
    stdout_console,
)
from llmgw_cli.errors import ExitCode

if TYPE_CHECKING:
    from collections.abc import Mapping

    from llmgw_cli.cli.session import Session
    from llmgw_cli.core.clusterfile.spec import ClusterSpec
    from llmgw_cli.core.observe.facts import NodeFacts
    from llmgw_cli.core.planning.cordon import Cordon
    from llmgw_cli.core.planning.plan import Answers
    from llmgw_cli.core.views.summary import EngineLoad


def status(
    file: ClusterFile = DEFAULT_FILE,
    nodes: NodesOption = None,
    json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON, for scripts.")] = False,
) -> None:
    """Probe every node over SSH and show nodes, GPUs by class, fabrics, models and each
    replica's state (ready, starting, crash-looping, failed, stopped), with the queue and
    KV-cache use its engine reports (— where it could not be read).

    With --nodes, only those nodes are probed and shown, with what runs on them.
    Unreachable nodes are listed with the reason. Exit code 1 when a model has fewer ready
    replicas than its min (not with --nodes: a part of the fleet is no shortfall), else 0,
    even when some nodes fail: the table says which; use --json to act on it in scripts.
    """
    from rich.console import Console

    from llmgw_cli.cli.session import Session
    from llmgw_cli.cli.views import status_view
    from llmgw_cli.core.views.summary import summarize

    spec = read_cluster(file)
    chosen = chosen_nodes(spec, nodes, file)  # a wrong name stops here, before any probe
    with Session(spec, file.resolve().parent) as session:
        snapshot = probe_with_progress(spec, file, chosen, Console(stderr=True), session)
        facts = {f.node: f for f in snapshot.nodes}
        answers, journal, loads = session.run(_health(spec, session, facts))
        listed = _cordons(spec, session, chosen)
    summary = summarize(spec, facts, scope=chosen, answers=answers, journal=journal, loads=loads)
    if json:
        report = {"probe_seconds": round(snapshot.seconds, 3), **summary.model_dump(mode="json")}
        report["cordons"] = [c.as_dict() for c in listed]
        sys.stdout.write(json_module.dumps(report, indent=2) + "\n")
    else:
        stdout_console().print(status_view(summary, snapshot.seconds))
        if listed:
            import time

            from llmgw_cli.cli.cordon_steps import cordons_view

            stdout_console().print(cordons_view(listed, time.time()))
    if chosen is None and any(m.short for m in summary.models):
        raise typer.Exit(ExitCode.failed)


def _cordons(spec: ClusterSpec, session: Session, chosen: list[str] | None) -> list[Cordon]:
    """The cordoned and draining nodes (the cluster file's and the store's), of ``chosen``
    only when given; a store that cannot be read is said on stderr."""
    from rich.console import Console
    from rich.text import Text

    from llmgw_cli.cli.cordon_steps import stored_cordons_in
    from llmgw_cli.core.planning.cordon import all_cordons

    stored, warning = stored_cordons_in(spec, session)
    if warning:
        Console(stderr=True).print(Text(warning, style="yellow"), soft_wrap=True)
    return [c for c in all_cordons(spec, stored) if chosen is None or c.node in chosen]


async def _health(
    spec: ClusterSpec, session: Session, facts: dict[str, NodeFacts]
) -> tuple[Answers, dict[tuple[str, int], str], dict[tuple[str, int], EngineLoad]]:
    """What the probe cannot say (``remote/replica_health.py``): the health checks of the
    replicas still starting, the last journal line of those not ready, and the load the
    engines of those ready report on their /metrics."""
    import asyncio

    from llmgw_cli.core.observe.health import ReplicaState
    from llmgw_cli.core.planning.plan import running_replicas
    from llmgw_cli.remote.replica_health import engine_pages, health_answers, last_lines

    answers = await health_answers(spec, session.conns, facts)
    replicas = running_replicas(facts)
    ailing = [r for r in replicas if not r.health(answers.get((r.model, r.replica))).alive]
    ready = [  # on a head node probed here (--nodes: no other node is reached)
        r
        for r in replicas
        if r.members[:1]
        and r.members[0] in facts
        and r.health(answers.get((r.model, r.replica))) is ReplicaState.ready
    ]
    journal, pages = await asyncio.gather(
        last_lines(session.conns, ailing), engine_pages(spec, session.conns, ready)
    )
    return answers, journal, engine_loads(spec, pages)


def engine_loads(
    spec: ClusterSpec, pages: Mapping[tuple[str, int], str]
) -> dict[tuple[str, int], EngineLoad]:
    """(model, replica) -> its load read from its engine's /metrics ``pages`` just now; a
    page that gives no signal (an engine kind not known, a mangled page) is left out: unknown."""
    import math

    from llmgw_cli.core.serving.engine_signals import Signals
    from llmgw_cli.core.views.summary import engine_load
    from llmgw_cli.gateway.serving.engine_scrape import parse_signals

    models = {m.name: m for m in spec.models}
    loads = {}
    for (model, replica), page in pages.items():
        if model not in models:
            continue
        signals = parse_signals(spec.profiles[models[model].profile].engine.value, page)
        if signals != Signals():
            loads[(model, replica)] = engine_load(signals, 0.0, math.inf)
    return loads
