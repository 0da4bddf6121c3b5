"""The one executor of a plan: apply's and the gateway controller's.

A whole plan (``Executor.whole``, apply's) is carried out in the order of its step kinds
(``core/planning/steps.py``): the node helpers (everything after goes through them), the
engine keys, the replica changes (each start bringing its weights: the weights steps),
then the gateway hosts, given the engine keys' map; an engine key rotation last. The
gateway controller's small plans have replica actions only.

It carries out the replica actions of a ``Plan`` (``core/planning/plan.py``): a start (weights,
then under the lock a last look that the cards and port are still free and the units
written and started; outside it the readiness wait), a stop (out of rotation first, then
under the lock the units stopped and removed), and a replacement of a serving replica:

- surge (its successor has its own cards and port): the successor is started as above;
  once it is ready and routed the old replica is drained and stopped. A successor that
  does not come up leaves the old replica serving;
- in place (the successor takes the old one's cards): the old replica is drained first,
  then stopped and its successor started in one lock hold, then waited for and routed.

The order of those steps, what a failed step leaves serving, the lock around each write
step (never around a wait) and every progress event live here once. What differs between
the callers comes in through two small seams:

- ``Steps``: how the caller locks, brings weights, checks a placement under the lock,
  writes units and waits for readiness (apply: the cluster lock and ``remote/execute.py``
  over SSH, ``remote/rollout.py``; the controller: its own lock, probe and pool,
  ``gateway/control/controller.py``);
- ``Routing``: how a replica is seen routed and taken out of rotation (apply: every
  gateway's routes file and the drain markers; the controller: its own pool);
- ``HostWork`` (apply only): how each kind of host step is carried out on its targets
  (``remote/apply_host.py``).

Every event goes through ``Executor.event``: it is logged on the ``llmgw.executor``
logger (with ``source="executor"``) and passed to the caller's ``Report``; the seams get
that same function as their report, so what they say is the executor's event too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol

from llmgw_cli.core.planning.plan import Action, Plan, Retired
from llmgw_cli.core.planning.steps import HostStep, StepKind
from llmgw_cli.errors import LlmgwError
from llmgw_cli.progress import Phase, Report
from llmgw_cli.remote.execute import Outcome

log = logging.getLogger("llmgw.executor")
SOURCE = "executor"  # the ``source`` of every log record the executor's events make


def subject(model: str, replica: int) -> str:
    return f"{model}#{replica}"


def one_plan(actions: Sequence[Action], digest: str = "") -> Plan:
    """A plan of just ``actions`` (each step of the executor writes one such)."""
    return Plan(actions=tuple(actions), unplaced=(), warnings=(), facts_digest=digest)


def cut_text(seconds: float, open_connections: int) -> str:
    """What a drain that ran into its bound says (one connection is one request)."""
    s = "" if open_connections == 1 else "s"
    return f"stopped at the drain bound ({seconds:g}s) with {open_connections} request{s} in flight: cut"


@dataclass(frozen=True)
class Drained:
    """How a drain ended: the connections still open at its bound (-1: they could not be
    counted) and the bound, in seconds."""

    left: int
    seconds: float


@dataclass
class Rolled:
    """One replacement: what it did, and whether the old replica is gone (stopped and
    its units removed: it no longer runs anything)."""

    action: Action
    outcomes: list[Outcome]
    retired: bool


class Steps(Protocol):
    """How one caller's replicas are written, started and waited for."""

    def locked(self, why: str) -> AbstractAsyncContextManager[None]:
        """The lock over the cards for one write step."""
        ...

    async def weights(self, action: Action, report: Report) -> str | None:
        """Bring the weights ``action`` starts with (before any lock); why not, or None."""
        ...

    async def placed(self, action: Action) -> Action | str:
        """Under the lock: where ``action`` goes now (itself, or placed again where its
        cards or port were taken meanwhile), or why it cannot start."""
        ...

    async def write(self, actions: Sequence[Action], report: Report) -> list[Outcome]:
        """Under the lock: write, start or stop the units of ``actions``; no wait."""
        ...

    async def ready(self, actions: Sequence[Action], done: list[Outcome], report: Report) -> list[Outcome]:
        """Outside the lock: wait until the replicas ``actions`` started are ready (one
        that never gets ready is stopped); one Outcome per replica."""
        ...


