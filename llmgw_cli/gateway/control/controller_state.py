"""What the gateway's controller remembers (``gateway/control/controller.py``): each replica it
has seen (``Known``), each model's starts (``ModelController``), its recent actions
(``Done``), and, in a process that does not lead, the leader's publication
(``Following``); with the readings made from them (``seen_of``, ``published_phase``)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from llmgw_cli.core.clusterfile.spec import ClusterSpec, ScalingMode
from llmgw_cli.core.observe.facts import NodeFacts
from llmgw_cli.core.planning.controller import (
    Attempts,
    Lifecycle,
    Phase,
    Seen,
    Start,
    Unavailable,
    UnitCondition,
    backoff,
    unavailable,
)
from llmgw_cli.core.planning.cordon import Cordon, cordoned_nodes
from llmgw_cli.core.planning.lifecycle import known_last_use
from llmgw_cli.core.planning.plan import Action, Plan, Running
from llmgw_cli.core.serving.redact import redact
from llmgw_cli.core.serving.routing import Health, Pool, RoutedReplica
from llmgw_cli.gateway.store.sqlite import ModelState, Store
from llmgw_cli.progress import Phase as ReportPhase

REQUEST_EVERY = 1.0  # seconds: a follower asks the leader to start a model at most this often
# Seconds a follower's request waits for the leader's publication to say a start it asked
# for began (the leader takes requests every 0.5 s and publishes within a second).
REQUEST_PATIENCE = 5.0
# Seconds a new follower's requests wait for the leader's first publication it reads: a
# worker that starts beside its leader serves before the leader has published anything,
# and without a publication it knows no replica of any model.
FIRST_PUBLICATION_WAIT = 15.0

log = logging.getLogger("llmgw.controller")


def replica_key(model: str, address: str) -> str:
    """How a replica's last use is stored."""
    return f"{model}@{address}"


# --- what the controller remembers ------------------------------------------------------


@dataclass
class Known:
    """One replica as this gateway remembers it (wall-clock times)."""

    model: str
    replica: int
    address: str
    nodes: tuple[str, ...]
    first_seen: float
    port: int = 0
    held: dict[str, tuple[str, ...]] = field(default_factory=dict)  # node -> GPU UUIDs
    ready_at: float | None = None
    lost_since: float | None = None
    failing_since: float | None = None
    replaced: bool = False
    draining: float | None = None  # its drain deadline on this gateway's clock, when apply retires it
    restarts: int | None = None  # systemd's restarts of its units when last seen

    def held_action(self) -> Action:
        """What it holds, as a plan reads it: a replica on a node that stopped answering
        is not in the probe, but its replica number, cards and port are still its own."""
        return Action(
            op="=",
            model=self.model,
            replica=self.replica,
            nodes=self.nodes,
            reason="on a node that does not answer",
            port=self.port or None,
            gpus=self.held,
        )


@dataclass(frozen=True)
class Done:
    """One action of the controller, for the dashboard."""

    time: float  # wall clock
    model: str
    action: str  # start, stop, restart, replace, evict, start-failed
    reason: str

    def as_dict(self) -> dict[str, object]:
        return {"time": self.time, "model": self.model, "action": self.action, "reason": self.reason}


class ModelController:
    """One model's record (``state``, a ``Lifecycle``: replaced by its transitions, never
    changed in place) and the event its waiters sleep on."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.state = Lifecycle()
        self._event = asyncio.Event()

    def wake(self) -> None:
        """Wake every waiter: a replica's readiness changed, or a start ended."""
        self._event.set()
        self._event = asyncio.Event()

    async def changed(self, timeout: float) -> None:
        """Until the next ``wake`` or ``timeout`` seconds, whichever comes first."""
        event = self._event
        try:
            async with asyncio.timeout(max(0.0, timeout)):
                await event.wait()
        except TimeoutError:
            pass


@dataclass
class Fetching:
    """A start's plan while it brings weights outside the lock (its cards stay reserved)."""

    action: Action
    plan: Plan


