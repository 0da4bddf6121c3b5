"""The steps of `llmgw plan` and `llmgw apply` (``cli/apply.py`` declares their options):
load -> gather -> plan -> view -> confirm -> execute. Imported when one of them runs."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

import typer
from rich.console import Console
from rich.live import Live
from rich.text import Text

from llmgw_cli.cli import host_steps
from llmgw_cli.cli.common import confirm, probe_with_progress, read_cluster
from llmgw_cli.cli.rendering import rendered
from llmgw_cli.cli.repos import gateway_pins, pinned
from llmgw_cli.cli.session import Session
from llmgw_cli.cli.views import plan_view, progress_line, progress_view
from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.engine.flag_check import check_flags
from llmgw_cli.core.observe.facts import NodeFacts
from llmgw_cli.core.observe.journal import split_ref
from llmgw_cli.core.planning.plan import Plan, facts_digest, make_plan, running_replicas
from llmgw_cli.core.planning.steps import HostFacts
from llmgw_cli.core.planning.whole_plan import has_work, remade, whole
from llmgw_cli.core.serving.adapters import adapter_needs
from llmgw_cli.core.weights.pins import moved, pinned_commits
from llmgw_cli.errors import (
    ApplyFailed,
    DowntimeRefused,
    InputError,
    LockTimeout,
    NodeError,
    SpecError,
    UsageError,
)
from llmgw_cli.progress import Board, Event, Events, Note
from llmgw_cli.remote.apply_host import ApplyHost
from llmgw_cli.remote.cluster_lock import ApplyHold, LockTerms, take_for_apply
from llmgw_cli.remote.connect import Connections
from llmgw_cli.remote.engine_keys import (
    nodes_without_key,
    rotation_plan,
)
from llmgw_cli.remote.execute import NOT_READY, Outcome
from llmgw_cli.remote.gateway_install import GatewayPreviews, preview
from llmgw_cli.remote.node_setup import stale_nodes
from llmgw_cli.remote.probe import Snapshot
from llmgw_cli.remote.replica_health import health_answers, last_lines
from llmgw_cli.remote.rollout import apply_executor
from llmgw_cli.remote.weights import ensure_for_plan

T = TypeVar("T")
out = Console()
err = Console(stderr=True)


async def _execute_with_progress(
    spec: ClusterSpec,
    conns: Connections,
    chosen: Plan,
    *,
    wait: bool,
    gateway: GatewayPreviews,
    unreachable: set[str],
    facts: dict[str, NodeFacts],
    lock: ApplyHold | None = None,
    take_lock: LockTerms | None = None,
    fetched: dict[str, str] | None = None,
    allow_downtime: bool = False,
    cordoned: frozenset[str] = frozenset(),
) -> list[Outcome]:
    """Carry out the whole plan through the one executor (``Executor.whole``: node
    helpers, engine keys, replicas, gateway hosts, a key rotation), with a live table of
    nodes and replicas on a terminal, lines otherwise. ``lock`` (the cluster lock, held) is
    released once the units are written and started, before the readiness wait; the
    rolling replacements take it again for each of their write steps with ``take_lock``
    (None: ``--no-lock``). ``fetched``: the plan's weights were brought already (node ->
    why they could not be): the units go only where they are; None: the executor brings
    them first."""

    async def run(report: Events) -> list[Outcome]:
        terms = None if take_lock is None else replace(take_lock, on_wait=report.note)
        reachable = [n.name for n in spec.nodes if n.name not in unreachable]
        host = ApplyHost(
            spec=spec,
            conns=conns,
            plan=chosen,
            gateway=gateway,
            facts=facts,
            reachable=reachable,
            take_lock=terms,
            lock=lock,
            fetched=fetched,
            wait=wait,
            allow_downtime=allow_downtime,
            cordoned=cordoned,
        )
        executor = apply_executor(
            spec, conns, report, take_lock=terms, engine_keys=host.keys, fetch=fetched is None, gateways=None
        )
        return await executor.whole(chosen, host)

    return await _with_progress(run)


async def _with_progress(work: Callable[[Events], Awaitable[T]]) -> T:
    """``work(events)`` with a live table of nodes and replicas on a terminal (each with its
    elapsed time, counting while it is worked on), one line per event otherwise; a note
    (who holds the cluster lock) is a line of its own either way."""
    board = Board()
    # Redrawn twice a second besides each event, so a replica's clock runs through a
    # long engine load that reports nothing new.
    live = (
        Live(
            get_renderable=lambda: progress_view(board.rows, board.clock()),
            console=err,
            transient=False,
            refresh_per_second=2,
        )
        if err.is_terminal
        else None
    )

    def show(item: Event | Note) -> None:
        if isinstance(item, Note):
            _lock_waiting(item.text)
            return
        board(item.subject, item.message, item.phase)
        if live is None:
            # Messages carry node output (journal tails): printed as text, never as markup.
            err.print(progress_line(item.subject, board.rows[item.subject]), highlight=False, soft_wrap=True)
        else:
            live.refresh()

    with live or contextlib.nullcontext():
        return await rendered(work, show)


async def _fetch(spec: ClusterSpec, conns: Connections, chosen: Plan) -> dict[str, str]:
    """The weights of the replicas ``chosen`` starts (URL sources and repositories brought,
    path sources checked on their nodes), before apply takes the cluster lock, so the
    gateway's starts do not wait for a download."""
    return await _with_progress(lambda report: ensure_for_plan(spec, chosen, conns, report))


