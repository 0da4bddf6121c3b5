"""Many gateway processes, one cluster: members, shares, leadership and fencing.

Every gateway process (a worker; on one host or several) is a member of the cluster's
store. Its ``Coordinator`` (one per ``Gateway``):

- heartbeats every ``HEARTBEAT_EVERY`` (``Store.heartbeat``): the live count sets the
  process's admission share, ``ceil(model_concurrency / members)`` requests at once per
  ready replica (``Controller.members``);
- reloads the API keys when ``keys_version`` changed (it looks every ``WATCH_EVERY`` and
  whenever ``Store.wait_change`` returns), so a revoked key is refused by every process
  within a few seconds;
- leads or follows. A process that can lead (it has a ``ProbeSource``: SSH access to the
  nodes) tries ``Leadership.try_acquire`` at start and every ``LEAD_EVERY``.

The LEADER probes the nodes (discovery from its ``ProbeSource``), runs the model
controllers (``Controller.manages``), publishes the replica set and each model's state
after every look that changed them and at least every ``PUBLISH_EVERY``
(``Store.publish``, written only under its fence), and takes the on-demand starts the
followers asked for every ``REQUESTS_EVERY``. Its controller reaches the nodes through
``FencedNodes`` and takes the cluster lock through ``FencedHold``: before every node
action (probe, weights fetch, unit writes, starts, stops, watches) and on every lock hold
``Leadership.still_leader`` is asked, and a ``False`` refuses the action (``NotLeader``).
A failed fence check, a refused publication or a lost lock (looked at every
``LEAD_EVERY``) makes it step down at once: its controller's starts and stops are
cancelled, it manages nothing more and follows.

A FOLLOWER reads the published replica set (``PublishedSource``; when ``wait_change``
says it changed and every ``WATCH_EVERY``), health-checks those replicas itself (it
proxies to them), and answers ``/v1/models`` and the 503s from the published model states
(``Controller.following``). A request for an on-demand model that is not running is
recorded in the store (``Store.request_start``) for the leader; its waiters are woken
when the publication changes.

A process started with a fixed replica list (``StaticSource``) neither leads nor follows;
``llmgw gateway run --follow`` never leads (it needs no SSH key).

Contract (concurrency): everything runs on the gateway's asyncio loop. The role changes in
one synchronous step (``fence``, ``Controller.manages``/``following``, ``Gateway.source``),
so nothing awaits between a lost fence and the end of managing; cancelling the work under
way follows in a task of its own (a fence check inside that work cannot cancel itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.observe.facts import NodeFacts
from llmgw_cli.core.planning.plan import Action, Plan
from llmgw_cli.core.serving.routing import Pool
from llmgw_cli.errors import NotLeader
from llmgw_cli.gateway.control.controller import Controller
from llmgw_cli.gateway.control.controller_state import Following
from llmgw_cli.gateway.control.replicas import Nodes, UnitFailure
from llmgw_cli.gateway.control.sources import PublishedSource, ReplicaSource
from llmgw_cli.gateway.store.sqlite import Leadership, ModelState, Publication, Store
from llmgw_cli.polling import wait_event
from llmgw_cli.progress import Report
from llmgw_cli.remote.cluster_lock import Hold
from llmgw_cli.remote.execute import Outcome


class Member(Protocol):
    """What the coordinator reads and switches of its gateway process (``state.Gateway``):
    where discovery reads, the controller's role, and the looks it asks for. A protocol, so
    that the gateway owns its coordinator and this module never imports the gateway."""

    spec: ClusterSpec
    source: ReplicaSource
    probe_source: ReplicaSource
    controller: Controller
    pool: Pool
    manage_replicas: bool

    async def discover(self) -> None: ...

    async def check_health(self) -> None: ...

    async def load_keys(self) -> None: ...

    def probe_now(self) -> None: ...


log = logging.getLogger("llmgw.gateway")

HEARTBEAT_EVERY = 2.0  # seconds between heartbeats (MEMBER_TTL is several of them)
LEAD_EVERY = 1.0  # seconds between tries to lead, and between a leader's looks at its lock
PUBLISH_EVERY = 5.0  # seconds: a leader publishes at least this often, changed or not
PUBLISH_SETTLE = 0.05  # seconds a leader lets a burst of changes settle before publishing
REQUESTS_EVERY = 0.5  # seconds between a leader's takes of the followers' start requests
WATCH_EVERY = 1.0  # seconds: the longest wait for a change of keys or of the publication

Check = Callable[[], Awaitable[bool]]


def member_id() -> str:
    """``host:pid:random``: unique for this process, even after a pid is reused."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