@dataclass
class ProgressSink:
    """Where a start's events go besides the executor's log: the model's progress text
    (which the dashboard shows and the leader publishes: without secrets)."""

    model: ModelController
    secrets: Callable[[], Iterable[str]]

    def __call__(self, subject: str, message: str, phase: ReportPhase = ReportPhase.working, /) -> None:
        self.model.state = self.model.state.start_progress(redact(f"{subject}: {message}", self.secrets()))


@dataclass
class Following:
    """What the controller of a process that does not lead knows: the leader's latest
    publication (each model's state, the addresses being drained), and how to ask the
    leader for an on-demand start."""

    request: Callable[[str], None]  # ask the leader to start this model (never blocks)
    models: dict[str, ModelState] = field(default_factory=dict)
    draining: frozenset[str] = frozenset()
    asked: dict[str, float] = field(default_factory=dict)  # model -> monotonic time last asked
    published: bool = False  # a publication of the leader was read since following began
    since: float = field(default_factory=time.monotonic)  # when following began

    def awaits_publication(self) -> bool:
        """Nothing published read yet, and not for long: a request waits for it."""
        return not self.published and time.monotonic() - self.since < FIRST_PUBLICATION_WAIT

    def unavailable(self, spec: ClusterSpec, name: str, phase: Phase, now: float) -> Unavailable | None:
        """Why ``name`` is unavailable in the leader's view (its start history and what its
        start does now), or None when the leader published nothing of it."""
        state = self.models.get(name)
        if state is None:
            return None
        first = spec.gateway.start_backoff
        failed_at = (
            state.retry_at - backoff(state.failures, first)
            if state.retry_at is not None and state.failures
            else None
        )
        attempts = Attempts(state.failures, failed_at, state.last_failure)
        manages = spec.gateway.manage_replicas
        return unavailable(
            spec.model(name),
            phase,
            attempts,
            progress=state.progress,
            manages=manages,
            now=now,
            backoff_first=first,
        )

    def on_its_way(self, name: str, mode: ScalingMode, now: float) -> bool:
        """A start of ``name`` is on its way as far as this follower knows: the leader's
        first publication is awaited, the leader publishes it starting, or it was asked
        for within ``REQUEST_PATIENCE`` and the leader has not published a failure."""
        if self.awaits_publication():
            return True
        state = self.models.get(name)
        phase = published_phase(state, mode, now) if state is not None else None
        if phase is Phase.starting:
            return True
        asked = self.asked.get(name)
        return phase is not Phase.failed and asked is not None and time.monotonic() - asked < REQUEST_PATIENCE

    def ask(self, name: str, now: float) -> None:
        """Ask the leader to start ``name``, unless it publishes the model starting, failed
        (its back-off runs) or served, or it was asked within ``REQUEST_EVERY``."""
        state = self.models.get(name)
        if state is not None:
            phase = published_phase(state, ScalingMode.on_demand, now)
            if phase in (Phase.starting, Phase.failed, Phase.ready, Phase.degraded):
                return
        moment = time.monotonic()
        asked = self.asked.get(name)
        if asked is not None and moment - asked < REQUEST_EVERY:
            return
        self.asked[name] = moment
        self.request(name)


@dataclass
class DrainClocks:
    """node -> (its clock in a probe, this gateway's clock when that probe was first
    seen): how drain deadlines, written on the node's clock, read on this gateway's."""

    seen: dict[str, tuple[float, float]] = field(default_factory=dict)

    def deadline(self, r: Running, facts: dict[str, NodeFacts], now: float) -> float | None:
        """When the replica's drain ends on this gateway's clock (the latest of its members'
        markers, each on its node's clock), or None when no member's node marks it."""
        found: list[float] = []
        for node in r.members:
            f = facts.get(node)
            deadline = f.draining.get(r.unit) if f is not None else None
            if f is None or deadline is None:
                continue
            if f.clock is None:
                found.append(deadline)  # no clock read: take the two clocks as one
                continue
            seen = self.seen.get(node)
            if seen is None or seen[0] != f.clock:
                seen = self.seen[node] = (f.clock, now)  # first seen now: this probe's offset
            found.append(deadline + seen[1] - seen[0])
        return max(found, default=None)


