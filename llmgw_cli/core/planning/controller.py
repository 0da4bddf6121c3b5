"""The model controller's decisions (pure): what a model's state is, what to start, stop
or restart so every model keeps its promise, and what a request gets when no replica is
ready. Functions of (spec, what is seen, history, now); the clock is a parameter.

The gateway's controller (``gateway/control/controller.py``) is the shell: it builds ``Seen``
values from discovery, the health checks and its own memory, calls ``reconcile`` about
once a second, carries out the decisions through the executor of ``apply`` and answers
requests with ``unavailable`` when it has no replica to give.

Rules of ``reconcile``, for every catalog model that is not switched off and has no
start or stop under way:

- a replica whose unit systemd gave up on (``ActiveState=failed``: the engine crashed
  more often than the unit's start limit allows), or whose engine is crash-looping
  (``core/observe/health.py``: systemd restarts it over and over before it gives up), is stopped,
  so its cards go back, and a replacement is placed on other cards, on another node
  when one fits (the node can be the cause), with the back-off of a failed start when
  that one fails too; the nodes of failed starts are passed by the same way until a
  start succeeds;
- a replica whose unit is down on a node that answers (inactive, removed) is stopped and
  replaced;
- a replica holding a card the probe finds faulty (nvidia-smi's health fields, a fatal
  XID in the kernel log, a card fallen off the bus: ``core/observe/gpu_faults.py``) is
  replaced even when its engine still looks alive: a successor starts first on healthy
  cards (placement never uses a faulty one) and the old replica is stopped once it is
  ready; when nothing fits it is restarted in place, which again goes to healthy cards only;
- a replica on a node that stopped answering is still counted for ``gateway.node_grace``
  (an SSH hiccup is not a lost node); after that a replacement starts elsewhere, and the
  old one is stopped if its node answers again;
- a replica that was ready and has failed its health check for ``gateway.unhealthy_restart``
  is restarted (the shell starts its successor first when one fits elsewhere, and stops
  the old one once the successor is ready; in place otherwise);
- a replica never ready ``start_timeout`` (its profile's) after it was first seen is
  stopped: nobody may hold cards for a replica that does not come up, not even one found
  after a restart of the gateway;
- an always-on model with fewer counted replicas than ``min`` gets one start, unless its
  back-off runs: after ``n`` failed starts in a row the next waits ``start_backoff * 2**(n-1)``
  (at most 5 minutes), so a model that cannot start does not thrash the cluster;
- a replica being drained (``apply`` retires it: a drain marker on its nodes,
  ``core/planning/drain.py``) is never routed and gets no decision (no stop, restart, idle stop or
  eviction); it counts towards ``min`` until its drain deadline + ``DRAIN_GRACE``, so no
  replacement of its own starts while ``apply`` replaces it. After that its ``apply``
  died: it is stopped (``drain-abandoned``) and a replacement starts if ``min`` calls for
  one. A draining replica on a node that stopped answering is judged as a lost one;
- idle stops and scale-out as ``core/planning/lifecycle.py`` says.

At most one start per model per call: the shell marks the model busy while it acts.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from enum import StrEnum

from llmgw_cli.core.clusterfile.spec import ClusterSpec, Model, ScalingMode
from llmgw_cli.core.planning.drain import DRAIN_GRACE, abandoned
from llmgw_cli.core.planning.lifecycle import ReplicaUse, idle_to_stop, should_scale_out
from llmgw_cli.core.serving.routing import Health

BACKOFF_MAX = 300.0  # seconds: the longest wait between two starts of a model that fails


class Phase(StrEnum):
    """A model's state: what ``/v1/models``, the dashboard and the metrics show."""

    off = "off"  # switched off in the cluster file (no scaling)
    stopped = "stopped"  # nothing runs: on demand and not asked for, or not started yet
    starting = "starting"  # a start is under way or a replica loads; none is ready
    ready = "ready"  # at least max(min, 1) replicas ready
    degraded = "degraded"  # some replica ready, fewer than min
    failed = "failed"  # none ready and the last start failed (its back-off runs)


class UnitCondition(StrEnum):
    """A replica's units as the last probe saw them."""

    up = "up"  # every member's unit is up (active, activating, reloading)
    gave_up = "gave-up"  # systemd gave up on a member's unit (ActiveState=failed)
    # a member's engine exits and systemd restarts it (core/observe/health.py)
    crash_looping = "crash-looping"
    lost = "lost"  # a member's node does not answer the probe
    down = "down"  # a member's unit is inactive or missing on a node that answers
    faulty_card = "faulty-card"  # a member's unit holds a card the probe finds faulty