def flags_checked(spec: ClusterSpec, file: Path, facts: dict[str, NodeFacts], chosen: Plan) -> Plan:
    """``chosen`` with the warnings of the flag check (``core/engine/flag_check.py``); a flag the
    engine of some node would refuse is a SpecError at its ``args`` entry, before anything
    changes."""
    from llmgw_cli.core.clusterfile.load import locate

    report = check_flags(spec, facts, chosen)
    if report.problems:
        found = [(p.source, p.message) for p in report.problems]
        raise SpecError(locate(file.read_text(encoding="utf-8"), str(file), found))
    warnings = tuple(dict.fromkeys((*chosen.warnings, *report.warnings)))
    return chosen.model_copy(update={"warnings": warnings})


def _unplaced_is_failure(chosen: Plan) -> None:
    if chosen.unplaced:
        raise ApplyFailed(f"{len(chosen.unplaced)} replica(s) could not be placed; the plan above says why")


def replacements(values: list[str], facts: dict[str, NodeFacts]) -> frozenset[tuple[str, int]]:
    """``--replace MODEL#N`` values as (model, replica) pairs, each a replica that runs."""
    running = running_replicas(facts)
    found = {(r.model, r.replica) for r in running}
    pairs = set()
    for value in values:
        try:
            name, number = split_ref(value)
        except UsageError:
            number = None
        if number is None:  # a whole model is not one replica: --replace names one
            raise UsageError(f"--replace {value}: expected MODEL#N, a model and a replica number (e.g. m#0)")
        pair = (name, number)
        if pair not in found:
            runs = [f"{r.model}#{r.replica}" for r in running if r.model == name]
            what = (
                f"the replicas of {name} that run: {', '.join(runs)}"
                if runs
                else f"no replica of {name} runs"
            )
            raise InputError(f"--replace {value}: no such replica runs; {what} (see `llmgw status`)")
        pairs.add(pair)
    return frozenset(pairs)


def refuse_downtime(chosen: Plan, allowed: bool) -> None:
    """Stop before anything changes when the plan leaves a model with no serving replica
    and ``--allow-downtime`` was not given."""
    if chosen.downtime and not allowed:
        texts = "; ".join(chosen.downtime)
        raise DowntimeRefused(
            f"{texts}. Nothing was changed: free cards of that class (or add a node) so the new "
            "replica can start first, or pass --allow-downtime to accept the outage"
        )


@dataclass(frozen=True)
class Replan:
    """What apply does when the nodes changed between its plan and the cluster lock:
    ``saved`` (a saved plan is refused then), ``yes`` (go on with the new plan without
    asking), ``replace`` and ``allow_downtime`` (the new plan is made and judged as the
    first was), ``lock_timeout`` (how long to wait for the lock)."""

    saved: Path | None = None
    yes: bool = False
    lock_timeout: float = 600.0
    replace: frozenset[tuple[str, int]] = frozenset()
    allow_downtime: bool = False
    cordoned: frozenset[str] = frozenset()  # nodes that take no new replica


def _fetch_and_lock(
    spec: ClusterSpec, file: Path, session: Session, chosen: Plan, how: Replan
) -> tuple[Plan, Snapshot, ApplyHold, dict[str, str] | None]:
    """Bring the plan's weights, then take the cluster lock (``_locked``). The weights
    fetched (node -> why they could not be), or None when the plan was made again under
    the lock (the executor then brings its weights itself)."""
    fetched = session.run(_fetch(spec, session.conns, chosen))
    now, snapshot, held = _locked(spec, file, session, chosen, how)
    return now, snapshot, held, fetched if now is chosen else None