def seen_of(
    spec: ClusterSpec,
    known: Known,
    units: UnitCondition,
    in_pool: dict[tuple[str, str], RoutedReplica],
    *,
    saved: dict[str, float],
    now: float,
    faults: tuple[str, ...] = (),
) -> Seen:
    """The replica ``known`` as the controller sees it now (its units as the probe saw
    them, its health as the pool has it, its last use here or as ``saved``, the faulty
    cards it holds); what changed is noted in ``known`` (since when it is lost, ready,
    failing)."""
    routed = in_pool.get((known.model, known.address))
    health = routed.health if routed is not None else Health.unknown
    if units is UnitCondition.lost:
        if known.lost_since is None:
            # Since its first sign: a replica that was ready and stopped answering its
            # health check just before its node stopped answering the probe was lost then.
            known.lost_since = known.failing_since or now
    else:
        known.lost_since = None
    if known.draining is not None:
        pass  # out of rotation on purpose: its health is nobody's concern
    elif health is Health.ready:
        if known.ready_at is None:
            known.ready_at = now
        known.failing_since = None
    elif known.ready_at is not None and units is not UnitCondition.lost and known.failing_since is None:
        known.failing_since = now
    model = spec.model(known.model)
    idle_timeout = model.scaling.idle_timeout if model.scaling else None
    times = [
        t
        for t in (
            routed.last_used if routed is not None else None,
            saved.get(replica_key(known.model, known.address)),
        )
        if t is not None
    ]
    return Seen(
        model=known.model,
        replica=known.replica,
        address=known.address,
        nodes=known.nodes,
        gpus=frozenset(g for gpus in known.held.values() for g in gpus),
        units=units,
        health=health,
        first_seen=known.first_seen,
        ready_at=known.ready_at,
        lost_since=known.lost_since,
        failing_since=known.failing_since,
        last_used=known_last_use(max(times) if times else None, known.first_seen, idle_timeout, now),
        in_flight=routed.outstanding if routed is not None else 0,
        replaced=known.replaced,
        draining=known.draining,
        faults=faults,
    )


def published_phase(state: ModelState, mode: ScalingMode, now: float) -> Phase:
    """A phase from the leader's publication (hostile data: an unknown value is
    "stopped"); an on-demand model "failed" only while its back-off runs, as the leader
    would say now."""
    try:
        phase = Phase(state.phase)
    except ValueError:
        return Phase.stopped
    if (
        phase is Phase.failed
        and mode is ScalingMode.on_demand
        and state.retry_at is not None
        and state.retry_at <= now
    ):
        return Phase.stopped
    return phase


def shun(start: Start, mc: ModelController) -> frozenset[str]:
    """Nodes a start goes to only when it fits nowhere else: where the replica it replaces
    crash-looped, and where the model's starts failed since its last good one."""
    return start.shun | mc.state.attempts.nodes


def seen_in_pool(models: list[str], pool: Pool, now: float) -> list[Seen]:
    """The replicas of ``models`` as the pool alone has them (a fixed replica list, or
    nothing probed yet): up, on no known node."""
    return [
        Seen(
            model=name,
            replica=index,
            address=routed.address,
            nodes=(),
            gpus=frozenset(),
            units=UnitCondition.up,
            health=routed.health,
            first_seen=now,
            last_used=routed.last_used,
            in_flight=routed.outstanding,
        )
        for name in models
        for index, routed in enumerate(pool.of(name))
    ]


@dataclass
class Cordons:
    """The nodes out for maintenance as the controller reads them before each placement
    (``core/planning/cordon.py``): the cluster file's and the store's. When the store
    cannot be read, the store's cordons read last count (a cordon is never dropped
    because the store hiccupped)."""

    stored: list[Cordon] = field(default_factory=list)

    async def read(self, spec: ClusterSpec, store: Store | None) -> frozenset[str]:
        if store is not None:
            try:
                self.stored = await store.cordons()
            except Exception as exc:  # whatever the store raised: the placement goes on
                log.warning("cordons not read from the store (those read last count): %s", exc)
        return cordoned_nodes(spec, self.stored)