@dataclass(frozen=True)
class Seen:
    """One replica as the controller sees it now. Times are wall-clock seconds."""

    model: str
    replica: int  # the index in its units' labels
    address: str  # host:port of rank 0, which serves the API
    nodes: tuple[str, ...]  # members, rank order
    gpus: frozenset[str]  # GPU UUIDs its units hold
    units: UnitCondition
    health: Health  # from the health checks (unknown when not checked)
    first_seen: float  # when this gateway first saw it (or started it)
    ready_at: float | None = None  # when first seen ready; None: never
    lost_since: float | None = None  # since when its node does not answer
    failing_since: float | None = None  # since when its health check fails (after ready)
    last_used: float | None = None  # last use as lifecycle.known_last_use gives it
    in_flight: int = 0
    replaced: bool = False  # the controller started a replacement for it already
    # Being drained: its drain deadline on this gateway's wall clock (the shell converts
    # the markers' node clock); None when it is not.
    draining: float | None = None
    # with ``units`` faulty-card: which of its cards are faulty and why, one line each
    faults: tuple[str, ...] = ()

    @property
    def use(self) -> ReplicaUse:
        """What the idle, eviction and scale-out rules (``core/planning/lifecycle.py``) read."""
        return ReplicaUse(
            model=self.model,
            replica=self.replica,
            nodes=len(self.nodes),
            ready_at=self.ready_at,
            last_used=self.last_used,
            in_flight=self.in_flight,
        )


def backoff(failures: int, first: float) -> float:
    """Seconds to wait after ``failures`` failed starts in a row: doubling, at most 5 min."""
    if failures <= 0:
        return 0.0
    return min(first * 2.0 ** min(failures - 1, 32), BACKOFF_MAX)


@dataclass(frozen=True)
class Attempts:
    """A model's recent start history: failures in a row, the last reason, and the nodes
    those failed starts were placed on (the next start goes elsewhere when it can)."""

    failures: int = 0
    failed_at: float | None = None
    reason: str = ""
    nodes: frozenset[str] = frozenset()

    def failed(self, reason: str, now: float, nodes: Sequence[str] = ()) -> Attempts:
        return Attempts(self.failures + 1, now, reason, self.nodes | frozenset(nodes))

    def succeeded(self) -> Attempts:
        return Attempts()

    def retry_at(self, first: float) -> float | None:
        """When the model may be started again; None when its last start did not fail."""
        if not self.failures or self.failed_at is None:
            return None
        return self.failed_at + backoff(self.failures, first)

    def waiting(self, first: float, now: float) -> float:
        """Seconds of back-off left (0 when a start may begin now)."""
        at = self.retry_at(first)
        return 0.0 if at is None else max(0.0, at - now)


@dataclass(frozen=True)
class Lifecycle:
    """One model's record in the gateway's controller: its start history (``attempts``),
    what is under way (a start, stops), what the start under way is doing, the replicas it
    started that are not ready yet, whether it evicted since its last good start, and the
    ready and on-their-way counts at the last look. The controller replaces it through
    the transitions below, never field by field, so every change reads as an event."""

    attempts: Attempts = Attempts()
    starting: bool = False  # a start is under way (placing, fetching, loading)
    stopping: int = 0  # stops of its replicas under way
    progress: str = ""  # what the start under way is doing
    loading: frozenset[str] = frozenset()  # addresses started and not ready yet
    evicted: bool = False  # an eviction was done for it since its last good start
    look: tuple[int, int] = (0, 0)  # (ready, on their way) at the last look

    @property
    def busy(self) -> bool:
        """A start or stop is under way: ``reconcile`` leaves the model alone."""
        return self.starting or self.stopping > 0

    def start_began(self, progress: str) -> Lifecycle:
        return dataclasses.replace(self, starting=True, progress=progress)

    def start_progress(self, progress: str) -> Lifecycle:
        return dataclasses.replace(self, progress=progress)

    def start_succeeded(self) -> Lifecycle:
        """A good start ends the run of failures and allows an eviction again."""
        return dataclasses.replace(self, attempts=self.attempts.succeeded(), evicted=False)

    def start_failed(self, reason: str, now: float, nodes: Sequence[str] = ()) -> Lifecycle:
        return dataclasses.replace(self, attempts=self.attempts.failed(reason, now, nodes))

    def start_ended(self, address: str | None) -> Lifecycle:
        """The start is over, well or not: its replica (at ``address``) loads no more."""
        return dataclasses.replace(self, starting=False, progress="").ready(address)

    def stop_began(self) -> Lifecycle:
        return dataclasses.replace(self, stopping=self.stopping + 1)

    def stop_ended(self) -> Lifecycle:
        return dataclasses.replace(self, stopping=self.stopping - 1)

    def loading_at(self, address: str) -> Lifecycle:
        return dataclasses.replace(self, loading=self.loading | {address})

    def ready(self, address: str | None) -> Lifecycle:
        """The replica at ``address`` loads no more (ready, or its start ended)."""
        if address is None or address not in self.loading:
            return self
        return dataclasses.replace(self, loading=self.loading - {address})

    def evicted_now(self) -> Lifecycle:
        return dataclasses.replace(self, evicted=True)

    def looked(self, ready: int, on_way: int) -> Lifecycle:
        return dataclasses.replace(self, look=(ready, on_way))

    def phase(self, model: Model, seen: Sequence[Seen], *, now: float, backoff_first: float) -> Phase:
        """The model's phase with this record's history and start under way."""
        return phase(model, seen, self.attempts, starting=self.starting, now=now, backoff_first=backoff_first)