def _adapters_of_running_replicas(spec: ClusterSpec, session: Session, chosen: Plan) -> None:
    """A plan with nothing to change may still have adapters to bring: one added to a model
    whose replicas run replaces none of them. Their files are checked on the replicas'
    nodes and fetched where missing, as for a plan that starts replicas."""
    if not adapter_needs(spec, chosen):
        return
    failed = session.run(_fetch(spec, session.conns, chosen))
    if failed:
        lines = "; ".join(f"{node}: {why}" for node, why in sorted(failed.items()))
        raise ApplyFailed(f"adapters could not be brought onto their nodes: {lines}")


def _lock_waiting(message: str) -> None:
    """Said once while apply waits for the cluster lock: who holds it."""
    err.print(Text(message, style="yellow"), highlight=False, soft_wrap=True)


async def _take_lock(spec: ClusterSpec, conns: Connections, terms: LockTerms) -> ApplyHold:
    """The cluster lock for the whole apply, who holds it meanwhile said as it comes."""

    def said(item: Event | Note) -> None:
        if isinstance(item, Note):
            _lock_waiting(item.text)

    return await rendered(
        lambda events: take_for_apply(spec, conns, wait=terms.wait, why=terms.why, on_wait=events.note), said
    )


def _saved_still_holds(saved: Path, chosen: Plan, facts: dict[str, NodeFacts]) -> None:
    if chosen.facts_digest != facts_digest(facts):
        raise InputError(f"{saved}: the nodes changed since this plan was made; run `llmgw plan` again")


def _locked(
    spec: ClusterSpec, file: Path, session: Session, chosen: Plan, how: Replan
) -> tuple[Plan, Snapshot, ApplyHold]:
    """Take the cluster lock, probe again under it, and go on with ``chosen`` if the nodes
    did not change since it was made; else make the plan again and show it (with
    ``how.yes``, go on with it; otherwise release the lock and ask again). A plan made
    again that leaves a model with no serving replica is refused unless
    ``how.allow_downtime``."""
    saved = how.saved
    first = chosen
    while True:
        try:
            held = session.run(
                _take_lock(spec, session.conns, LockTerms(how.lock_timeout, f"applying {file.name}"))
            )
        except LockTimeout as exc:
            raise ApplyFailed(f"{exc}; nothing was changed, run apply again later") from None
        except NodeError as exc:
            # several hosts: the lock names the one it failed on
            host = spec.gateway.host if len(spec.gateway.all_hosts) == 1 else exc.node
            raise ApplyFailed(
                f"cannot take the cluster lock on the gateway host {host}: {exc.reason}. Fix that, "
                "or pass --no-lock when no gateway starts replicas meanwhile"
            ) from None
        try:
            snapshot = probe_with_progress(spec, file, None, err, session)
            facts = {f.node: f for f in snapshot.nodes}
            if facts_digest(facts) == chosen.facts_digest:
                return chosen, snapshot, held
            if saved is not None:
                _saved_still_holds(saved, chosen, facts)
            again = flags_checked(
                spec, file, facts, make_plan(spec, facts, replace=how.replace, cordoned=how.cordoned)
            )
            chosen = remade(spec, again, first)
            err.print(
                Text("The nodes changed since the plan above was made; the plan now:", style="yellow"),
                highlight=False,
            )
            out.print(plan_view(chosen, show_unchanged=False), soft_wrap=True)
            refuse_downtime(chosen, how.allow_downtime)
            if how.yes or not chosen.changes:
                return chosen, snapshot, held
        except BaseException:
            session.run(held.release())
            raise
        # never hold the lock while a person reads the plan
        session.run(held.release())
        typer.confirm("Apply these changes?", abort=True, err=True)


def plan(file: Path, save: Path | None, replace: list[str], *, json_out: bool = False) -> None:
    """``llmgw plan``: probe the nodes and show what `apply` would do, changing nothing.
    ``json_out``: the plan on stdout as ``--out`` saves it, the rest on stderr."""
    said = err if json_out else out
    as_written = read_cluster(file)
    spec, snapshots = pinned(as_written, err)
    with Session(spec, file.resolve().parent) as session:
        snapshot = probe_with_progress(spec, file, None, err, session)
        facts = {f.node: f for f in snapshot.nodes}
        answers = session.run(health_answers(spec, session.conns, facts))
        cordoned = _cordoned(spec, session)
        result = make_plan(
            spec, facts, replace=replacements(replace, facts), answers=answers, cordoned=cordoned
        )
        result = flags_checked(spec, file, facts, result)
        gateway = session.run(
            preview(
                spec, session.conns, file.read_text(encoding="utf-8"), gateway_pins(as_written, snapshots)
            )
        )
        result = whole(spec, result, facts, _gathered(spec, session, facts, gateway), written=as_written)
        if json_out:
            sys.stdout.write(result.model_dump_json(indent=2) + "\n")
        else:
            out.print(plan_view(result, journal=_journals(session, result, facts)), soft_wrap=True)
        host_steps.show(result, said)
    if save:
        save.write_text(result.model_dump_json(indent=2), encoding="utf-8")
        said.print(Text(f"Saved to {save}; apply it with: llmgw apply -f {file} {save}"), highlight=False)


