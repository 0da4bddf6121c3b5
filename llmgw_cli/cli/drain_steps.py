"""The steps of `llmgw drain` (``cli/cordon.py`` declares its options): probe, plan the
moves (``core/planning/cordon.py``), refuse or show, cordon the node as draining, take the
cluster lock, probe and plan again under it, carry the moves out through apply's
executor (successor first, routed by every gateway, then the old replica drained and
stopped: ``remote/rollout.py``), mark the node drained. Imported when it runs."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.text import Text

from llmgw_cli.cli.apply_steps import _take_lock, _with_progress
from llmgw_cli.cli.common import probe_with_progress, read_cluster
from llmgw_cli.cli.cordon_steps import caller, checked_node, stored_cordons_in, write_cordon_in
from llmgw_cli.cli.repos import pinned
from llmgw_cli.cli.session import Session
from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.observe.facts import NodeFacts
from llmgw_cli.core.planning.cordon import DrainPlan, cordoned_nodes, drain_plan
from llmgw_cli.errors import ApplyFailed, DowntimeRefused, LockTimeout, NodeError
from llmgw_cli.progress import Events
from llmgw_cli.remote.cluster_lock import LockTerms
from llmgw_cli.remote.execute import Outcome
from llmgw_cli.remote.executor import one_plan
from llmgw_cli.remote.rollout import apply_executor, carry_out

out = Console()
err = Console(stderr=True)


def _planned(
    spec: ClusterSpec, file: Path, session: Session, node: str
) -> tuple[DrainPlan, dict[str, NodeFacts]]:
    """The drain plan on a probe made now, around the other nodes' cordons, and the facts."""
    snapshot = probe_with_progress(spec, file, None, err, session)
    facts = {f.node: f for f in snapshot.nodes}
    if node not in facts or not facts[node].reachable:
        why = facts[node].error if node in facts else "not probed"
        raise ApplyFailed(f"{node} cannot be reached ({why}): its replicas cannot be moved by llmgw")
    stored, warning = stored_cordons_in(spec, session)
    if warning:
        raise ApplyFailed(f"{warning}; nothing was changed")
    return drain_plan(spec, facts, node, cordoned_nodes(spec, stored)), facts


def moves_text(planned: DrainPlan) -> Text:
    """One line per replica the drain moves or stops, then the refusals."""
    text = Text()
    if not planned.moves:
        text.append(f"{planned.node} runs no replica: nothing to move\n")
    for m in planned.moves:
        where = f"-> {','.join(m.to)} as #{m.successor}" if m.to else "stopped"
        text.append(f"  {m.model}#{m.replica} on {','.join(m.nodes)} {where}  ({m.reason})\n")
    for refusal in planned.refusals:
        text.append(f"  ! {refusal}\n", style="red")
    return text


def _refuse(planned: DrainPlan, allowed: bool) -> None:
    if planned.refusals and not allowed:
        raise DowntimeRefused(
            f"draining {planned.node}: {'; '.join(planned.refusals)}. Nothing was changed: free cards"
            " of that class on another node (or uncordon one), or pass --allow-downtime to stop the"
            " replica anyway"
        )


def _said(planned: DrainPlan, json_out: bool, **extra: object) -> None:
    if json_out:
        sys.stdout.write(json.dumps({**planned.as_dict(), **extra}, indent=1) + "\n")
    else:
        out.print(moves_text(planned), end="", soft_wrap=True)


def drain(
    file: Path,
    node: str,
    *,
    allow_downtime: bool,
    dry_run: bool,
    json_out: bool,
    lock_timeout: float,
) -> None:
    """``llmgw drain`` (its help says what it does)."""
    began = time.monotonic()
    spec, _ = pinned(read_cluster(file), err)
    checked_node(spec, node)
    with Session(spec, file.resolve().parent) as session:
        planned, _ = _planned(spec, file, session, node)
        if dry_run:
            _said(planned, json_out, dry_run=True)
            return
        if not json_out:
            out.print(moves_text(planned), end="", soft_wrap=True)
        _refuse(planned, allow_downtime)
        by = caller()
        write_cordon_in(spec, session, node, reason=None, by=by, draining=True)
        try:
            outcomes = _carried_out(
                spec, file, session, node, allowed=allow_downtime, lock_timeout=lock_timeout
            )
        except DowntimeRefused:  # the nodes changed since the first plan: nothing was moved
            write_cordon_in(spec, session, node, reason=None, by=by, draining=False)
            raise
        failed = [o for o in outcomes if not o.ok]
        for o in failed:
            err.print(Text(f"FAILED {o.subject}: {o.message}", style="red"))
        if failed:
            raise ApplyFailed(
                f"draining {node}: {len(failed)} of {len(outcomes)} steps failed; it stays cordoned"
                " (draining): fix them and run llmgw drain again"
            )
        write_cordon_in(spec, session, node, reason=None, by=by, draining=False)
    seconds = time.monotonic() - began
    if json_out:
        _said(planned, True, seconds=round(seconds, 3), drained=True)
    else:
        out.print(
            Text(
                f"Drained {node} in {seconds:.1f}s: it stays cordoned (llmgw uncordon {node})", style="green"
            )
        )


def _carried_out(
    spec: ClusterSpec, file: Path, session: Session, node: str, *, allowed: bool, lock_timeout: float
) -> list[Outcome]:
    """Under the cluster lock: probe and plan again (the node is cordoned now, so no
    gateway puts anything new there), refuse as before, then the moves; the lock is given
    back once the plain stops are done, and each move's write step takes it again."""
    terms = LockTerms(lock_timeout, f"draining {node}")
    try:
        held = session.run(_take_lock(spec, session.conns, terms))
    except LockTimeout as exc:
        raise ApplyFailed(f"{exc}; {node} is cordoned, nothing was moved: run llmgw drain again") from None
    except NodeError as exc:
        raise ApplyFailed(f"cannot take the cluster lock: {exc.reason}") from None
    try:
        planned, facts = _planned(spec, file, session, node)
        _refuse(planned, allowed)
    except BaseException:
        session.run(held.release())
        raise

    async def run(report: Events) -> list[Outcome]:
        # the moves through apply's path; then the replicas with nowhere to go, each
        # drained before it stops (apply's plain stops are not: their models are gone)
        taking = replace(terms, on_wait=report.note)
        executor = apply_executor(
            spec, session.conns, report, take_lock=taking, engine_keys=None, fetch=True, gateways=None
        )
        moves = one_plan([a for a in planned.plan.changes if a.op == "~"], planned.plan.facts_digest)
        done = await carry_out(
            spec,
            session.conns,
            moves,
            report,
            facts=facts,
            lock=held,
            take_lock=taking,
            engine_keys=None,
            executor=executor,
        )
        for stop in (a for a in planned.plan.changes if a.op == "-"):
            done += await executor.retire(stop)
        return done

    if not planned.plan.changes:
        session.run(held.release())
        return []
    return session.run(_with_progress(run))
