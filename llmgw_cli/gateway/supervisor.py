"""The on-demand supervisor: starts a model at its first request, stops idle replicas,
evicts an idle replica to make room, starts one more replica of a saturated model.

Decisions are the pure functions of ``core/lifecycle.py`` (which replica is idle, which
one may be evicted, when to scale out) and ``core/plan.py`` (``grow_plan``, the placement
rules of ``apply``; ``stop_plan``), made on facts probed right before. Effects go through
the executor of ``apply`` (``remote/execute.py``) without its readiness wait: the
supervisor watches the new replica's health itself and puts it into rotation when ready.

Contract (concurrency): everything runs on the gateway's asyncio loop. One lock per
model makes that model's transitions one at a time (a request for a model that is
starting joins the start under way). One lock over the cards serializes every start and
stop, because each is planned on a probe made under it: two starts planned on one probe
would pick the same free cards. The order is always model lock, then cards lock; an
eviction stops another model's replica under the cards lock only, after taking it out
of rotation and checking that nothing is in flight on it.
Inside the cards lock, the cluster lock (``remote/cluster_lock.py``, a file lock on the
gateway host) keeps `apply` from writing units while a start or stop is planned and made.

Last use is wall-clock time (it is persisted, so a restart keeps it); a replica found
running without a saved time is "unknown" until watched unused for its idle_timeout.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from llmgw_cli.core.facts import NodeFacts
from llmgw_cli.core.lifecycle import (
    ReplicaUse,
    eviction_candidate,
    idle_to_stop,
    known_last_use,
    should_scale_out,
)
from llmgw_cli.core.plan import Plan, Running, grow_plan, running_replicas, stop_plan
from llmgw_cli.core.routing import Health, serving_address
from llmgw_cli.core.spec import ClusterSpec, ScalingMode
from llmgw_cli.errors import StartFailed
from llmgw_cli.polling import poll_until
from llmgw_cli.remote.cluster_lock import Hold, LocalLock
from llmgw_cli.remote.execute import execute

if TYPE_CHECKING:
    from llmgw_cli.gateway.sources import ProbeSource
    from llmgw_cli.gateway.state import Gateway

log = logging.getLogger("llmgw.supervisor")

RETRY_AFTER_FAILURE = 30.0  # seconds before a model whose start failed is tried again
WATCH_EVERY = 0.25  # seconds between health checks of a replica that is loading


def replica_key(model: str, address: str) -> str:
    return f"{model}@{address}"


class Supervisor:
    def __init__(
        self,
        gw: Gateway,
        source: ProbeSource,
        *,
        saved_last_use: dict[str, float] | None = None,
        clock: Callable[[], float] = time.time,
        lock: Hold | None = None,
    ) -> None:
        self.gw = gw
        self.source = source
        self.clock = clock
        self.model_locks: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self.cards = asyncio.Lock()
        # the cluster lock: apply's unit writes and these starts and stops, one at a time
        self.lock: Hold = lock if lock is not None else LocalLock()
        self.starting: dict[str, float] = {}  # model -> monotonic time its start began
        self.failed: dict[str, tuple[float, str]] = {}  # model -> (monotonic time, why)
        self.saved = dict(saved_last_use or {})  # replica key -> last use read from the store
        self.first_seen: dict[str, float] = {}  # replica key -> wall time first seen running
        self.ready_at: dict[str, float] = {}  # replica key -> wall time first seen ready
        self.watching: set[tuple[str, str]] = set()  # (model, address) started, not ready yet
        self.progress: dict[str, str] = {}  # model -> what its start is doing now
        self._tasks: set[asyncio.Task[None]] = set()

    # --- what the request path asks ---------------------------------------------------

    def want(self, model: str) -> None:
        """A request found no ready replica of ``model``: start one if it runs on demand,
        none is starting, and its last start did not fail moments ago. Never waits."""
        found = self.gw.catalog.get(model)
        if found is None or found.mode is not ScalingMode.on_demand or model in self.starting:
            return
        if self.failure(model) is not None:
            return
        if any(r.health in (Health.loading, Health.unknown) for r in self.gw.pool.of(model)):
            return  # one is on its way already (found running by discovery)
        self._begin(model, "requested")

    def failure(self, model: str) -> str | None:
        """Why the last start of ``model`` failed, while that is recent enough to matter."""
        failed = self.failed.get(model)
        if failed is None or time.monotonic() - failed[0] > RETRY_AFTER_FAILURE:
            return None
        return failed[1]

    # --- background work ------------------------------------------------------------

    def _begin(self, model: str, reason: str) -> None:
        self.starting[model] = time.monotonic()
        self.progress[model] = "probing the nodes to place a replica"
        self._spawn(self._start(model, reason))

    def _spawn(self, job: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(job)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def tick(self) -> None:
        """Called every second or so: note readiness, stop idle replicas, scale out."""
        spec, now = self.gw.spec, self.clock()
        for replica in self.gw.pool.all():
            key = replica_key(replica.model, replica.address)
            if replica.last_used is None and key in self.saved:
                replica.last_used = self.saved[key]  # known from before a restart
            if replica.health is Health.ready:
                self.ready_at.setdefault(key, now)
        facts = self.source.facts
        if not facts:
            return
        uses, _ = self._uses(spec, facts, now)
        if not self.cards.locked():  # a start or stop is under way: look again next tick
            for use in idle_to_stop(spec, uses, now):
                self._spawn(self._idle_stop(use))
        monotonic = time.monotonic()
        # The pool, not the last probe: a replica started since then is in the pool already.
        running = Counter(r.model for r in self.gw.pool.all())
        for model in spec.models:
            wait = self.gw.admission.oldest_wait(model.name, monotonic)
            if wait and should_scale_out(
                spec,
                model.name,
                replicas=running[model.name],
                starting=model.name in self.starting,
                queue_wait=wait,
                threshold=spec.gateway.scale_out_wait,
            ):
                log.info(
                    "%s: requests waited %.1fs in its queue: starting one more replica", model.name, wait
                )
                self.gw.metrics.scaled_out(model.name)
                self._begin(model.name, "scale out")

    def last_use_rows(self) -> dict[str, float]:
        """Last use of every replica in the pool, to persist."""
        return {
            replica_key(r.model, r.address): r.last_used
            for r in self.gw.pool.all()
            if r.last_used is not None
        }

    # --- the state the policy reads ---------------------------------------------------

    def _uses(
        self, spec: ClusterSpec, facts: dict[str, NodeFacts], now: float
    ) -> tuple[list[ReplicaUse], dict[tuple[str, int], tuple[Running, str]]]:
        """What the gateway knows about every replica on the nodes, and each one's unit
        and serving address by (model, replica)."""
        nodes = {n.name: n for n in spec.nodes}
        pool = {(r.model, r.address): r for r in self.gw.pool.all()}
        models = {m.name: m for m in spec.models}
        uses: list[ReplicaUse] = []
        where: dict[tuple[str, int], tuple[Running, str]] = {}
        for r in running_replicas(facts):
            if not r.members or r.members[0] not in nodes or not r.port:
                continue
            address = serving_address(nodes[r.members[0]].engine_host, r.port)
            key = replica_key(r.model, address)
            first = self.first_seen.setdefault(key, now)
            in_pool = pool.get((r.model, address))
            times = [
                t for t in (in_pool.last_used if in_pool else None, self.saved.get(key)) if t is not None
            ]
            model = models.get(r.model)
            idle_timeout = model.scaling.idle_timeout if model and model.scaling else None
            uses.append(
                ReplicaUse(
                    model=r.model,
                    replica=r.replica,
                    nodes=len(r.members),
                    ready_at=self.ready_at.get(key),
                    last_used=known_last_use(max(times) if times else None, first, idle_timeout, now),
                    in_flight=in_pool.outstanding if in_pool else 0,
                )
            )
            where[(r.model, r.replica)] = (r, address)
        return uses, where

    # --- effects ----------------------------------------------------------------------

    async def _start(self, model: str, reason: str) -> None:
        started = time.monotonic()
        spec = self.gw.spec
        try:
            async with self.model_locks[model], self.cards, self.lock.hold(f"starting model {model}"):
                address = await self._place_and_start(spec, model, reason)
            await self._watch(spec, model, address, started)
        except StartFailed as exc:
            self.failed[model] = (time.monotonic(), str(exc))
            self.gw.metrics.loaded(model, time.monotonic() - started, ok=False)
            log.error("%s: start failed: %s", model, exc)
        except Exception as exc:  # an unexpected failure must still end the start
            self.failed[model] = (time.monotonic(), f"{type(exc).__name__}: {exc}")
            self.gw.metrics.loaded(model, time.monotonic() - started, ok=False)
            log.exception("%s: start failed", model)
        finally:
            self.starting.pop(model, None)
            self.progress.pop(model, None)

    async def _place_and_start(self, spec: ClusterSpec, model: str, reason: str) -> str:
        facts = await self.source.probe(spec)
        plan = grow_plan(spec, facts, model)
        if not plan.changes:
            uses, where = self._uses(spec, facts, self.clock())
            victim = eviction_candidate(spec, uses, model, self.clock(), spec.gateway.eviction_grace)
            why = "; ".join(r for _, r in plan.unplaced) or "no room"
            if victim is None:
                raise StartFailed(f"{why}; no idle on-demand replica may be evicted")
            if not await self._stop_replica(spec, facts, victim, where, f"evicted to make room for {model}"):
                raise StartFailed(f"{why}; the replica chosen for eviction got a request meanwhile")
            self.gw.metrics.evicted(victim.model)
            facts = await self.source.probe(spec)
            plan = grow_plan(spec, facts, model)
            if not plan.changes:
                raise StartFailed("; ".join(r for _, r in plan.unplaced) or "no room after an eviction")
        (action,) = plan.changes[:1]
        log.info("%s: starting replica %d on %s (%s)", model, action.replica, ",".join(action.nodes), reason)

        def report(subject: str, message: str) -> None:
            _log_report(subject, message)
            self.progress[model] = f"{subject}: {message}"  # e.g. weights being fetched

        self.progress[model] = f"starting on {','.join(action.nodes)}"
        outcomes = await execute(spec, await self.source.connections(spec), plan, report, wait=False)
        self.progress[model] = "engine loading"
        broken = [f"{o.subject}: {o.message}" for o in outcomes if not o.ok]
        if broken:
            raise StartFailed("; ".join(broken))
        assert action.port is not None
        address = serving_address(spec.node(action.nodes[0]).engine_host, action.port)
        replica = self.gw.pool.add(model, address, time.monotonic())
        replica.last_used = self.clock()  # the request that asked for it is about to use it
        return address

    async def _watch(self, spec: ClusterSpec, model: str, address: str, started: float) -> None:
        """Check the new replica's health often until ready, or fail after the profile's
        start_timeout (its units are then stopped, so the cards go back)."""
        timeout = spec.profiles[spec.model(model).profile].readiness.start_timeout
        self.watching.add((model, address))
        try:
            await self._watch_until_ready(model, address, started, timeout)
        finally:
            self.watching.discard((model, address))

    async def _watch_until_ready(self, model: str, address: str, started: float, timeout: float) -> None:
        spec = self.gw.spec

        async def ready() -> bool | None:
            replica = self.gw.pool.add(model, address, time.monotonic())
            if replica.health is not Health.ready:
                status = await self.gw.health_status(address, model)
                self.gw.pool.checked(replica, status, time.monotonic())
            return True if replica.health is Health.ready else None

        left = max(0.0, started + timeout - time.monotonic())
        if not await poll_until(ready, timeout=left, interval=WATCH_EVERY):
            await self._give_up(spec, model, address)
            raise StartFailed(f"not ready after {timeout:g}s (the profile's start_timeout)")
        seconds = time.monotonic() - started
        self.gw.metrics.loaded(model, seconds)
        self.ready_at[replica_key(model, address)] = self.clock()
        log.info("%s: %s ready after %.1fs", model, address, seconds)

    async def _give_up(self, spec: ClusterSpec, model: str, address: str) -> None:
        async with self.cards, self.lock.hold(f"stopping model {model}"):
            facts = await self.source.probe(spec)
            _, where = self._uses(spec, facts, self.clock())
            for (name, index), (_, at) in where.items():
                if name == model and at == address:
                    self.gw.pool.remove(model, address)
                    await execute(
                        spec,
                        await self.source.connections(spec),
                        stop_plan(facts, model, index, "never became ready"),
                        _log_report,
                        wait=False,
                    )

    async def _idle_stop(self, use: ReplicaUse) -> None:
        spec = self.gw.spec
        async with self.model_locks[use.model], self.cards, self.lock.hold(f"stopping model {use.model}"):
            facts = await self.source.probe(spec)
            now = self.clock()
            uses, where = self._uses(spec, facts, now)
            still = [
                u for u in idle_to_stop(spec, uses, now) if (u.model, u.replica) == (use.model, use.replica)
            ]
            if not still:
                return  # used meanwhile, or gone
            model = spec.model(use.model)
            idle = model.scaling.idle_timeout if model.scaling else None
            if await self._stop_replica(
                spec, facts, still[0], where, f"idle for {idle:g}s" if idle else "idle"
            ):
                self.gw.metrics.idle_stopped(use.model)

    async def _stop_replica(
        self,
        spec: ClusterSpec,
        facts: dict[str, NodeFacts],
        use: ReplicaUse,
        where: dict[tuple[str, int], tuple[Running, str]],
        reason: str,
    ) -> bool:
        """Take the replica out of rotation, then stop it, unless a request is in flight
        on it (it is put back then). Called under the cards lock."""
        _, address = where[(use.model, use.replica)]
        replica = self.gw.pool.remove(use.model, address)
        if replica is not None and replica.outstanding:
            self.gw.pool.replicas.setdefault(use.model, {})[address] = replica
            return False
        log.info("%s: stopping replica %d at %s: %s", use.model, use.replica, address, reason)
        plan: Plan = stop_plan(facts, use.model, use.replica, reason)
        outcomes = await execute(spec, await self.source.connections(spec), plan, _log_report, wait=False)
        for o in outcomes:
            if not o.ok:
                log.error("%s: stopping replica %d: %s: %s", use.model, use.replica, o.subject, o.message)
        key = replica_key(use.model, address)
        for known in (self.saved, self.first_seen, self.ready_at):
            known.pop(key, None)
        await asyncio.to_thread(self.gw.store.forget_last_use, [key])
        return all(o.ok for o in outcomes)


def _log_report(subject: str, message: str) -> None:
    log.info("%s: %s", subject, message)