def _journals(session: Session, chosen: Plan, facts: dict[str, NodeFacts]) -> dict[tuple[str, int], str]:
    """The last journal line of each replica ``chosen`` starts again because it is not
    ready nor starting, for its ``!`` line."""
    ailing = {(a.model, a.retire.replica) for a in chosen.actions if a.unhealthy and a.retire}
    found = [r for r in running_replicas(facts) if (r.model, r.replica) in ailing]
    return session.run(last_lines(session.conns, found)) if found else {}


def _choose(
    spec: ClusterSpec,
    facts: dict[str, NodeFacts],
    saved: Path | None,
    replace: list[str],
    session: Session | None = None,
    *,
    cordoned: frozenset[str] = frozenset(),
) -> tuple[Plan, frozenset[tuple[str, int]]]:
    """The plan to apply (the saved one, checked against the nodes, or a new one) and the
    replicas it was told to replace."""
    if saved is None:
        wanted = replacements(replace, facts)
        # the health checks of replicas still starting (``core/observe/health.py``)
        answers = session.run(health_answers(spec, session.conns, facts)) if session else {}
        return make_plan(spec, facts, replace=wanted, answers=answers, cordoned=cordoned), wanted
    _no_replace(replace)
    chosen = Plan.model_validate_json(saved.read_text(encoding="utf-8"))
    _saved_still_holds(saved, chosen, facts)
    changed = moved(chosen.commits, pinned_commits(spec))
    if changed:
        # its units would run the old commit while the gateway's pins say the new one
        raise InputError(
            f"{saved}: a repository moved since this plan was made ({'; '.join(changed)}); "
            "run `llmgw plan` again"
        )
    return chosen, frozenset()


def _gathered(
    spec: ClusterSpec, session: Session, facts: dict[str, NodeFacts], gateway: GatewayPreviews
) -> HostFacts:
    """What the host steps come from (``core/planning/steps.py``): the reachable nodes' helper and
    engine key, each gateway host's files."""
    reachable = [n.name for n in spec.nodes if n.name in facts and facts[n.name].reachable]
    stale = session.run(stale_nodes(spec, session.conns, reachable, facts))
    keyless = session.run(nodes_without_key(spec, session.conns, reachable, facts))
    missing = [n for n in stale if (a := facts[n].node_access) is not None and not a.digests]
    return HostFacts(
        stale_helper=tuple(stale),
        helper_missing=tuple(missing),
        keyless=tuple(keyless),
        gateways=host_steps.gateway_states(gateway),
    )


def _cordoned(spec: ClusterSpec, session: Session) -> frozenset[str]:
    """The nodes that take no new replica: the cluster file's cordons and the store's
    (``llmgw cordon``), read before placing; a store that cannot be read is said."""
    from llmgw_cli.cli.cordon_steps import stored_cordons_in
    from llmgw_cli.core.planning.cordon import cordoned_nodes

    stored, warning = stored_cordons_in(spec, session)
    if warning:
        err.print(Text(warning, style="yellow"), highlight=False, soft_wrap=True)
    return cordoned_nodes(spec, stored)


def _no_replace(replace: list[str]) -> None:
    if replace:
        raise UsageError(
            "--replace makes a new plan; a saved plan carries its own: "
            "run `llmgw plan --replace ... --out PLAN` again"
        )


def _refusals(
    spec: ClusterSpec,
    facts: dict[str, NodeFacts],
    chosen: Plan,
    cordoned: frozenset[str],
    *,
    rotate: bool,
    allow_downtime: bool,
) -> None:
    """What apply refuses once the plan is shown: downtime unless allowed, and a key
    rotation on a cluster that is not settled."""
    refuse_downtime(chosen, allow_downtime)
    if rotate and chosen.changes:
        # the rotation restarts the replicas the probe found: one this apply starts would
        # keep the old key
        raise InputError(
            "--rotate-engine-key rotates a settled cluster: run `llmgw apply` first, then rotate"
        )
    if rotate:  # it replaces every replica: the same rule as any replacement
        refuse_downtime(rotation_plan(spec, facts, cordoned), allow_downtime)


