"""The model controller: the one owner of every model's replicas.

``Controller`` (one per gateway, ``gw.controller``) holds the lock over the cards, runs the
reconcile tick and remembers what it has seen of each replica (first seen, ready since,
node lost since, failing since, replaced). One ``ModelController`` per catalog model holds
that model's start history (``Attempts``), whether a start or stop of it is under way, what
the start is doing now (its progress text), and an event woken whenever the model's
readiness changes or a start ends. Only the controller starts, stops and replaces
replicas; nobody else keeps a copy of this state.

The decisions are the pure functions of ``core/planning/controller.py`` (``reconcile``, ``phase``,
``unavailable``), ``core/planning/lifecycle.py`` (eviction) and ``core/planning/plan.py`` (``grow_plan``,
``stop_plan``, ``successor_first``). Their effects are carried out by apply's executor
(``remote/executor.py``) over ``Nodes`` (``gateway/control/replicas.py``): SSH, or a unit-test fake.

The request path: ``ensure_ready(model, deadline)`` returns a ready replica, or begins an
on-demand start (never while its back-off runs) and waits, woken by events rather than
polling, until a replica is ready, the start failed, or the deadline passed; then it
returns the ``Unavailable`` the request is answered with.

A start: under the lock, probe and plan (``grow_plan`` treats the starts still fetching
weights as holding their cards and ports; a start after a replica systemd gave up on
avoids that replica's cards); evict an idle on-demand replica when nothing fits (once per
run of failures: not again while the back-off runs); release the lock and bring the
weights; take the lock again, probe, re-plan once if the planned cards or port were taken
meanwhile; write and start the units. Then, outside the lock, watch the replica's health
(every ``WATCH_EVERY``) and its head unit (every ``UNIT_EVERY``, ``UnitWatch``): an engine
that exits, or one not ready within the profile's ``start_timeout``, fails the start at
once: its units are stopped, the failure is recorded with the journal's last lines, and
the requests waiting for it are answered ``model_start_failed``. A repository llmgw
fetches that no pin resolves to a commit (``core/weights/pins.py``: the pins file apply installs
beside the cluster file) is never placed: its start fails at once, saying to run apply,
and every other model starts as before.

A restart of a replica failing its health check starts its successor first when one fits
besides the cards it holds (``grow_plan``, as any start), and stops the old replica once
the successor is ready (the executor's surge replacement); when nothing fits, a start of the model is under way already, or
the successor does not come up, the old replica is restarted in place (stopped, then
started again). The actions log says which.

A replica ``apply`` drains (a drain marker on its nodes, ``core/planning/drain.py``) leaves the pool
at the first look that sees the marker and gets no decision (``core/planning/controller.py``); its
deadline, written on its node's clock, is read on this gateway's through the offset of
that node's clock in the probe (``NodeFacts.clock``).

Contract (concurrency): everything runs on the gateway's asyncio loop. A model has at most
one start or stop under way (``ModelController.busy``); every plan is made on a probe
taken under the lock (``remote/cluster_lock.py``: the cluster lock, which ``apply`` takes
too, when the gateway passes it; an asyncio lock of this process by default), so two
starts never pick the same cards. The lock is not held while weights are fetched or a
replica loads.

Last use is wall-clock time (it is persisted, so a restart keeps it); a replica found
running without a saved time is "unknown" until watched unused for its idle_timeout.
Before it stops a replica for idleness, the controller reads the stored last use again:
another gateway process may have used it since (``saved``).

Many gateway processes (``gateway/control/coordination.py``): only the leader's controller manages
(``manages``); the others follow (``following``): their phases, progress and unavailable
answers come from the leader's published ``ModelState``s, and ``_want`` asks the leader for
an on-demand start (``Following.request``) instead of beginning one. Each process forwards
at most ``ceil(model_concurrency / members)`` requests at once per ready replica, so the
processes together keep to the engine's concurrency.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from typing import Any

from llmgw_cli.core.clusterfile.spec import ClusterSpec, ScalingMode
from llmgw_cli.core.observe.facts import NodeFacts
from llmgw_cli.core.planning.controller import (
    Decision,
    Phase,
    Restart,
    Seen,
    Start,
    Stop,
    StopCause,
    Unavailable,
    UnitCondition,
    reconcile,
    unavailable,
)
from llmgw_cli.core.planning.lifecycle import eviction_candidate
from llmgw_cli.core.planning.plan import (
    Action,
    Plan,
    Running,
    conflicts,
    grow_plan,
    held_faults,
    running_replicas,
    stop_plan,
    successor_first,
)
from llmgw_cli.core.planning.replicas import (
    replica_at,
    replica_found,
    start_label,
    systemd_restarts,
    unit_condition,
    unpinned,
    unplaced_text,
)
from llmgw_cli.core.serving.redact import redact
from llmgw_cli.core.serving.routing import Health, Pool, RoutedReplica, serving_address
from llmgw_cli.errors import NodeError, NotLeader, StartBroken, StartFailed
from llmgw_cli.gateway.control.controller_state import (
    Cordons,
    Done,
    DrainClocks,
    Fetching,
    Following,
    Known,
    ModelController,
    ProgressSink,
    published_phase,
    replica_key,
    seen_in_pool,
    seen_of,
    shun,
)
from llmgw_cli.gateway.control.replicas import Nodes, PoolRouting, StartSteps, StopSteps, UnitFailure
from llmgw_cli.gateway.serving.admission import Admission
from llmgw_cli.gateway.serving.metrics import Metrics
from llmgw_cli.gateway.store.sqlite import ModelState, Store
from llmgw_cli.progress import silent
from llmgw_cli.remote.cluster_lock import Hold, LocalLock
from llmgw_cli.remote.execute import Outcome
from llmgw_cli.remote.executor import Executor

log = logging.getLogger("llmgw.controller")

WATCH_EVERY = 0.25  # seconds between health checks of a replica that is loading
UNIT_EVERY = 1.0  # seconds between looks at the unit of a replica that is loading
ACTIONS_KEPT = 200  # recent actions kept for the dashboard
FOLLOWER_LOOK = 1.0  # seconds between a waiting follower request's looks at the published state


# --- the controller ---------------------------------------------------------------------


class Controller:
    def __init__(
        self,
        spec: Callable[[], ClusterSpec],
        pool: Pool,
        admission: Admission,
        metrics: Metrics,
        health: Callable[[str, str], Awaitable[int | None]],
        *,
        nodes: Nodes | None = None,
        store: Store | None = None,
        manages: bool = False,
        lock: Hold | None = None,
        saved_last_use: dict[str, float] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.spec = spec
        self.pool = pool
        self.admission = admission
        self.metrics = metrics
        self.health = health
        self.nodes = nodes
        self.store = store
        self.manages = manages and nodes is not None  # else it only observes
        self.lock: Hold = lock if lock is not None else LocalLock()
        self.saved = dict(saved_last_use or {})  # replica key -> last use read from the store
        self.clock = clock
        self.models: dict[str, ModelController] = {}
        self.known: dict[tuple[str, int], Known] = {}
        self.actions: deque[Done] = deque(maxlen=ACTIONS_KEPT)
        self._fetching: dict[int, Fetching] = {}  # starts bringing weights, by ticket
        self._tickets = itertools.count()
        self._stopping: dict[tuple[str, int], str] = {}  # (model, replica) being stopped -> address
        self._clocks = DrainClocks()
        self._cordons = Cordons()  # nodes out for maintenance, read with every probe: no start there
        self.cordoned: frozenset[str] = frozenset()
        self.changed: Callable[[], None] | None = None  # called by every ``observe``
        # Secrets the gateway holds by value (its engine keys): never in a recorded failure.
        self.secrets: Callable[[], Iterable[str]] = tuple
        self._tasks: set[asyncio.Task[object]] = set()
        self.members = 1  # live gateway processes sharing every replica's concurrency
        self.following: Following | None = None  # set while another process leads
        # This process took the lead and manages once it has probed the nodes: a request
        # meanwhile waits for that instead of being told that nothing starts models here.
        # The coordinator sets it and clears it when it sets ``manages`` (never both true).
        self.taking_over = False

    def model(self, name: str) -> ModelController:
        found = self.models.get(name)
        if found is None:
            found = self.models[name] = ModelController(name)
        return found

    # --- the read side --------------------------------------------------------------

    def phase(self, name: str) -> Phase:
        return self.phases().get(name, Phase.stopped)

    def phases(self) -> dict[str, Phase]:
        """Every catalog model's phase now (a follower's: as the leader published it)."""
        spec, now = self.spec(), self.clock()
        by_model: dict[str, list[Seen]] = {}
        for s in self._seen(spec, now):
            by_model.setdefault(s.model, []).append(s)
        phases = {
            m.name: self.model(m.name).state.phase(
                m, by_model.get(m.name, []), now=now, backoff_first=spec.gateway.start_backoff
            )
            for m in spec.models
        }
        if self.following is not None:
            for name in phases:
                state = self.following.models.get(name)
                if state is not None:
                    phases[name] = published_phase(state, spec.model(name).mode, now)
        return phases

    def progress(self, name: str) -> str:
        if self.following is not None and name in self.following.models:
            return self.following.models[name].progress
        found = self.models.get(name)
        return found.state.progress if found is not None else ""

    def model_state(self, name: str, phase: Phase | None = None) -> ModelState:
        """The model as this process knows it: what the leader publishes, what a follower
        got from the leader's publication."""
        if self.following is not None and name in self.following.models:
            return self.following.models[name]
        state = self.model(name).state
        return ModelState(
            phase=(phase or self.phase(name)).value,
            progress=state.progress,
            failures=state.attempts.failures,
            last_failure=state.attempts.reason,
            retry_at=state.attempts.retry_at(self.spec().gateway.start_backoff),
        )

    def last_use_rows(self) -> dict[str, float]:
        """Last use of every replica in the pool, to persist."""
        return {
            replica_key(r.model, r.address): r.last_used for r in self.pool.all() if r.last_used is not None
        }

    # --- the request path -----------------------------------------------------------

    async def ensure_ready(self, name: str, deadline: float) -> RoutedReplica | Unavailable:
        """A ready replica of ``name``, or why none is (by ``deadline``, monotonic time).
        Begins an on-demand start when none is ready and none is on its way."""
        mc = self.model(name)
        while True:
            replica = self.pool.pick(name, time.monotonic())
            if replica is not None:
                return replica
            self._want(name)
            if not self._on_its_way(name):
                break
            left = deadline - time.monotonic()
            if left <= 0:
                break
            # A follower also looks again every FOLLOWER_LOOK: the leader's publication
            # wakes it (``Coordinator``), but a start it asked for may never be taken.
            await mc.changed(min(left, FOLLOWER_LOOK) if self.following is not None else left)
        return self.unavailable(name)

    def unavailable(self, name: str) -> Unavailable:
        spec = self.spec()
        mc = self.model(name)
        following = self.following
        leaders = following.unavailable(spec, name, self.phase(name), self.clock()) if following else None
        if leaders is not None:
            return leaders
        return unavailable(
            spec.model(name),
            self.phase(name),
            mc.state.attempts,
            progress=mc.state.progress,
            manages=self.manages
            or self.taking_over
            or (following is not None and spec.gateway.manage_replicas),
            now=self.clock(),
            backoff_first=spec.gateway.start_backoff,
        )

    def _on_its_way(self, name: str) -> bool:
        if any(r.health in (Health.loading, Health.unknown) for r in self.pool.of(name)):
            return True
        following = self.following
        if following is None:
            return self.model(name).state.starting or self.taking_over
        return following.on_its_way(name, self.spec().model(name).mode, self.clock())

    def want(self, name: str) -> None:
        """A start asked for by another gateway process (through the store): begun as one
        asked for by a request here, when it may."""
        self._want(name)

    def _want(self, name: str) -> None:
        """Begin an on-demand start of ``name`` when it may: it runs on demand, this gateway
        manages replicas, none is starting or loading, and its back-off is over. A follower
        asks the leader instead (at most once per ``REQUEST_EVERY``)."""
        spec = self.spec()
        found = next((m for m in spec.models if m.name == name), None)
        if found is None or found.mode is not ScalingMode.on_demand:
            return
        if self.following is not None:
            self._ask(name)
            return
        if not self.manages:
            return
        mc = self.model(name)
        if mc.state.starting or self._on_its_way(name):
            return
        retry_at = mc.state.attempts.retry_at(spec.gateway.start_backoff)
        if retry_at is not None and retry_at > self.clock():
            return
        self._begin(Start(name, "requested"))

    def _ask(self, name: str) -> None:
        """A follower's on-demand start: the leader is asked, unless a start is on its way,
        the published back-off runs, or it was asked within ``REQUEST_EVERY``."""
        following = self.following
        assert following is not None
        if not self.spec().gateway.manage_replicas:
            return  # the leader starts nothing either
        if any(r.health in (Health.loading, Health.unknown) for r in self.pool.of(name)):
            return
        following.ask(name, self.clock())

    # --- what discovery and health checks tell --------------------------------------

    def with_starts(self, found: dict[str, list[str]]) -> dict[str, list[str]]:
        """Discovery's addresses plus the replicas being started (their units may not be
        active yet, and the start watches them), less the ones being stopped (a probe made
        before their stop still lists them) and those being drained (discovery leaves them
        out itself: ``Running.serving``; this holds for a look taken between two probes)."""
        gone = {(name, address) for (name, _), address in self._stopping.items()}
        gone |= {(k.model, k.address) for k in self.known.values() if k.draining is not None}
        for name, address in gone:
            if address in found.get(name, ()):
                found[name] = [a for a in found[name] if a != address]
        for name, mc in self.models.items():
            for address in mc.state.loading:
                if address not in found.setdefault(name, []):
                    found[name].append(address)
        return found

    def observe(self) -> None:
        """After discovery, a health check or a start or stop: admission follows the ready
        count, and the waiters of a model whose readiness changed are woken."""
        spec = self.spec()
        # This process's share: the processes together forward model_concurrency per replica.
        per_replica = math.ceil(spec.gateway.model_concurrency / max(1, self.members))
        for m in spec.models:
            replicas = self.pool.of(m.name)
            ready = sum(r.health is Health.ready for r in replicas)
            limit = per_replica * max(1, ready)
            if self.admission.limit(m.name) != limit:
                self.admission.resize(m.name, limit)
            mc = self.model(m.name)
            look = (ready, sum(r.health in (Health.loading, Health.unknown) for r in replicas))
            if look != mc.state.look:
                mc.state = mc.state.looked(*look)
                mc.wake()
        if self.changed is not None:
            self.changed()

    def draining(self) -> frozenset[str]:
        """The addresses of the replicas this gateway knows are being drained (a
        follower: those the leader published)."""
        if self.following is not None:
            return self.following.draining
        return frozenset(k.address for k in self.known.values() if k.draining is not None)

    # --- the reconcile tick -----------------------------------------------------------

    async def tick(self) -> None:
        """Every second or so: note what changed, and (when managing) carry out what
        ``reconcile`` decides."""
        spec, now = self.spec(), self.clock()
        for replica in self.pool.all():
            key = replica_key(replica.model, replica.address)
            if replica.last_used is None and key in self.saved:
                replica.last_used = self.saved[key]  # known from before a restart
        seen = self._seen(spec, now)
        for s in seen:
            if s.draining is not None:
                # never routed, even before discovery's next round drops it (the
                # controller's own probes see a marker first, sometimes)
                self.pool.remove(s.model, s.address)
        self.observe()
        if not self.manages or self.nodes is None or not self.nodes.facts:
            return
        busy = {name for name, mc in self.models.items() if mc.state.busy}
        monotonic = time.monotonic()
        waits = {m.name: self.admission.oldest_wait(m.name, monotonic) for m in spec.models}
        attempts = {m.name: self.model(m.name).state.attempts for m in spec.models}
        decisions = reconcile(spec, seen, attempts, busy, waits, now=now)
        by_model: dict[str, list[Decision]] = {}
        for d in decisions:
            by_model.setdefault(d.model, []).append(d)
        for name, todo in by_model.items():
            self._carry_out(name, todo, seen)

    def _carry_out(self, name: str, todo: list[Decision], seen: Sequence[Seen]) -> None:
        """One model's decisions, in order (stops before the start that follows them)."""
        mc = self.model(name)
        stops = [d for d in todo if not isinstance(d, Start)]
        start = next((d for d in todo if isinstance(d, Start)), None)
        if start is not None:
            self._mark_replaced(start, seen)
        if not stops and start is not None:
            self._begin(start)
            return
        mc.state = mc.state.stop_began()

        async def run() -> None:
            then = start
            try:
                for d in stops:
                    if isinstance(d, Stop):
                        await self._stop(d.model, d.replica, d.reason, d.cause.value)
                        continue
                    in_place = await self._successor_first(d)
                    if not in_place:
                        continue  # its successor serves; it was stopped
                    reason = f"{d.reason}; restarted in place: {in_place}"
                    if await self._stop(d.model, d.replica, reason, d.cause):
                        self._record(d.model, "restart", reason, d.cause)
                        then = then or Start(d.model, f"restart of replica {d.replica}: {reason}")
            finally:
                mc.state = mc.state.stop_ended()
            if then is not None and not mc.state.starting:
                self._begin(then)

        self._spawn(run())

    async def _successor_first(self, restart: Restart) -> str:
        """Replace a replica failing its health check successor first: a successor placed
        as any start is (``grow_plan``, around everything on the nodes, the old replica's
        cards included) and started by the executor, which stops the old replica once it
        is ready. Returns "" when that was done, else why the replica must be restarted in
        place instead (nothing fits besides its own cards, a start of the model is under
        way already, or the successor did not come up)."""
        assert self.nodes is not None
        spec, model = self.spec(), restart.model
        mc = self.model(model)
        unresolved = unpinned(spec, model)
        if unresolved:
            return unresolved
        async with self.lock.hold(f"place a successor of {model}#{restart.replica}"):
            facts = await self._probe(spec)
            plan = grow_plan(spec, facts, model, reserved=self._reserved(), cordoned=self.cordoned)
        if not plan.changes:
            return f"no free cards for a successor ({unplaced_text(plan)})"
        if mc.state.starting:
            return "a start of the model is under way already"
        self._record(
            model,
            "replace",
            f"replica {restart.replica} {restart.reason}: a successor starts first; "
            f"replica {restart.replica} is stopped once it is ready",
            restart.cause,
        )
        mc.state = mc.state.start_began("probing the nodes to place a successor")
        mc.wake()
        successor = await self._start(
            Start(model, f"restart of replica {restart.replica}, successor first: {restart.reason}"),
            replacing=restart,
        )
        return "" if successor is not None else "its successor did not start"

    def _mark_replaced(self, start: Start, seen: Sequence[Seen]) -> None:
        """A start while a replica of the model is lost past node_grace replaces it."""
        grace = self.spec().gateway.node_grace
        now = self.clock()
        for s in seen:
            if s.model != start.model or s.units is not UnitCondition.lost or s.replaced:
                continue
            if s.lost_since is None or now - s.lost_since < grace:
                continue
            known = self.known.get((s.model, s.replica))
            if known is not None:
                known.replaced = True
            log.info("%s: replacing replica %d: %s", s.model, s.replica, start.reason)
            self._record(s.model, "replace", start.reason, "node-lost")

    # --- what is seen ------------------------------------------------------------------

    def _seen(self, spec: ClusterSpec, now: float) -> list[Seen]:
        """Every replica as the controller sees it now: from the last probe, the pool and
        memory (a replica on a node that stopped answering is not in the probe)."""
        # A follower does not probe: facts kept from a time it led are stale.
        facts = self.nodes.facts if self.nodes is not None and self.following is None else {}
        catalog = {m.name: m for m in spec.models}
        in_pool = {(r.model, r.address): r for r in self.pool.all()}
        seen: list[Seen] = []
        if not facts:  # a fixed replica list, or nothing probed yet: the pool only
            return seen_in_pool(list(catalog), self.pool, now)
        nodes = {n.name: n for n in spec.nodes}
        unreachable = {name for name, f in facts.items() if not f.reachable}
        current: set[tuple[str, int]] = set()
        for r in running_replicas(facts):
            if r.model not in catalog or not r.members or r.members[0] not in nodes or not r.port:
                continue
            key = (r.model, r.replica)
            if key in self._stopping:
                continue
            address = serving_address(nodes[r.members[0]].engine_host, r.port)
            known = self.known.get(key)
            if known is None or known.address != address:
                known = self.known[key] = Known(r.model, r.replica, address, r.members, now)
            known.nodes, known.port, known.held = r.members, r.port, r.gpus
            known.draining = self._clocks.deadline(r, facts, now)
            restarts = systemd_restarts(r)
            if known.restarts is not None and restarts > known.restarts:
                # systemd started its engine again: a new engine, judged as a fresh start
                # from now (it loads again, within its start timeout)
                known.ready_at = known.failing_since = None
                known.first_seen = now
            known.restarts = restarts
            current.add(key)
            served = known.ready_at is not None
            seen.append(
                seen_of(
                    spec,
                    known,
                    unit_condition(r, facts, unreachable, served=served),
                    in_pool,
                    saved=self.saved,
                    now=now,
                    faults=held_faults(r, facts),
                )
            )
        for key, known in list(self.known.items()):
            if key in current or key in self._stopping:
                continue
            if known.model in catalog and any(n in unreachable or n not in facts for n in known.nodes):
                seen.append(seen_of(spec, known, UnitCondition.lost, in_pool, saved=self.saved, now=now))
            else:
                del self.known[key]  # gone from the nodes
        return seen

    # --- effects: background work -----------------------------------------------------

    def _spawn(self, job: Coroutine[Any, Any, object]) -> None:
        task = asyncio.create_task(job)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_deposed)

    async def stop(self) -> None:
        """The gateway is stopping: cancel what is under way."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def idle(self) -> None:
        """Until no start or stop is under way (tests)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def _record(self, model: str, action: str, reason: str, label: str) -> None:
        self.actions.append(Done(self.clock(), model, action, reason))
        self.metrics.acted(model, action, label)

    def _begin(self, start: Start) -> None:
        if start_label(start) == "scale-out":
            self.metrics.scaled_out(start.model)
        mc = self.model(start.model)
        mc.state = mc.state.start_began("probing the nodes to place a replica")
        mc.wake()
        self._spawn(self._start(start))

    # --- starts -----------------------------------------------------------------------

    async def _start(self, start: Start, replacing: Restart | None = None) -> str | None:
        """Place, start and watch one replica; its address once ready, None when the start
        failed (recorded, its units stopped). ``replacing``: the replica it replaces, stopped
        once it is ready."""
        spec = self.spec()
        mc = self.model(start.model)
        began = time.monotonic()
        address: str | None = None
        placed: tuple[str, ...] = ()
        try:
            address = await self._place_and_start(spec, start, mc, began, replacing)
            mc.state = mc.state.start_succeeded()
            return address
        except NotLeader as exc:  # not a failure of the model: another process leads now
            log.warning("%s: start abandoned: %s", start.model, exc)
            return None
        except Exception as exc:  # an unexpected failure must still end the start
            if isinstance(exc, StartBroken):
                address, placed = exc.address, exc.nodes
            why = str(exc) if isinstance(exc, StartFailed) else f"{type(exc).__name__}: {exc}"
            if not isinstance(exc, StartFailed):
                log.exception("%s: start failed", start.model)
            await self._failed(spec, start.model, address, why, began, nodes=placed)
            return None
        finally:
            mc.state = mc.state.start_ended(address)
            mc.wake()
            self.observe()

    async def _failed(
        self,
        spec: ClusterSpec,
        model: str,
        address: str | None,
        why: str,
        began: float,
        *,
        nodes: tuple[str, ...] = (),
    ) -> None:
        """A start failed: its units go (the cards come back), the failure is recorded with
        the ``nodes`` it was placed on (the next start passes them by when it can), and its
        waiters are answered at once."""
        mc = self.model(model)
        if address is not None:
            try:
                async with self.lock.hold(f"stop {model} after a failed start"):
                    facts = await self._probe(spec)
                    found = replica_at(spec, facts, model, address)
                    if found is not None:
                        await self._stop_found(
                            spec, facts, found, address, "its start failed", force=True, label="start-failed"
                        )
                    self.pool.remove(model, address)
            except Exception:
                log.exception("%s: could not stop the replica whose start failed", model)
        # Recorded, shown on the dashboard and published to the followers: without secrets.
        why = redact(why, self.secrets())
        mc.state = mc.state.start_failed(why, self.clock(), nodes)
        self.metrics.loaded(model, time.monotonic() - began, ok=False)
        log.error("%s: start failed: %s", model, why)
        self._record(model, "start-failed", why, "start-failed")

    async def _probe(self, spec: ClusterSpec) -> dict[str, NodeFacts]:
        """The nodes' facts, and the cordons read again with them: every placement is made
        on a probe taken under the lock, so it sees a cordon set before that probe."""
        assert self.nodes is not None
        self.cordoned = await self._cordons.read(spec, self.store)
        return await self.nodes.probe(spec)

    def _grow(
        self,
        spec: ClusterSpec,
        facts: dict[str, NodeFacts],
        start: Start,
        mc: ModelController,
        *,
        reserved: list[Action],
    ) -> Plan:
        """Where ``start`` goes (``grow_plan``): not on the cards it avoids, on the nodes it
        shuns only when it fits nowhere else, never on a cordoned node."""
        avoid, shunned = start.avoid, shun(start, mc)
        return grow_plan(
            spec, facts, start.model, reserved=reserved, avoid=avoid, shun=shunned, cordoned=self.cordoned
        )

    def _reserved(self, but: int | None = None) -> list[Action]:
        """What a new start must not take besides the units on the nodes: the starts still
        bringing weights, and the replicas on nodes that stopped answering (their units are
        not in the probe, but their replica numbers, cards and ports are still theirs)."""
        fetching = [s.action for i, s in self._fetching.items() if i != but]
        return fetching + [k.held_action() for k in self.known.values() if k.lost_since is not None]

    async def _place_and_start(
        self, spec: ClusterSpec, start: Start, mc: ModelController, began: float, replacing: Restart | None
    ) -> str:
        """Place a replica under the lock (an eviction when nothing fits), then the
        executor brings its weights, writes and starts it and waits until it is ready (and
        then drains and stops the replica it is ``replacing``); its address then."""
        assert self.nodes is not None
        model = start.model
        unresolved = unpinned(spec, model)
        if unresolved:
            raise StartFailed(unresolved)
        ticket = next(self._tickets)
        async with self.lock.hold(f"place a replica of {model}"):
            facts = await self._probe(spec)
            plan = self._grow(spec, facts, start, mc, reserved=self._reserved())
            if not plan.changes:
                plan = await self._evict_for(spec, facts, plan, start, mc)
            action = plan.changes[0]
            self._fetching[ticket] = Fetching(action, plan)
            old = replica_found(facts, model, replacing.replica) if replacing is not None else None
        where: dict[str, str] = {}

        async def place(planned: Action) -> Action:
            placed = await self._placed_again(spec, start, mc, ticket, planned)
            self._starting(start, placed)
            return placed

        async def written(placed: Action, outcomes: list[Outcome]) -> None:
            where["address"] = await self._written(spec, model, placed, outcomes)
            # The head node's clock just before its units started: the start's own, not
            # the tick's (which may drop and remake the replica's Known meanwhile, when
            # its last probe predates the units), so an engine that exited at once has
            # its last words read from the journal.
            where["since"] = next((o.since for o in outcomes if o.subject == placed.nodes[0]), "")

        async def watch(placed: Action) -> None:
            try:
                await self._watch(spec, model, placed, where["address"], began, since=where.get("since", ""))
            except StartFailed as exc:
                raise StartBroken(str(exc), where["address"], placed.nodes) from exc

        steps = StartSteps(spec, self.nodes, self.lock, plan, place, written, watch)
        try:
            if old is None or replacing is None:
                executor = Executor(steps, PoolRouting(self.pool, "", False), ProgressSink(mc, self.secrets))
                await executor.start([action], f"start a replica of {model}")
            else:
                surge = successor_first(action, old, start.reason)
                await self._replace(spec, steps, surge, old, restart=replacing, where=where)
        finally:
            self._fetching.pop(ticket, None)
        return where["address"]

    async def _replace(
        self,
        spec: ClusterSpec,
        steps: StartSteps,
        action: Action,
        old: Running,
        *,
        restart: Restart,
        where: dict[str, str],
    ) -> None:
        """The executor's surge replacement of ``old`` by ``action``'s successor, started
        through ``steps``; the old replica, out of the pool, stopped under the lock."""
        assert self.nodes is not None
        gone = serving_address(spec.node(old.members[0]).engine_host, old.port)

        def before() -> None:
            reason = f"replaced by its successor at {where['address']}, ready ({restart.reason})"
            self._stopping_now(old, gone, reason, label=StopCause.replaced.value)

        steps.stop = StopSteps(spec, self.nodes, before)
        executor = Executor(
            steps, PoolRouting(self.pool, gone, True), ProgressSink(self.model(old.model), self.secrets)
        )
        try:
            rolled = await executor.replace(action)
        finally:
            self._stopping.pop((old.model, old.replica), None)
        if rolled.retired:
            await self._forget(old.model, old.replica, gone)

    async def _placed_again(
        self, spec: ClusterSpec, start: Start, mc: ModelController, ticket: int, action: Action
    ) -> Action:
        """Under the lock: where the start goes now; placed again once when its planned
        cards or port were taken while it brought its weights (its weights are brought with
        the write then: rare, only when another writer took them)."""
        facts = await self._probe(spec)
        taken = conflicts(facts, action)
        if taken is not None:
            log.info("%s: re-planning: %s", start.model, taken)
            plan = self._grow(spec, facts, start, mc, reserved=self._reserved(ticket))
            if not plan.changes:
                raise StartFailed(f"{taken}; {unplaced_text(plan)}")
            action = plan.changes[0]
        del self._fetching[ticket]
        return action

    async def _evict_for(
        self, spec: ClusterSpec, facts: dict[str, NodeFacts], plan: Plan, start: Start, mc: ModelController
    ) -> Plan:
        """Stop an idle on-demand replica of another model so ``start`` fits; once per run
        of failed starts (an eviction is not repeated while the back-off runs)."""
        why = unplaced_text(plan)
        if mc.state.evicted and mc.state.attempts.failures:
            raise StartFailed(f"{why}; an eviction for it was done already and its start failed since")
        now = self.clock()
        uses = [s.use for s in self._seen(spec, now) if s.units is UnitCondition.up and s.draining is None]
        victim = eviction_candidate(spec, uses, start.model, now, spec.gateway.eviction_grace)
        if victim is None:
            raise StartFailed(f"{why}; no idle on-demand replica may be evicted")
        known = self.known.get((victim.model, victim.replica))
        found = next(
            (r for r in running_replicas(facts) if (r.model, r.replica) == (victim.model, victim.replica)),
            None,
        )
        if known is None or found is None:
            raise StartFailed(f"{why}; the replica chosen for eviction is gone")
        reason = f"evicted to make room for {start.model}"
        if not await self._stop_found(
            spec, facts, found, known.address, reason, action="evict", label="evict"
        ):
            raise StartFailed(f"{why}; the replica chosen for eviction got a request meanwhile")
        mc.state = mc.state.evicted_now()
        self.metrics.evicted(victim.model)
        assert self.nodes is not None
        facts = self.nodes.facts  # probed by the stop, after it
        plan = self._grow(spec, facts, start, mc, reserved=self._reserved())
        if not plan.changes:
            raise StartFailed(unplaced_text(plan) or "no room after an eviction")
        return plan

    def _starting(self, start: Start, action: Action) -> None:
        """Under the lock, just before the units are written: the start recorded."""
        log.info(
            "%s: starting replica %d on %s (%s)",
            start.model,
            action.replica,
            ",".join(action.nodes),
            start.reason,
        )
        self._record(start.model, "start", start.reason, start_label(start))
        mc = self.model(start.model)
        mc.state = mc.state.start_progress(f"starting on {','.join(action.nodes)}")

    async def _written(self, spec: ClusterSpec, model: str, action: Action, outcomes: list[Outcome]) -> str:
        """Under the lock, the units written and started: the replica in the pool, loading."""
        mc = self.model(model)
        assert action.port is not None
        address = serving_address(spec.node(action.nodes[0]).engine_host, action.port)
        broken = [f"{o.subject}: {o.message}" for o in outcomes if not o.ok]
        if broken:
            mc.state = mc.state.loading_at(address)  # so the failure stops what was written
            raise StartBroken("; ".join(broken), address, action.nodes)
        mc.state = mc.state.start_progress("engine loading").loading_at(address)
        now = self.clock()
        self.known[(model, action.replica)] = Known(
            model, action.replica, address, action.nodes, now, action.port, dict(action.gpus)
        )
        replica = self.pool.add(model, address, time.monotonic())
        replica.last_used = now  # the request that asked for it is about to use it
        await self._probe(spec)  # so the next look sees its units (and their cards)
        return address

    async def _watch(
        self, spec: ClusterSpec, model: str, action: Action, address: str, began: float, *, since: str
    ) -> None:
        """Health every WATCH_EVERY and the head unit every UNIT_EVERY, until ready; an
        engine that exits, or one not ready after the profile's start_timeout, fails.
        ``since``: the head node's clock before the units started ("": its clock now)."""
        assert self.nodes is not None
        timeout = spec.profiles[spec.model(model).profile].readiness.start_timeout
        mc = self.model(model)
        try:
            watch: UnitFailure | None = await self.nodes.watch(spec, action, since)
        except NodeError as exc:
            log.warning("%s: cannot watch the unit of replica %d: %s", model, action.replica, exc)
            watch = None
        next_unit = 0.0
        while True:
            now = time.monotonic()
            replica = self.pool.add(model, address, now)
            if replica.health is not Health.ready:
                status = await self.health(address, model)
                self.pool.checked(replica, status, time.monotonic())
            if replica.health is Health.ready:
                break
            if watch is not None and now >= next_unit:
                next_unit = now + UNIT_EVERY
                try:
                    why = await watch.failure()
                except NodeError as exc:  # an SSH hiccup is not a failed engine
                    log.warning("%s: cannot read the unit of replica %d: %s", model, action.replica, exc)
                    why = None
                if why:
                    raise StartFailed(why)
            if time.monotonic() - began >= timeout:
                raise StartFailed(f"not ready after {timeout:g}s (the profile's start_timeout)")
            await asyncio.sleep(WATCH_EVERY)
        seconds = time.monotonic() - began
        known = self.known.get((model, action.replica))
        if known is not None:
            known.ready_at = self.clock()
        mc.state = mc.state.ready(address)
        self.metrics.loaded(model, seconds)
        log.info("%s: %s ready after %.1fs", model, address, seconds)
        self.observe()

    # --- stops ------------------------------------------------------------------------

    async def _stop(self, model: str, replica: int, reason: str, cause: str) -> bool:
        spec = self.spec()
        async with self.lock.hold(f"stop {model}#{replica}"):
            facts = await self._probe(spec)
            found = next(
                (r for r in running_replicas(facts) if (r.model, r.replica) == (model, replica)), None
            )
            known = self.known.get((model, replica))
            if found is None:
                if known is not None and not any(
                    not (facts.get(n) and facts[n].reachable) for n in known.nodes
                ):
                    self.known.pop((model, replica), None)  # gone already
                return False
            address = serving_address(spec.node(found.members[0]).engine_host, found.port)
            if cause == StopCause.idle.value:
                await self._read_last_use()
                if not self._still_idle(spec, model, address):
                    return False  # used meanwhile, here or through another gateway process
            stopped = await self._stop_found(
                spec, facts, found, address, reason, force=cause != StopCause.idle.value, label=cause
            )
            if stopped and cause == StopCause.idle.value:
                self.metrics.idle_stopped(model)
            return stopped

    def _still_idle(self, spec: ClusterSpec, model: str, address: str) -> bool:
        """Nothing used the replica since the tick found it idle: not this process (its
        pool), nor another one (the last use it stored, read again just before)."""
        found = spec.model(model)
        idle_timeout = found.scaling.idle_timeout if found.scaling else None
        if idle_timeout is None:
            return False
        saved = self.saved.get(replica_key(model, address))
        if saved is not None and self.clock() - saved < idle_timeout:
            return False
        routed = next((r for r in self.pool.of(model) if r.address == address), None)
        if routed is None:
            return True
        if routed.outstanding:
            return False
        return routed.last_used is None or self.clock() - routed.last_used >= idle_timeout

    async def _stop_found(
        self,
        spec: ClusterSpec,
        facts: dict[str, NodeFacts],
        found: Running,
        address: str,
        reason: str,
        *,
        force: bool = False,
        action: str = "stop",
        label: str = "",
    ) -> bool:
        """Take the replica out of rotation, then stop it, unless a request is in flight on
        it and ``force`` is not given (it is put back then). Called under the lock."""
        assert self.nodes is not None
        model = found.model

        def before() -> None:
            self._stopping_now(found, address, reason, action=action, label=label or action)

        (removal,) = stop_plan(facts, model, found.replica, reason).changes
        executor = Executor(
            StopSteps(spec, self.nodes, before), PoolRouting(self.pool, address, force), silent
        )
        try:
            stopped, outcomes = await executor.stop(removal)
        finally:
            self._stopping.pop((model, found.replica), None)
        if not stopped:
            return False
        await self._forget(model, found.replica, address)
        return all(o.ok for o in outcomes)

    def _stopping_now(
        self, found: Running, address: str, reason: str, *, action: str = "stop", label: str
    ) -> None:
        """A replica's units are about to go: logged, recorded, and not seen while it stops
        (the last probe still shows it running) nor until the probe after the stop."""
        log.info("%s: stopping replica %d at %s: %s", found.model, found.replica, address, reason)
        self._record(found.model, action, reason, label)
        self._stopping[(found.model, found.replica)] = address

    async def _forget(self, model: str, replica: int, address: str) -> None:
        """A replica stopped: nothing of it is remembered, here or in the store."""
        self.known.pop((model, replica), None)
        key = replica_key(model, address)
        self.saved.pop(key, None)
        if self.store is not None:
            await self.store.forget_last_use([key])
        self.observe()

    async def _read_last_use(self) -> None:
        """The stored last use again (every gateway process saves its own), before an idle
        stop; a store that cannot be read keeps what was read before."""
        if self.store is None:
            return
        try:
            self.saved = await self.store.last_use()
        except Exception as exc:
            log.warning("cannot read the stored last use of the replicas: %s", exc)


def _deposed(task: asyncio.Task[object]) -> None:
    """A start or stop that met the fence check (this process leads no more) ends with a
    line in the log, not a traceback: the new leader decides from here."""
    if not task.cancelled() and isinstance(task.exception(), NotLeader):
        log.warning("controller work abandoned: %s", task.exception())