class Routing(Protocol):
    """How one caller sees a replica routed and takes one out of rotation."""

    async def routed(self, action: Action, report: Report) -> list[Outcome]:
        """Until the replica ``action`` started is routed; a warning Outcome when it is
        not within the caller's bound."""
        ...

    async def mark(self, model: str, old: Retired) -> str | None:
        """Under the lock: take ``old`` out of rotation; why it cannot be, or None."""
        ...

    async def drained(self, model: str, old: Retired, report: Report) -> Drained:
        """Until ``old``, out of rotation, has no request in flight, or its drain bound."""
        ...


class HostWork(Protocol):
    """How apply carries out each kind of the plan's host steps on their targets; each
    method is called once, with the steps of its kind (none: nothing to do there, but a
    method may still read what later steps need, e.g. every node's engine key)."""

    async def helpers(self, steps: Sequence[HostStep], report: Report) -> list[Outcome]:
        """Install or update the node helper on the nodes ``steps`` name."""
        ...

    async def engine_keys(self, steps: Sequence[HostStep], report: Report) -> list[Outcome]:
        """Write the engine keys ``steps`` name (the ``write`` ones; the ``rotate`` ones go
        to ``rotate``), and read every reachable node's, for the units and the gateways."""
        ...

    async def replicas(self, executor: Executor) -> list[Outcome]:
        """The plan's replica changes, carried out through ``executor`` (its ``start``,
        ``stop`` and ``replace_all``)."""
        ...

    async def gateways(self, steps: Sequence[HostStep], report: Report) -> list[Outcome]:
        """Install the gateway on the hosts ``steps`` name (a ``none`` or ``skip`` step: the
        host is left as it is, and said to be), with the engine keys' map."""
        ...

    async def rotate(self, steps: Sequence[HostStep], report: Report) -> list[Outcome]:
        """Rotate the engine keys of the nodes ``steps`` name, no request lost."""
        ...