class StopCause(StrEnum):
    idle = "idle"
    never_ready = "never-ready"
    gave_up = "gave-up"
    down = "down"
    replaced = "replaced"
    drain_abandoned = "drain-abandoned"


@dataclass(frozen=True)
class Start:
    model: str
    reason: str
    avoid: frozenset[str] = frozenset()  # GPU UUIDs not to place it on
    # nodes to place it on only when it fits nowhere else: where the replica it replaces
    # crash-looped (a node can be the cause: its engine program, a library, a disk)
    shun: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Stop:
    model: str
    replica: int
    reason: str
    cause: StopCause


@dataclass(frozen=True)
class Restart:
    model: str
    replica: int
    reason: str
    cause: str = "unhealthy"  # a word for the actions metric: unhealthy | faulty-card


Decision = Start | Stop | Restart


def _nodes(r: Seen) -> str:
    return ",".join(r.nodes)


def _judge(
    spec: ClusterSpec, model: Model, mine: Sequence[Seen], now: float
) -> tuple[list[Decision], list[Seen], Start, list[str]]:
    """The stops and restarts one model's replicas call for, the replicas that count
    towards ``min``, where a replacement should not go (a ``Start`` with no reason yet:
    the cards and nodes of crashed replicas) and what is being replaced."""
    grace = spec.gateway.node_grace
    timeout = spec.profiles[model.profile].readiness.start_timeout
    decisions: list[Decision] = []
    counted: list[Seen] = []
    crashed: list[Seen] = []
    replacing: list[str] = []
    for r in sorted(mine, key=lambda r: r.replica):
        if r.draining is not None and r.units is not UnitCondition.lost:
            if abandoned(r.draining, now):
                why = (
                    f"left draining by an apply that did not finish: its drain ended "
                    f"{now - r.draining:.0f}s ago (more than the {DRAIN_GRACE:g}s grace)"
                )
                decisions.append(Stop(r.model, r.replica, why, StopCause.drain_abandoned))
                replacing.append(f"replica {r.replica} {why}")
            else:
                counted.append(r)  # apply is replacing it: nothing to decide, no start of ours
            continue
        if r.units is UnitCondition.lost:
            if r.replaced:
                continue  # its replacement counts; it is stopped when its node answers again
            if r.lost_since is not None and now - r.lost_since >= grace:
                replacing.append(f"replica {r.replica} lost with {_nodes(r)}")
                continue
            counted.append(r)  # still within the grace: an SSH hiccup is not a lost node
            continue
        if r.replaced:
            why = "replaced while its node did not answer"
            decisions.append(Stop(r.model, r.replica, why, StopCause.replaced))
            continue
        broken = _broken(r)
        if broken is not None:
            decisions.append(broken)
            if isinstance(broken, Restart):
                counted.append(r)  # a faulty card's replica counts until its successor serves
                continue
            if broken.cause is StopCause.gave_up:
                crashed.append(r)
            replacing.append(f"replica {r.replica}: {broken.reason}")
            continue
        if r.ready_at is None and r.health is not Health.ready and now - r.first_seen >= timeout:
            why = f"not ready {timeout:g}s after it was first seen (the profile's start_timeout)"
            decisions.append(Stop(r.model, r.replica, why, StopCause.never_ready))
            continue
        if (
            r.health is Health.failing
            and r.ready_at is not None
            and r.failing_since is not None
            and now - r.failing_since >= spec.gateway.unhealthy_restart
        ):
            why = f"failing its health check for {now - r.failing_since:.0f}s"
            decisions.append(Restart(r.model, r.replica, why))
        counted.append(r)
    return decisions, counted, _elsewhere(model, crashed), replacing