class FencedNodes:
    """The controller's ``Nodes``, each action preceded by the fence check: a process that
    no longer leads never touches the nodes (``NotLeader`` instead)."""

    def __init__(self, nodes: Nodes, check: Check) -> None:
        self.nodes = nodes
        self.check = check

    async def _fence(self, what: str) -> None:
        if not await self.check():
            raise NotLeader(f"this gateway process does not lead the cluster: {what} refused")

    @property
    def facts(self) -> dict[str, NodeFacts]:
        return self.nodes.facts

    async def probe(self, spec: ClusterSpec) -> dict[str, NodeFacts]:
        await self._fence("a probe of the nodes")
        return await self.nodes.probe(spec)

    async def fetch(self, spec: ClusterSpec, plan: Plan, report: Report) -> dict[str, str]:
        await self._fence("a weights fetch")
        return await self.nodes.fetch(spec, plan, report)

    async def execute(
        self, spec: ClusterSpec, plan: Plan, report: Report, *, fetch: bool = False
    ) -> list[Outcome]:
        await self._fence("writing, starting or stopping units")
        return await self.nodes.execute(spec, plan, report, fetch=fetch)

    async def watch(self, spec: ClusterSpec, action: Action, since: str = "") -> UnitFailure:
        await self._fence("watching a unit")
        return await self.nodes.watch(spec, action, since)


class FencedHold:
    """The cluster lock, checked once held: a process that no longer leads gets
    ``NotLeader`` instead of the lock (which it lets go at once)."""

    def __init__(self, lock: Hold, check: Check) -> None:
        self.lock = lock
        self.check = check

    def hold(self, why: str) -> AbstractAsyncContextManager[None]:
        return self._hold(why)

    @contextlib.asynccontextmanager
    async def _hold(self, why: str) -> AsyncIterator[None]:
        async with self.lock.hold(why):
            if not await self.check():
                raise NotLeader(f"this gateway process does not lead the cluster: lock for {why!r} refused")
            yield


Snapshot = tuple[dict[str, list[str]], list[str], dict[str, ModelState]]