def apply(
    saved: Path | None,
    *,
    file: Path,
    yes: bool,
    dry_run: bool,
    replace: list[str],
    allow_downtime: bool,
    wait: bool,
    rotate_engine_key: bool,
    lock_timeout: float,
    no_lock: bool,
) -> None:
    """``llmgw apply`` (its help says what it does)."""
    as_written = read_cluster(file)
    spec, snapshots = pinned(as_written, err)
    # One session for every step: each node is connected to once, from the probe to the
    # gateway's install (the confirmation waits between two steps).
    with Session(spec, file.resolve().parent) as session:
        snapshot = probe_with_progress(spec, file, None, err, session)
        facts = {f.node: f for f in snapshot.nodes}
        # the gateway gets the commits of this plan (its pins file), never resolving them itself
        gateway = session.run(
            preview(
                spec, session.conns, file.read_text(encoding="utf-8"), gateway_pins(as_written, snapshots)
            )
        )
        host = _gathered(spec, session, facts, gateway)
        if saved is not None:
            _no_replace(replace)
            if host_steps.load_saved(saved, spec, session, facts, host, written=as_written) is None:
                out.print(Text(f"Nothing to do: every step of {saved} is done already.", style="green"))
                return
        cordoned = _cordoned(spec, session)
        chosen, wanted = _choose(spec, facts, saved, replace, session, cordoned=cordoned)
        chosen = flags_checked(spec, file, facts, chosen)
        if saved is None:
            chosen = whole(spec, chosen, facts, host, written=as_written)
        if rotate_engine_key:
            chosen = host_steps.with_rotation(chosen, spec, facts)
        out.print(
            plan_view(chosen, show_unchanged=False, journal=_journals(session, chosen, facts)), soft_wrap=True
        )
        unreachable = [f.node for f in snapshot.nodes if not f.reachable]
        if unreachable:
            err.print(Text(f"unreachable, left out: {', '.join(unreachable)}", style="yellow"))
        host_steps.show(chosen, out)
        if dry_run:
            return
        _refusals(spec, facts, chosen, cordoned, rotate=rotate_engine_key, allow_downtime=allow_downtime)
        if not has_work(chosen):
            _adapters_of_running_replicas(spec, session, chosen)
            _unplaced_is_failure(chosen)
            return
        confirm("Apply these changes?", yes=yes, to="apply")
        held, fetched = None, None
        if chosen.changes and not no_lock:
            how = Replan(saved, yes, lock_timeout, wanted, allow_downtime, cordoned)
            chosen, snapshot, held, fetched = _fetch_and_lock(spec, file, session, chosen, how)
        try:
            outcomes = session.run(
                _execute_with_progress(
                    spec,
                    session.conns,
                    chosen,
                    wait=wait,
                    gateway=gateway,
                    unreachable={f.node for f in snapshot.nodes if not f.reachable},
                    facts={f.node: f for f in snapshot.nodes},
                    lock=held,
                    take_lock=None if no_lock else LockTerms(lock_timeout, f"applying {file.name}"),
                    fetched=fetched,
                    allow_downtime=allow_downtime,
                    cordoned=cordoned,
                )
            )
        finally:
            if held is not None:
                session.run(held.release())
    failed = [o for o in outcomes if not o.ok]
    for o in failed:
        err.print(Text(f"FAILED {o.subject}: {o.message}", style="red"))
    if failed:
        raise ApplyFailed(_failed_said(failed, len(outcomes)))
    _unplaced_is_failure(chosen)
    done = f"Applied: {len(chosen.changes)} change(s), every started replica is ready."
    out.print(Text(done + _gateways_said(outcomes), style="green"), soft_wrap=True)


def _failed_said(failed: list[Outcome], steps: int) -> str:
    """Apply's last word on a failure: ``1 replica not ready (m#0), stopped`` first, as the
    operator's next step is its journal above; then the other failed steps."""
    said = []
    not_ready = [o.subject for o in failed if o.message.startswith(NOT_READY)]
    if not_ready:
        n = len(not_ready)
        said.append(f"{n} replica{'s' if n != 1 else ''} not ready ({', '.join(not_ready)}), stopped")
    others = len(failed) - len(not_ready)
    if others:
        said.append(f"{others} of {steps} steps failed")
    return "; ".join(said) + "; fix them and run apply again"


def _gateways_said(outcomes: list[Outcome]) -> str:
    """What apply's last line says of the gateway hosts: " Gateway: ready at ..." for
    one, " Gateway HOST: ..." for each of several."""
    gateways = [o for o in outcomes if o.subject == "gateway" or o.subject.startswith("gateway ")]
    return "".join(f" G{o.subject[1:]}: {o.message}." for o in gateways)