def _broken(r: Seen) -> Stop | Restart | None:
    """What a replica whose units are not simply up calls for: a stop (systemd gave up,
    its engine crash-loops, its unit is down) or, on a faulty card, a replacement
    successor first; None when its units are up (or lost: judged by the caller)."""
    if r.units is UnitCondition.faulty_card:
        why = f"it holds a faulty card: {'; '.join(r.faults) or 'see llmgw doctor'}"
        return Restart(r.model, r.replica, why, UnitCondition.faulty_card.value)
    if r.units is UnitCondition.gave_up:
        return Stop(r.model, r.replica, f"systemd gave up on its unit on {_nodes(r)}", StopCause.gave_up)
    if r.units is UnitCondition.crash_looping:
        return Stop(r.model, r.replica, f"its engine is crash-looping on {_nodes(r)}", StopCause.gave_up)
    if r.units is UnitCondition.down:
        return Stop(r.model, r.replica, f"its unit is not running on {_nodes(r)}", StopCause.down)
    return None


def _elsewhere(model: Model, crashed: Sequence[Seen]) -> Start:
    """Where a replacement of ``crashed`` replicas should not go: their cards, and their
    nodes unless nothing else fits (a Start whose reason ``reconcile`` fills in)."""
    avoid = frozenset(g for r in crashed for g in r.gpus)
    return Start(model.name, "", avoid, frozenset(n for r in crashed for n in r.nodes))


def reconcile(
    spec: ClusterSpec,
    seen: Sequence[Seen],
    attempts: Mapping[str, Attempts],
    busy: Set[str],
    queue_wait: Mapping[str, float],
    *,
    now: float,
) -> list[Decision]:
    """What to do now so every model keeps its promise (the rules are in the module
    docstring). ``busy``: models with a start or stop under way (left alone);
    ``queue_wait``: seconds the longest request has waited in each model's queue."""
    by_model: dict[str, list[Seen]] = defaultdict(list)
    for r in seen:
        by_model[r.model].append(r)
    decisions: list[Decision] = []
    uses: list[ReplicaUse] = []
    live: dict[str, int] = {}
    for model in spec.models:
        if model.name in busy or model.mode is ScalingMode.off:
            continue
        judged, counted, elsewhere, replacing = _judge(spec, model, by_model.get(model.name, []), now)
        decisions += judged
        live[model.name] = len(counted)
        history = attempts.get(model.name, Attempts())
        may_start = history.waiting(spec.gateway.start_backoff, now) == 0
        want = model.scaling.min if model.scaling and model.mode is ScalingMode.always else 0
        if len(counted) < want and may_start:
            reason = f"below min ({len(counted)} of {want})"
            if replacing:
                reason += ": replacing " + "; ".join(replacing)
            decisions.append(dataclasses.replace(elsewhere, reason=reason))
            continue
        stopping = {d.replica for d in judged if not isinstance(d, Start)}
        uses += [
            r.use
            for r in counted
            if r.units is UnitCondition.up and r.replica not in stopping and r.draining is None
        ]
        wait = queue_wait.get(model.name, 0.0)
        if (
            wait
            and may_start
            and should_scale_out(
                spec,
                model.name,
                replicas=len(counted),
                starting=False,
                queue_wait=wait,
                threshold=spec.gateway.scale_out_wait,
            )
        ):
            decisions.append(Start(model.name, f"scale out: requests waited {wait:.1f}s in its queue"))
    started = {d.model for d in decisions if isinstance(d, Start)}
    for use in idle_to_stop(spec, uses, now):
        if use.model in started:
            continue
        model = spec.model(use.model)
        idle = model.scaling.idle_timeout if model.scaling else None
        why = f"idle for {idle:g}s" if idle else "idle"
        decisions.append(Stop(use.model, use.replica, why, StopCause.idle))
    return decisions