class Coordinator:
    """One gateway process's membership and role (see the module's docstring)."""

    def __init__(self, store: Store, member: str | None = None, *, can_lead: bool) -> None:
        self.store = store
        self.member = member or member_id()
        self.can_lead = can_lead
        self.leadership: Leadership | None = store.leadership(self.member) if can_lead else None
        self.fence: int | None = None  # our epoch while we lead
        self.live = 1  # live members at the last heartbeat
        self.resigned = False  # quiesced: never leads again
        self._gw: Member | None = None
        self._dirty = asyncio.Event()  # the leader's view changed: publish
        self._published: Snapshot | None = None  # what the leader published last
        self._published_at = float("-inf")  # monotonic time of that publication
        self._versions: tuple[int | None, int | None] = (None, None)  # (keys, published) seen
        self._tasks: list[asyncio.Task[None]] = []
        self._side: set[asyncio.Task[None]] = set()  # step-downs, start requests
        self._letting_go: asyncio.Task[None] | None = None  # a step-down's cancel and release
        self.follower_source: PublishedSource | None = None

    @property
    def leading(self) -> bool:
        return self.fence is not None

    @property
    def gw(self) -> Member:
        assert self._gw is not None, "Coordinator.start first"
        return self._gw

    # --- lifetime ---------------------------------------------------------------------

    async def start(self, gw: Member, *, follows: bool) -> None:
        """Join: the first heartbeat, then lead if it may and nobody does; else follow
        (``follows``: a process whose routes come from the leader) or stand alone."""
        self._gw = gw
        if follows or self.can_lead:
            self.follower_source = (
                gw.source if isinstance(gw.source, PublishedSource) else PublishedSource(self.store)
            )
        try:
            await self._heartbeat()
            # What the gateway's start reads next (keys, the publication) is this recent.
            keys = await self.store.keys_version()
            published = await self.store.published_version()
            self._versions = (keys, published)
        except Exception as exc:
            log.error("gateway store: cannot record this process as a member: %s", exc)
        fence = await self._try_acquire() if self.can_lead else None
        if fence is not None:
            self._lead(fence)
        elif self.follower_source is not None:
            self._follow()

    def run(self) -> None:
        """The background loops (after the gateway's first discovery)."""
        loops: list[tuple[str, Callable[[], Coroutine[Any, Any, None]]]] = [
            ("heartbeat", self._heartbeat_loop),
            ("watch", self._watch_loop),
        ]
        if self.can_lead:
            loops += [
                ("lead", self._lead_loop),
                ("publish", self._publish_loop),
                ("requests", self._requests_loop),
            ]
        for name, loop in loops:
            self._tasks.append(asyncio.create_task(loop(), name=f"gateway-{name}"))

    async def resign(self) -> None:
        """The gateway is leaving (SIGTERM): it leads no more and tries no more, so another
        process (an upgrade's new one) takes the lead within ``LEAD_EVERY``."""
        self.resigned = True
        if self.fence is not None:
            await self._step_down("this gateway process is stopping")

    async def stop(self) -> None:
        self.resigned = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self.fence is not None:
            await self._step_down("this gateway process is stopping")
        await asyncio.gather(*self._side, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self.store.leave(self.member)

    # --- roles ------------------------------------------------------------------------

    def _lead(self, fence: int, *, manage: bool = True) -> None:
        """Become the leader: discovery from the nodes; the controller manages (at once
        with ``manage``; else ``_take_over`` lets it once it has probed the nodes)."""
        gw = self.gw
        self.fence = fence
        gw.source = gw.probe_source
        gw.controller.following = None
        gw.controller.manages = manage and gw.manage_replicas and gw.controller.nodes is not None
        gw.controller.taking_over = not manage and gw.manage_replicas and gw.controller.nodes is not None
        self._published = None  # publish at the next look, whatever the last leader said
        self._dirty.set()
        log.warning("this gateway process leads the cluster now (member %s, fence %d)", self.member, fence)

    async def _take_over(self, fence: int) -> None:
        """A follower that took the lead decides nothing on what it probed before (the
        facts of an earlier time it led): it reads the stored last use, probes the nodes,
        and only then manages."""
        gw = self.gw
        began = time.monotonic()
        try:
            gw.controller.saved = await self.store.last_use()
        except Exception as exc:
            log.warning("gateway store: cannot read the replicas' last use: %s", exc)
        while self.fence == fence:
            try:
                await gw.discover()
                await gw.check_health()
            except Exception as exc:
                log.warning("taking over: a look at the nodes failed (%s); trying again", exc)
                await asyncio.sleep(LEAD_EVERY)
                continue
            if self.fence == fence:
                gw.controller.manages = gw.manage_replicas and gw.controller.nodes is not None
                gw.controller.taking_over = False
                for model in gw.spec.models:  # requests that waited for the take-over
                    gw.controller.model(model.name).wake()
                log.warning(
                    "took over: the nodes probed, this gateway process %s (%.2f s after taking the lead)",
                    "manages the replicas now" if gw.controller.manages else "routes from its own probes",
                    time.monotonic() - began,
                )
            return

    def _follow(self) -> None:
        gw = self.gw
        assert self.follower_source is not None
        gw.source = self.follower_source
        gw.controller.manages = False
        gw.controller.taking_over = False
        gw.controller.following = Following(self._request)

    def _lost(self, why: str) -> None:
        """The lead is lost: stop managing now (synchronously), cancel the work under way
        and let the lock go in a task of its own."""
        if self.fence is None:
            return
        fence, self.fence = self.fence, None
        log.warning("this gateway process steps down (fence %d): %s", fence, why)
        self._follow()
        self._letting_go = self._spawn(self._let_go())

    async def _step_down(self, why: str) -> None:
        self._lost(why)
        await asyncio.gather(*self._side, return_exceptions=True)

    async def _let_go(self) -> None:
        await self.gw.controller.stop()
        if self.leadership is not None:
            try:
                await self.leadership.release()
            except Exception as exc:
                log.warning("gateway store: releasing the lead: %s", exc)
        self.gw.probe_now()  # the published replica set, at once

    async def check(self) -> bool:
        """The fence check: True while this process leads; a False steps it down."""
        fence = self.fence
        if fence is None or self.leadership is None:
            return False
        try:
            still = await self.leadership.still_leader()
        except Exception as exc:
            log.warning("gateway store: the fence check failed: %s", exc)
            still = False
        if still and self.fence == fence:
            return True
        if self.fence != fence:
            return False  # the lead of this check is over already (a newer one is not ours to end)
        self._lost("the fence check failed: another process leads, or the store cannot be reached")
        return False

    async def _try_acquire(self) -> int | None:
        assert self.leadership is not None
        try:
            return await self.leadership.try_acquire()
        except Exception as exc:
            log.warning("gateway store: cannot try to lead: %s", exc)
            return None

    # --- loops ------------------------------------------------------------------------

    async def _lead_loop(self) -> None:
        while True:
            await asyncio.sleep(LEAD_EVERY)
            if self.fence is not None:
                await self.check()
                continue
            if self.resigned or (self._letting_go is not None and not self._letting_go.done()):
                continue  # a step-down still cancels its work and lets the lock go
            fence = await self._try_acquire()
            if fence is not None:
                self._lead(fence, manage=False)
                self._spawn(self._take_over(fence))

    async def _heartbeat(self) -> None:
        live = await self.store.heartbeat(self.member, socket.gethostname(), os.getpid(), time.time())
        live = max(1, live)
        if live != self.live:
            log.info("gateway processes alive: %d (this one's share of each replica: 1/%d)", live, live)
            self.live = live
        controller = self.gw.controller
        if controller.members != live:
            controller.members = live
            controller.observe()

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_EVERY)
            try:
                await self._heartbeat()
            except Exception as exc:
                log.warning("gateway store: heartbeat failed: %s", exc)

    async def _watch_loop(self) -> None:
        """Keys and (following) the published replica set, again when they changed."""
        while True:
            try:
                await self.store.wait_change(WATCH_EVERY)
                await self.look()
            except Exception as exc:
                log.warning("gateway store: cannot look for changes: %s", exc)
                await asyncio.sleep(WATCH_EVERY)

    async def look(self) -> None:
        """Reload the keys when their version changed; a follower reads the publication
        again when its version changed, and checks the new replicas' health at once; the
        leader takes the start requests."""
        gw = self.gw
        keys = await self.store.keys_version()
        following = gw.controller.following is not None
        published = await self.store.published_version() if following else None
        seen_keys, seen_published = self._versions
        if keys != seen_keys:
            await gw.load_keys()
        if published is not None and published != seen_published:
            await gw.discover()
            await gw.check_health()
        self._versions = (keys, published if published is not None else seen_published)
        await self.take_requests()  # a leader's: a request may be what changed

    async def look_keys(self) -> None:
        """Reload the keys when their version changed (``Gateway.authenticate_fresh``: an
        unknown key may be one made since the last look)."""
        keys = await self.store.keys_version()
        if keys != self._versions[0]:
            await self.gw.load_keys()
            self._versions = (keys, self._versions[1])

    def followed(self) -> None:
        """After a follower's discovery: the controller takes the publication's model
        states and drained addresses; the waiters of a model whose state changed are
        woken (of every model at the first publication read: they waited for it)."""
        following = self.gw.controller.following
        source = self.follower_source
        if following is None or source is None or source.latest is None:
            return
        latest = source.latest
        first = not following.published
        following.published = True
        models = {m.name: latest.models[m.name] for m in self.gw.spec.models if m.name in latest.models}
        changed = [n for n in set(models) | set(following.models) if models.get(n) != following.models.get(n)]
        following.models = models
        following.draining = frozenset(a for a in latest.draining if isinstance(a, str))
        for name in [m.name for m in self.gw.spec.models] if first else changed:
            self.gw.controller.model(name).wake()

    # --- the leader's work --------------------------------------------------------------

    def changed(self) -> None:
        """After every look at the pool: the leader publishes what changed."""
        if self.fence is not None:
            self._dirty.set()

    def snapshot(self) -> Snapshot:
        """What the leader publishes: every address discovery put in the pool (loading ones
        too: followers check their health themselves), the addresses being drained, and
        each catalog model's state."""
        gw = self.gw
        replicas: dict[str, list[str]] = {}
        for r in gw.pool.all():
            replicas.setdefault(r.model, []).append(r.address)
        phases = gw.controller.phases()
        models = {name: gw.controller.model_state(name, phase) for name, phase in phases.items()}
        return (
            {m: sorted(a) for m, a in sorted(replicas.items())},
            sorted(gw.controller.draining()),
            models,
        )

    async def publish(self) -> None:
        """Publish the leader's view when it changed or ``PUBLISH_EVERY`` has passed; a
        refused publication (a stale fence) steps it down."""
        fence = self.fence
        if fence is None:
            return
        snapshot = self.snapshot()
        due = time.monotonic() - self._published_at >= PUBLISH_EVERY
        if snapshot == self._published and not due:
            return
        if await self.store.publish(fence, Publication(*snapshot), self.member):
            self._published, self._published_at = snapshot, time.monotonic()
        elif self.fence == fence:
            self._lost("the store refused a publication: another process leads")

    async def _publish_loop(self) -> None:
        while True:
            await wait_event(self._dirty, PUBLISH_EVERY)
            await asyncio.sleep(PUBLISH_SETTLE)  # one publication for a burst of looks
            self._dirty.clear()
            try:
                await self.publish()
            except Exception as exc:
                log.warning("gateway store: cannot publish the replica set: %s", exc)

    async def _requests_loop(self) -> None:
        while True:
            await asyncio.sleep(REQUESTS_EVERY)
            await self.take_requests()

    async def take_requests(self) -> None:
        """The leader begins the on-demand starts the followers asked for (every
        ``REQUESTS_EVERY``, and when the store says something changed: PostgreSQL tells)."""
        fence = self.fence
        if fence is None:
            return
        try:
            models = await self.store.take_start_requests(fence)
        except Exception as exc:
            log.warning("gateway store: cannot read the start requests: %s", exc)
            return
        catalog = {m.name for m in self.gw.spec.models}
        for model in dict.fromkeys(models):
            if model in catalog and self.fence == fence:
                log.info("%s: a start asked for by another gateway process", model)
                self.gw.controller.want(model)

    # --- the follower's requests ----------------------------------------------------------

    def _request(self, model: str) -> None:
        """Ask the leader to start ``model`` (recorded in the store, in the background)."""
        self._spawn(self._record_request(model))

    async def _record_request(self, model: str) -> None:
        try:
            await self.store.request_start(model, self.member)
        except Exception as exc:
            log.warning("%s: cannot ask the leading gateway process for a start: %s", model, exc)

    def _spawn(self, job: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(job)
        self._side.add(task)
        task.add_done_callback(self._side.discard)
        return task