@dataclass
class Executor:
    steps: Steps
    routing: Routing
    report: Report

    # --- a whole plan -------------------------------------------------------------------

    async def whole(self, plan: Plan, host: HostWork) -> list[Outcome]:
        """Carry out ``plan``'s host steps through ``host`` in the order of their kinds,
        and its replica changes (through this executor) after the engine keys, before the
        gateways."""
        kinds: dict[StepKind, list[HostStep]] = {}
        for step in plan.steps:  # a gateway host's quiet step too: it says the host is served
            kinds.setdefault(step.kind, []).append(step)
        keys = kinds.get("engine_key", [])
        outcomes = await host.helpers(kinds.get("node_helper", []), self.event)
        outcomes += await host.engine_keys([s for s in keys if s.action != "rotate"], self.event)
        if plan.changes:
            outcomes += await host.replicas(self)
        outcomes += await host.gateways(kinds.get("gateway", []), self.event)
        rotated = [s for s in keys if s.action == "rotate"]
        if rotated:
            outcomes += await host.rotate(rotated, self.event)
        return outcomes

    def event(self, who: str, message: str, phase: Phase = Phase.working, /) -> None:
        """The one place an event of the executor is said: logged, then reported."""
        level = logging.WARNING if phase is Phase.failed else logging.INFO
        log.log(level, "%s: %s", who, message, extra={"source": SOURCE, "phase": phase.value})
        self.report(who, message, phase)

    # --- starts -------------------------------------------------------------------------

    async def start(
        self, actions: Sequence[Action], why: str, *, wait: bool = True
    ) -> tuple[list[Action], list[Outcome]]:
        """Start ``actions``: their weights, then in one lock hold (taken saying ``why``)
        those that still fit written and started, then (``wait``) their readiness. The actions
        started (as placed at last) and the outcomes; a start that did not happen is one
        failed Outcome."""
        outcomes: list[Outcome] = []
        fetched: list[Action] = []
        for action in actions:
            missing = await self.steps.weights(action, self.event)
            if missing:
                outcomes.append(
                    Outcome(subject(action.model, action.replica), False, f"not started: {missing}")
                )
            else:
                fetched.append(action)
        if not fetched:
            return [], outcomes
        go: list[Action] = []
        done: list[Outcome] = []
        async with self.steps.locked(why):
            for action in fetched:
                placed = await self.steps.placed(action)
                if isinstance(placed, str):
                    who = subject(action.model, action.replica)
                    outcomes.append(Outcome(who, False, f"not started: {placed}"))
                else:
                    go.append(placed)
            if go:
                done = await self.steps.write(go, self.event)
        outcomes += done
        if go and wait:
            outcomes += await self.steps.ready(go, done, self.event)
        return go, outcomes

    # --- stops --------------------------------------------------------------------------

    async def stop(self, removal: Action) -> tuple[bool, list[Outcome]]:
        """Stop the replica ``removal`` (a ``-``) removes: out of rotation, then its units
        stopped and removed under the lock. (False, why) when it cannot be taken out of
        rotation: it serves on."""
        who = subject(removal.model, removal.replica)
        async with self.steps.locked(f"stopping {who}"):
            refused = await self.routing.mark(removal.model, _as_retired(removal))
            if refused is not None:
                self.event(who, f"not stopped: {refused}", Phase.failed)
                return False, [Outcome(who, False, f"not stopped: {refused}; it serves on")]
            self.event(who, f"stopping: {removal.reason}")
            outcomes = await self.steps.write([removal], self.event)
        for o in outcomes:
            if not o.ok:
                self.event(who, f"stopping: {o.subject}: {o.message}", Phase.failed)
        return True, outcomes

    async def retire(self, removal: Action) -> list[Outcome]:
        """Stop the replica ``removal`` (a ``-``) removes the way a replacement retires its
        old one: out of rotation, its requests given up to the drain bound, then its units
        stopped and removed under the lock (``llmgw drain`` of a replica that fits on no
        other node). Not taken out of rotation: it serves on, a failed Outcome says why."""
        who = subject(removal.model, removal.replica)
        old = _as_retired(removal)
        async with self.steps.locked(f"draining {who}"):
            refused = await self.routing.mark(removal.model, old)
        if refused is not None:
            self.event(who, f"not stopped: {refused}", Phase.failed)
            return [Outcome(who, False, f"not stopped: {refused}; it serves on")]
        self.event(who, "draining")
        drained = await self.routing.drained(removal.model, old, self.event)
        async with self.steps.locked(f"stopping {who}"):
            outcomes = await self.steps.write([removal], self.event)
        if not all(o.ok for o in outcomes):
            return outcomes
        text = cut_text(drained.seconds, drained.left) if drained.left > 0 else "drained and stopped"
        self.event(who, text, Phase.done)
        return [*outcomes, Outcome(who, True, text)]

    # --- replacements -------------------------------------------------------------------

    async def replace_all(self, actions: Sequence[Action]) -> list[Rolled]:
        """Each model's replacements one after another in the order given (each counts on
        the cards the one before frees), the models' at the same time."""
        by_model: dict[str, list[Action]] = {}
        for action in actions:
            if action.op != "~" or action.retire is None:
                raise ValueError(f"{action.op} {action.model}#{action.replica} is not a rolling replacement")
            by_model.setdefault(action.model, []).append(action)

        async def model(chain: list[Action]) -> list[Rolled]:
            return [await self.replace(a) for a in chain]

        done = await asyncio.gather(*(model(chain) for chain in by_model.values()))
        return [r for chain in done for r in chain]

    async def replace(self, action: Action) -> Rolled:
        """One replacement, surge or in place; a step that raises (the lock not taken, a
        node lost midway) ends it with the old replica left as it was."""
        try:
            return await (self._surge(action) if action.surge else self._in_place(action))
        except (LlmgwError, OSError) as exc:
            reason = getattr(exc, "reason", None) or str(exc)
        who = subject(action.model, _retired(action).replica)
        self.event(who, f"failed: {reason}", Phase.failed)
        return Rolled(action, [Outcome(who, False, f"replacement stopped: {reason}; run apply again")], False)

    async def _surge(self, action: Action) -> Rolled:
        old = _retired(action)
        new_subject, old_subject = subject(action.model, action.replica), subject(action.model, old.replica)
        start = action.model_copy(update={"op": "+", "remove": (), "retire": None, "surge": False})
        stays = f"#{old.replica} serves on; run apply again"
        missing = await self.steps.weights(start, self.event)
        if missing:
            return Rolled(action, [Outcome(new_subject, False, f"not started: {missing}; {stays}")], False)
        self.event(new_subject, f"starting (successor of #{old.replica})")
        async with self.steps.locked(f"starting {new_subject} to replace #{old.replica}"):
            placed = await self.steps.placed(start)
            if isinstance(placed, str):
                self.event(new_subject, f"not started: {placed}", Phase.failed)
                return Rolled(action, [Outcome(new_subject, False, f"not started: {placed}; {stays}")], False)
            done = await self.steps.write([placed], self.event)
        outcomes = list(done)
        if all(o.ok for o in done):
            outcomes += await self.steps.ready([placed], done, self.event)
        if not all(o.ok for o in outcomes):
            outcomes.append(Outcome(old_subject, False, f"not retired: its successor did not start; {stays}"))
            return Rolled(action, outcomes, False)
        outcomes += await self.routing.routed(action, self.event)
        drained = await self._drain(action)
        if isinstance(drained, Outcome):
            return Rolled(action, [*outcomes, drained], False)
        async with self.steps.locked(f"stopping {old_subject}, replaced by #{action.replica}"):
            stopped = await self.steps.write([removal(action)], self.event)
        outcomes += stopped
        if not all(o.ok for o in stopped):
            return Rolled(
                action, [*outcomes, Outcome(old_subject, False, "not stopped; run apply again")], False
            )
        return Rolled(action, [*outcomes, self._stopped(action, drained)], True)

    async def _in_place(self, action: Action) -> Rolled:
        old = _retired(action)
        who = subject(action.model, old.replica)
        missing = await self.steps.weights(action, self.event)
        if missing:
            return Rolled(action, [Outcome(who, False, f"not replaced: {missing}; it serves on")], False)
        drained = await self._drain(action)
        if isinstance(drained, Outcome):
            return Rolled(action, [drained], False)
        async with self.steps.locked(f"replacing {who} in place"):
            done = await self.steps.write([action], self.event)
        if not all(o.ok for o in done):
            return Rolled(action, [*done, Outcome(who, False, "not replaced; run apply again")], False)
        outcomes = [*done, self._stopped(action, drained)]
        ready = await self.steps.ready([action], done, self.event)
        outcomes += ready
        if all(o.ok for o in ready):
            outcomes += await self.routing.routed(action, self.event)
        return Rolled(action, outcomes, True)

    async def _drain(self, action: Action) -> Drained | Outcome:
        """Out of rotation (under the lock), then until no request is in flight or the
        drain bound; an Outcome when the old replica cannot be taken out (it serves on)."""
        old = _retired(action)
        who = subject(action.model, old.replica)
        async with self.steps.locked(f"draining {who}"):
            refused = await self.routing.mark(action.model, old)
        if refused is not None:
            self.event(who, f"not drained: {refused}", Phase.failed)
            return Outcome(who, False, f"not retired: cannot mark it draining ({refused}); it serves on")
        self.event(who, "draining")
        return await self.routing.drained(action.model, old, self.event)

    def _stopped(self, action: Action, drained: Drained) -> Outcome:
        who = subject(action.model, _retired(action).replica)
        by = f"replaced by #{action.replica}" if action.surge else "replaced in place"
        if drained.left > 0:
            text = f"{cut_text(drained.seconds, drained.left)}; {by}"
        elif drained.left < 0:
            text = f"stopped at the drain bound ({drained.seconds:g}s), its connections could not be counted; {by}"
        else:
            text = f"drained and stopped; {by}"
        self.event(who, text, Phase.done)
        return Outcome(who, True, text)


def _retired(action: Action) -> Retired:
    if action.retire is None:
        raise ValueError(f"{action.model}#{action.replica}: not a replacement")
    return action.retire


def _as_retired(removal: Action) -> Retired:
    """The replica a ``-`` stops, as the routing seam takes it."""
    unit = removal.remove[0][1] if removal.remove else ""
    return Retired(replica=removal.replica, nodes=removal.nodes, unit=unit, port=removal.port or 0)


def removal(action: Action) -> Action:
    """The ``-`` that stops and removes a surge's old replica."""
    old = _retired(action)
    remove = action.remove or tuple((n, old.unit) for n in old.nodes)
    return Action(
        op="-",
        model=action.model,
        replica=old.replica,
        nodes=old.nodes,
        reason=f"replaced by #{action.replica}",
        remove=remove,
        port=old.port,
    )