def phase(
    model: Model,
    seen: Sequence[Seen],
    attempts: Attempts,
    *,
    starting: bool,
    now: float,
    backoff_first: float,
) -> Phase:
    """The model's state from its replicas (``seen``: this model's), its start history
    and whether a start of it is under way."""
    if model.mode is ScalingMode.off:
        return Phase.off
    alive = (UnitCondition.up, UnitCondition.lost, UnitCondition.faulty_card)
    live = [r for r in seen if r.units in alive and not r.replaced]
    ready = sum(r.health is Health.ready and r.draining is None for r in live)  # drained: not routed
    want = max(model.scaling.min if model.scaling else 0, 1)
    if ready >= want:
        return Phase.ready
    if ready:
        return Phase.degraded
    if starting or any(
        r.units is UnitCondition.up and r.health in (Health.loading, Health.unknown) for r in live
    ):
        return Phase.starting
    if attempts.failures and (attempts.waiting(backoff_first, now) > 0 or model.mode is ScalingMode.always):
        return Phase.failed
    return Phase.stopped


# A fetch's progress as ``core/fetch_progress.progress_text`` writes it, after the subject.
_FETCH = re.compile(
    r": (fetching|waiting)(?: (\d+/\d+ files))?(?:,? ?(\d+(?:\.\d+)? (?:of \d+(?:\.\d+)? )?[GM]B))?"
)
# What the controller says of a start (``gateway/control/controller.py``), by the words it begins with.
_STEPS = (
    ("probing the nodes", "placing a replica"),
    ("starting on ", "starting the engine"),
    ("engine loading", "engine loading"),
)


def public_progress(progress: str) -> str:
    """What a client may read of a start's progress: a phrase of a fixed vocabulary, with
    at most the numbers of a fetch (``fetching weights: 12/40 files, 3 of 9 GB``). The
    progress text itself quotes nodes, peers and whatever a node's fetch job said: the
    gateway's log and the admin dashboard show it, never a client."""
    if not progress:
        return ""
    for start, phrase in _STEPS:
        if progress.startswith(start):
            return phrase
    fetch = _FETCH.search(progress)
    if fetch is None:
        return "fetching weights" if "weights" in progress else "starting"
    if fetch[1] == "waiting":
        return "waiting for weights"
    numbers = [n for n in (fetch[2], fetch[3]) if n]
    return "fetching weights" + (": " + ", ".join(numbers) if numbers else "")


@dataclass(frozen=True)
class Unavailable:
    """What a request gets when no replica of its model is ready in time. ``message`` is
    for the client: fixed phrases, the model's name and numbers only. ``detail`` is what
    the gateway knows of why (a start's failure, its progress), for its log only."""

    status: int  # 503, or 404 for a model that is switched off
    code: str  # model_loading | model_start_failed | model_unavailable | model_off
    message: str
    retry_after: float  # seconds, at least 1
    detail: str = ""

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(math.ceil(self.retry_after))}


def unavailable(
    model: Model,
    phase: Phase,
    attempts: Attempts,
    *,
    progress: str,
    manages: bool,
    now: float,
    backoff_first: float,
) -> Unavailable:
    """The answer for a request that found no ready replica of ``model`` in time."""
    name = model.name
    if phase is Phase.off:
        return Unavailable(
            404, "model_off", f"The model `{name}` is switched off (no scaling in the cluster file).", 30.0
        )
    left = attempts.waiting(backoff_first, now)
    if phase is Phase.failed:
        return Unavailable(
            503,
            "model_start_failed",
            f"The model `{name}` could not be started; it is tried again after a back-off.",
            max(1.0, left),
            attempts.reason,
        )
    if phase is Phase.starting:
        public = public_progress(progress)
        doing = f" ({public})" if public else ""
        return Unavailable(
            503, "model_loading", f"The model `{name}` is loading{doing}; retry shortly.", 5.0, progress
        )
    if phase is Phase.stopped and model.mode is ScalingMode.on_demand and not manages:
        return Unavailable(
            503,
            "model_unavailable",
            f"The model `{name}` runs on demand and is not running; this gateway does not start "
            "models (it routes to a fixed replica list, or `gateway.manage_replicas` is off).",
            30.0,
        )
    if phase is Phase.stopped and manages:
        return Unavailable(
            503, "model_unavailable", f"No replica of `{name}` is in rotation; one is being started.", 5.0
        )
    return Unavailable(503, "model_unavailable", f"No replica of `{name}` is in rotation.", 30.0)
