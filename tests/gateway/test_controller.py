"""The model controller's shell with fakes: the nodes (facts, an executor that records
plans and can make a unit exit), health answers and the wall clock.

Every transition of a model, and the request path: ``ensure_ready`` returns a replica once
one is ready, ``model_start_failed`` as soon as a start fails (woken, not timed out), and
admission grows when a replica turns ready.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from llmgw_cli.cli.gateway import load_pinned
from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.observe.facts import NodeFacts
from llmgw_cli.core.observe.unit_state import UnitState
from llmgw_cli.core.planning.controller import Attempts, Phase, Unavailable
from llmgw_cli.core.planning.cordon import Cordon
from llmgw_cli.core.planning.drain import DRAIN_GRACE
from llmgw_cli.core.planning.plan import Action, Plan, grow_plan, running_replicas
from llmgw_cli.core.serving.routing import Pool, RoutedReplica
from llmgw_cli.core.weights.pins import pins_text
from llmgw_cli.gateway.control import controller as controller_module
from llmgw_cli.gateway.control.controller import Controller, replica_key
from llmgw_cli.gateway.serving import proxy
from llmgw_cli.gateway.serving.admission import Admission
from llmgw_cli.gateway.serving.metrics import Metrics
from llmgw_cli.gateway.store.sqlite import SqliteStore
from llmgw_cli.remote.execute import Outcome
from tests.unit.facts_factory import node_facts, with_units

CLUSTER = """\
cluster: {name: t}
nodes:
  - {name: a, address: 10.0.0.1}
  - {name: b, address: 10.0.0.2}
profiles:
  vllm: {engine: vllm, ports: 8100-8199, readiness: {start_timeout: 10m}}
gateway: {model_concurrency: 2}
models:
  - {name: lazy, source: org/lazy, fetch: engine, profile: vllm, scaling: {min: 0, max: 1, idle_timeout: 5m}}
  - {name: other, source: org/other, fetch: engine, profile: vllm, scaling: {min: 0, max: 1, idle_timeout: 5m}}
"""
ALONE = (
    CLUSTER
    + "  - {name: alone, source: org/alone, fetch: engine, profile: vllm, scaling: {min: 1, max: 1}}\n"
)
DUO = CLUSTER + "  - {name: duo, source: org/duo, fetch: engine, profile: vllm, scaling: {min: 2, max: 2}}\n"

T0 = 1_000_000.0
FOREVER = 3600.0  # a deadline no test reaches: an answer before it came from an event


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


class Watch:
    def __init__(self, nodes: FakeNodes, unit: str) -> None:
        self.nodes, self.unit = nodes, unit

    async def failure(self) -> str | None:
        return self.nodes.exits.get(self.unit)


class Lock:
    """The lock over the cards, recording whether it is held."""

    def __init__(self) -> None:
        self.inner = asyncio.Lock()
        self.held = False
        self.whys: list[str] = []

    @asynccontextmanager
    async def hold(self, why: str) -> AsyncIterator[None]:
        async with self.inner:
            self.held = True
            self.whys.append(why)
            try:
                yield
            finally:
                self.held = False


class FakeNodes:
    """The nodes: facts that executed plans change; starts whose head unit can exit."""

    def __init__(self, facts: dict[str, NodeFacts], lock: Lock) -> None:
        self.truth = facts  # what the nodes hold now
        self.facts: dict[str, NodeFacts] = {}  # what the last probe saw
        self.lock = lock
        self.plans: list[Action] = []  # every action executed, in order
        self.exits: dict[str, str] = {}  # unit -> why it exited (the watch reports it)
        self.exit_next: str | None = None  # the next started replica's unit exits so
        self.fetched_outside_lock: list[bool] = []
        self.fetched_in_execute: list[bool] = []  # whether a start's execute fetched weights too
        self.fetch_gate: asyncio.Event | None = None
        self.seen_while_stopping: list[object] = []
        self.health: dict[str, int] = {}  # address -> what its readiness path answers
        self.while_stopping: list[Callable[[], object]] = []  # called as a stop's units go
        # awaited before a probe returns (not within itself)
        self.while_probing: Callable[[], Coroutine[Any, Any, None]] | None = None
        self._in_probe = False
        self.clock_before_start = ""  # what a start's Outcome says of the node's clock
        self.watched_since: list[str] = []  # the ``since`` each watch was given

    async def probe(self, spec: ClusterSpec) -> dict[str, NodeFacts]:
        if self.while_probing is not None and not self._in_probe:
            self._in_probe = True
            try:
                await self.while_probing()  # another look, with what the last probe saw
            finally:
                self._in_probe = False
        self.facts = dict(self.truth)
        return self.facts

    async def fetch(
        self, spec: ClusterSpec, plan: Plan, report: Callable[[str, str], None]
    ) -> dict[str, str]:
        self.fetched_outside_lock.append(not self.lock.held)
        report("a", "weights fetching")
        if self.fetch_gate is not None:
            await self.fetch_gate.wait()
        return {}

    async def execute(
        self, spec: ClusterSpec, plan: Plan, report: Callable[[str, str], None], *, fetch: bool = False
    ) -> list[Outcome]:
        assert self.lock.held, "units are written and started under the lock only"
        if any(a.write for a in plan.changes):
            self.fetched_in_execute.append(fetch)
        for action in plan.changes:
            self.plans.append(action)
            if action.remove:  # a stopped engine answers nothing
                self.health.pop(f"{spec.node(action.nodes[0]).address}:{action.port}", None)
            for node, name in action.remove:
                self.exits.pop(name, None)  # a new unit of that name starts a new life
                f = self.truth[node]
                self.truth[node] = f.model_copy(
                    update={
                        "units": tuple(u for u in f.units if u.name != name),
                        "unit_labels": {k: v for k, v in f.unit_labels.items() if k != name},
                        # its drain marker goes with it (the node helper's remove)
                        "draining": {k: v for k, v in f.draining.items() if k != name},
                    }
                )
            self.truth = with_units(self.truth, [(w.node, w.name, w.text) for w in action.write])
            if action.remove:
                self.seen_while_stopping = [look() for look in self.while_stopping]
            if action.write and self.exit_next is not None:
                head = next(w for w in action.write if w.node == action.nodes[0])
                self.exits[head.name] = self.exit_next
                self.exit_next = None
        return [
            Outcome(n, True, "units in place", self.clock_before_start) for a in plan.changes for n in a.nodes
        ]

    async def watch(self, spec: ClusterSpec, action: Action, since: str = "") -> Watch:
        self.watched_since.append(since)
        head = next(w for w in action.write if w.node == action.nodes[0])
        return Watch(self, head.name)

    def starts(self, model: str | None = None) -> list[Action]:
        return [a for a in self.plans if a.op == "+" and model in (None, a.model)]

    def stops(self, model: str | None = None) -> list[Action]:
        return [a for a in self.plans if a.op == "-" and model in (None, a.model)]


class World:
    """A controller over fake nodes with 1 card each, a pool, health answers and a clock."""

    def __init__(self, gpus: int = 1, saved: dict[str, float] | None = None, cluster: str = CLUSTER) -> None:
        self.spec = parse_cluster(cluster)
        self.clock = Clock()
        self.lock = Lock()
        self.nodes = FakeNodes({n: node_facts(n, gpus=gpus) for n in "ab"}, self.lock)
        self.pool = Pool()
        self.admission = Admission(self.spec.gateway.model_concurrency)
        self.health = self.nodes.health
        self.metrics = Metrics()

        async def health(address: str, model: str) -> int | None:
            return self.health.get(address)

        self.controller = Controller(
            lambda: self.spec,
            self.pool,
            self.admission,
            self.metrics,
            health,
            nodes=self.nodes,
            manages=True,
            lock=self.lock,
            saved_last_use=saved,
            clock=self.clock,
        )

    def run(self, model: str, node: str, *, state: str = "active", shown: UnitState | None = None) -> str:
        """A replica of ``model`` already running on ``node`` (placed as a start would:
        the other nodes are hidden from placement, not their units); its address."""
        hidden = {
            n: f if n == node else f.model_copy(update={"error": "hidden"})
            for n, f in self.nodes.truth.items()
        }
        (action,) = grow_plan(self.spec, hidden, model).changes
        assert action.nodes == (node,)
        self.nodes.truth = with_units(
            self.nodes.truth, [(w.node, w.name, w.text) for w in action.write], state=state, shown=shown
        )
        return f"{self.spec.node(node).address}:{action.port}"

    def drain(self, address: str, left: float, *, ahead: float = 0.0) -> None:
        """Mark the replica at ``address`` draining, as apply does: a marker on each member
        node whose deadline is ``left`` seconds away, on node clocks ``ahead`` seconds
        ahead of the gateway's (read by the next probe)."""
        (r,) = [
            r
            for r in running_replicas(self.nodes.truth)
            if f"{self.spec.node(r.members[0]).address}:{r.port}" == address
        ]
        clock = self.clock.now + ahead
        for node in r.members:
            f = self.nodes.truth[node]
            self.nodes.truth[node] = f.model_copy(
                update={"draining": {**f.draining, r.unit: clock + left}, "clock": clock}
            )

    def discover(self) -> None:
        """What the gateway's discovery does: the pool from the facts, then a look."""
        found: dict[str, list[str]] = {}
        self.nodes.facts = dict(self.nodes.truth)  # discovery probes the nodes
        for r in running_replicas(self.nodes.facts):
            if r.serving():
                found.setdefault(r.model, []).append(f"{self.spec.node(r.members[0]).address}:{r.port}")
        self.pool.replace(self.controller.with_starts(found), time.monotonic())
        self.controller.observe()

    async def check_health(self) -> None:
        """What the gateway's health checks do."""
        for r in self.pool.all():
            self.pool.checked(r, self.health.get(r.address), time.monotonic())
        self.controller.observe()

    def lose(self, node: str) -> None:
        self.nodes.truth[node] = NodeFacts(node=node, error="ssh: connection timed out")


async def until(condition: Callable[[], object], what: str = "the condition") -> None:
    """Yield to the loop until ``condition`` holds (bounded, so a broken test ends)."""
    for _ in range(20_000):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"never happened: {what}")


def run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(scenario())


@pytest.fixture(autouse=True)
def fast_watch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The start's watch looks at health and unit often in real time; no test waits on it."""
    monkeypatch.setattr(controller_module, "WATCH_EVERY", 0.001)
    monkeypatch.setattr(controller_module, "UNIT_EVERY", 0.0)


# --- the request path ------------------------------------------------------------------


def test_a_request_starts_a_stopped_model_and_gets_the_replica_once_ready(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "llmgw.controller")

    async def scenario() -> None:
        w = World()
        ctl = w.controller
        assert ctl.phase("lazy") is Phase.stopped
        asked = asyncio.create_task(ctl.ensure_ready("lazy", time.monotonic() + FOREVER))
        await until(lambda: w.nodes.starts("lazy"), "a start")
        (action,) = w.nodes.starts("lazy")
        address = f"10.0.0.1:{action.port}" if action.nodes == ("a",) else f"10.0.0.2:{action.port}"
        assert ctl.phase("lazy") is Phase.starting and not asked.done()
        assert w.nodes.fetched_outside_lock == [True]  # weights came without the lock
        assert w.nodes.fetched_in_execute == [False]  # and not again under it
        w.health[address] = 200
        got = await asked
        assert isinstance(got, RoutedReplica) and got.address == address
        assert ctl.phase("lazy") is Phase.ready
        await ctl.idle()
        assert ctl.model("lazy").state.attempts.failures == 0 and not ctl.model("lazy").state.busy
        assert [(a.model, a.action) for a in ctl.actions] == [("lazy", "start")]

    run(scenario)
    assert "lazy: starting replica 0 on " in caplog.text and "(requested)" in caplog.text
    assert "ready after" in caplog.text


def test_a_starts_watch_reads_the_journal_from_before_the_start_whatever_a_look_did_meanwhile() -> None:
    """An engine that exits at once has its last words in the journal only from before the
    watch began: the watch is given the head node's clock from before the units started.
    A look at the replicas while the start probes again (its facts from before the units)
    forgets the new replica and makes it anew at the next look; the watch's clock is the
    start's own, not what that look left."""

    async def scenario() -> None:
        w = World()
        ctl = w.controller
        w.nodes.clock_before_start = "1764900000"
        w.nodes.while_probing = ctl.tick  # the reconcile tick, during every probe
        w.nodes.exit_next = "llmgw-lazy-0.service failed (exit-code)\nerror: --no-such-flag"
        got = await ctl.ensure_ready("lazy", time.monotonic() + FOREVER)
        assert isinstance(got, Unavailable) and got.code == "model_start_failed", got
        assert w.nodes.watched_since == ["1764900000"]

    run(scenario)


def test_a_start_whose_engine_exits_answers_model_start_failed_at_once_then_backs_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def scenario() -> None:
        w = World()
        ctl = w.controller
        w.nodes.exit_next = "llmgw-lazy-0.service failed (exit-code)\nValueError: no such model"
        got = await ctl.ensure_ready("lazy", time.monotonic() + FOREVER)
        assert isinstance(got, Unavailable), got
        assert got.status == 503 and got.code == "model_start_failed"
        assert "ValueError: no such model" in got.detail and "ValueError" not in got.message
        assert got.retry_after >= 1
        # its units were stopped: the card came back
        assert len(w.nodes.stops("lazy")) == 1 and not running_replicas(w.nodes.truth)
        assert w.pool.of("lazy") == []
        (first,) = w.nodes.starts("lazy")
        assert ctl.model("lazy").state.attempts.nodes == frozenset(first.nodes)
        assert ctl.phase("lazy") is Phase.failed
        # while the back-off runs, a request starts nothing and is answered at once
        again = await ctl.ensure_ready("lazy", time.monotonic() + FOREVER)
        assert isinstance(again, Unavailable) and again.code == "model_start_failed"
        assert len(w.nodes.starts("lazy")) == 1
        # after it, the next request tries again
        w.clock.now += w.spec.gateway.start_backoff + 1
        asked = asyncio.create_task(ctl.ensure_ready("lazy", time.monotonic() + FOREVER))
        await until(lambda: len(w.nodes.starts("lazy")) == 2, "a second start")
        (_, second) = w.nodes.starts("lazy")
        assert second.nodes != first.nodes  # the node where it failed is passed by
        w.health[f"{w.spec.node(second.nodes[0]).address}:{second.port}"] = 200
        assert isinstance(await asked, RoutedReplica)
        await ctl.idle()
        assert ctl.model("lazy").state.attempts == Attempts() and ctl.phase("lazy") is Phase.ready

    caplog.set_level(logging.INFO, "llmgw.controller")
    run(scenario)
    assert "lazy: start failed: llmgw-lazy-0.service failed" in caplog.text


def test_admission_grows_as_soon_as_a_second_replica_turns_ready() -> None:
    async def scenario() -> None:
        w = World(cluster=DUO)
        first, second = w.run("duo", "a"), w.run("duo", "b")
        w.discover()
        w.health[first] = 200
        await w.check_health()
        assert w.admission.limit("duo") == 2  # model_concurrency x 1 ready
        for _ in range(2):
            assert await w.admission.enter("duo", queue=10)
        waiter = asyncio.create_task(w.admission.enter("duo", queue=10))
        await asyncio.sleep(0)
        assert not waiter.done()
        w.health[second] = 200
        await w.check_health()  # nobody left: the new replica's slots let it in
        assert await waiter and w.admission.limit("duo") == 4

    run(scenario)


# --- the reconcile tick ------------------------------------------------------------------


def test_one_of_two_replicas_lost_is_degraded_then_replaced_after_node_grace(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "llmgw.controller")

    async def scenario() -> None:
        w = World(gpus=2, cluster=DUO)
        first, second = w.run("duo", "a"), w.run("duo", "b")
        w.discover()
        w.health.update({first: 200, second: 200})
        await w.check_health()
        await w.controller.tick()
        assert w.controller.phase("duo") is Phase.ready and not w.nodes.plans
        held_by_b = w.nodes.truth["b"]
        w.lose("b")
        del w.health[second]
        w.discover()
        await w.check_health()
        await w.controller.tick()
        assert w.controller.phase("duo") is Phase.degraded
        assert not w.nodes.starts()  # within node_grace: it may come back
        w.clock.now += w.spec.gateway.node_grace + 1
        await w.controller.tick()
        await until(lambda: w.nodes.starts("duo"), "a replacement start")
        (replacement,) = w.nodes.starts("duo")
        assert replacement.nodes == ("a",)  # b does not answer
        await w.controller.tick()
        assert len(w.nodes.starts("duo")) == 1  # one replacement, not one per tick
        w.health[f"10.0.0.1:{replacement.port}"] = 200
        await w.controller.idle()
        assert w.controller.phase("duo") is Phase.ready
        # b answers again with the old replica still up: the replaced one is stopped
        w.nodes.truth["b"] = held_by_b
        w.health[second] = 200
        w.discover()
        await w.check_health()
        await w.controller.tick()
        await until(lambda: w.nodes.stops("duo"), "the replaced replica stopped")
        (stopped,) = w.nodes.stops("duo")
        assert stopped.nodes == ("b",)
        await w.controller.idle()
        assert w.controller.phase("duo") is Phase.ready and len(w.nodes.starts("duo")) == 1

    run(scenario)
    assert "duo: replacing replica " in caplog.text


def test_a_lost_nodes_grace_counts_from_its_replicas_first_failed_health_check() -> None:
    """The replica stopped answering before the probe of its node timed out: the loss
    began then, so the replacement does not wait a whole node_grace after the probe."""

    async def scenario() -> None:
        w = World(gpus=2, cluster=DUO)
        first, second = w.run("duo", "a"), w.run("duo", "b")
        w.discover()
        w.health.update({first: 200, second: 200})
        await w.check_health()
        await w.controller.tick()
        del w.health[second]  # b's engine stops answering: its health check fails
        await w.check_health()
        await w.controller.tick()
        w.clock.now += 10  # the probe of b took this long to give up
        w.lose("b")
        w.discover()
        await w.controller.tick()
        assert not w.nodes.starts()
        w.clock.now += w.spec.gateway.node_grace - 10 + 1
        await w.controller.tick()
        await until(lambda: w.nodes.starts("duo"), "a replacement node_grace after the first failure")

    run(scenario)


def test_a_unit_systemd_gave_up_on_is_stopped_and_started_again_on_other_cards() -> None:
    async def scenario() -> None:
        w = World(gpus=2, cluster=DUO)
        w.run("duo", "a")
        w.run("duo", "b", state="failed")
        broken = next(r for r in running_replicas(w.nodes.truth) if r.members == ("b",))
        cards = set(broken.gpus["b"])
        w.discover()
        await w.controller.tick()
        await until(lambda: w.nodes.starts("duo"), "a start after the stop")
        (stopped,) = w.nodes.stops("duo")
        assert stopped.replica == broken.replica
        assert w.nodes.plans.index(stopped) < w.nodes.plans.index(w.nodes.starts("duo")[0])
        (start,) = w.nodes.starts("duo")
        placed = {g for u in start.write for g in u.text.split("X-Llmgw-Gpus=")[1].split()[0].split(",")}
        assert not placed & cards  # never the cards of the unit systemd gave up on
        assert {(a.model, a.action) for a in w.controller.actions} >= {("duo", "stop"), ("duo", "start")}

    run(scenario)


def test_a_crash_looping_replica_is_stopped_and_started_again_on_other_cards() -> None:
    """systemd keeps restarting an engine that exits at once (``activating``, not failed
    yet): the controller does not wait for systemd to give up."""
    looping = UnitState(
        name="",
        load_state="loaded",
        active_state="activating",
        sub_state="auto-restart",
        result="exit-code",
        main_pid=0,
        n_restarts=3,
        exec_main_code=1,
        exec_main_status=2,
        age=4.0,
        lived=0.3,
    )

    async def scenario() -> None:
        w = World(gpus=2, cluster=DUO)
        w.run("duo", "a")
        w.run("duo", "b", shown=looping)
        broken = next(r for r in running_replicas(w.nodes.truth) if r.members == ("b",))
        cards = set(broken.gpus["b"])
        w.discover()
        await w.controller.tick()
        await until(lambda: w.nodes.starts("duo"), "a start after the stop")
        (stopped,) = w.nodes.stops("duo")
        assert stopped.replica == broken.replica
        assert "crash-looping on b" in stopped.reason
        (start,) = w.nodes.starts("duo")
        placed = {g for u in start.write for g in u.text.split("X-Llmgw-Gpus=")[1].split()[0].split(",")}
        assert not placed & cards

    run(scenario)


def test_replicas_found_at_start_up_are_adopted_and_one_never_ready_is_stopped() -> None:
    async def scenario() -> None:
        w = World()
        address = w.run("lazy", "a")
        used = T0 - 30
        w = _with_saved(w, {replica_key("lazy", address): used})
        w.discover()
        await w.controller.tick()
        (replica,) = w.pool.of("lazy")
        assert replica.last_used == used  # the saved last use is kept
        assert w.controller.phase("lazy") is Phase.starting and not w.nodes.plans
        w.clock.now += 599
        await w.controller.tick()
        assert not w.nodes.plans  # start_timeout (10m) not over yet
        w.clock.now += 2
        await w.controller.tick()
        await until(lambda: w.nodes.stops("lazy"), "the never-ready replica stopped")
        await w.controller.idle()
        assert not running_replicas(w.nodes.truth)

    run(scenario)


def _with_saved(w: World, saved: dict[str, float]) -> World:
    """``w`` as a gateway restarted with ``saved`` last-use times finds it."""
    again = World(saved=saved)
    again.nodes.truth = w.nodes.truth
    return again


def test_an_eviction_for_a_failing_start_is_not_repeated() -> None:
    async def scenario() -> None:
        w = World()
        w.nodes.truth = {"a": w.nodes.truth["a"]}
        w.spec = w.spec.model_copy(update={"nodes": [w.spec.node("a")]})
        idle = w.run("other", "a")
        w.discover()
        w.health[idle] = 200
        await w.check_health()
        await w.controller.tick()
        (r,) = w.pool.of("other")
        r.last_used = w.clock.now
        w.clock.now += 3600  # idle long enough to be evicted, not yet stopped for idleness
        w.nodes.exit_next = "llmgw-lazy-0.service failed\nCUDA error"
        got = await w.controller.ensure_ready("lazy", time.monotonic() + FOREVER)
        assert isinstance(got, Unavailable) and got.code == "model_start_failed"
        assert [a.model for a in w.nodes.stops()] == ["other", "lazy"]  # evicted, then cleaned
        # the evicted model comes back (asked for meanwhile) and idles again
        idle = w.run("other", "a")
        w.discover()
        w.health[idle] = 200
        await w.check_health()
        await w.controller.tick()
        (r,) = w.pool.of("other")
        r.last_used = w.clock.now
        w.clock.now += 3600
        got = await w.controller.ensure_ready("lazy", time.monotonic() + FOREVER)
        assert isinstance(got, Unavailable) and got.code == "model_start_failed"
        assert "eviction" in got.detail
        assert [a.model for a in w.nodes.stops()] == ["other", "lazy"]  # not evicted again

    run(scenario)


def test_a_model_below_min_is_started_by_the_tick_and_backs_off_after_a_failure() -> None:
    async def scenario() -> None:
        w = World(cluster=DUO)
        w.nodes.exit_next = "llmgw-duo-0.service failed\nOOM"
        w.discover()
        await w.controller.tick()
        await until(lambda: w.nodes.stops("duo"), "the failed start cleaned up")
        await w.controller.idle()
        assert w.controller.phase("duo") is Phase.failed
        starts = len(w.nodes.starts("duo"))
        await w.controller.tick()  # back-off: nothing new
        await w.controller.idle()
        assert len(w.nodes.starts("duo")) == starts
        w.clock.now += w.spec.gateway.start_backoff + 1
        await w.controller.tick()
        await until(lambda: len(w.nodes.starts("duo")) > starts, "a retry after the back-off")

    run(scenario)


def test_an_idle_replica_is_stopped_and_the_model_reads_stopped_at_once() -> None:
    async def scenario() -> None:
        w = World()
        address = w.run("lazy", "a")
        w.discover()
        w.health[address] = 200
        await w.check_health()
        await w.controller.tick()
        (r,) = w.pool.of("lazy")
        r.last_used = w.clock.now
        w.clock.now += 299
        await w.controller.tick()
        assert not w.nodes.plans  # idle_timeout is 5m
        w.clock.now += 2
        w.nodes.while_stopping.append(lambda: w.controller.phase("lazy"))
        # a discovery whose probe was made before the stop does not put it back
        w.nodes.while_stopping.append(lambda: w.controller.with_starts({"lazy": [address]}))
        await w.controller.tick()
        await until(lambda: w.nodes.stops("lazy"), "the idle stop")
        await w.controller.idle()
        assert w.pool.of("lazy") == [] and not running_replicas(w.nodes.truth)
        # no stale look, neither while its units go (the last probe still shows them) nor
        # after (the controller probes after a stop, before discovery runs again)
        assert w.nodes.seen_while_stopping == [Phase.stopped, {"lazy": []}]
        assert w.controller.phase("lazy") is Phase.stopped
        assert [(a.model, a.action) for a in w.controller.actions] == [("lazy", "stop")]

    run(scenario)


async def _wedged(w: World) -> tuple[str, str]:
    """duo's two replicas ready on a and b, then b's engine wedged (its unit up, its
    health check failing) for longer than unhealthy_restart; their addresses."""
    first, second = w.run("duo", "a"), w.run("duo", "b")
    w.discover()
    w.health.update({first: 200, second: 200})
    await w.check_health()
    await w.controller.tick()
    w.health[second] = 500
    await w.check_health()
    await w.controller.tick()
    assert w.controller.phase("duo") is Phase.degraded and not w.nodes.plans
    w.clock.now += w.spec.gateway.unhealthy_restart + 1
    return first, second


def test_a_replica_failing_its_health_check_is_replaced_successor_first_when_one_fits() -> None:
    async def scenario() -> None:
        w = World(gpus=2, cluster=DUO)
        _, second = await _wedged(w)
        await w.controller.tick()
        await until(lambda: w.nodes.starts("duo"), "the successor's start")
        (successor,) = w.nodes.starts("duo")
        assert successor.replica == 2  # a new replica: the wedged one still holds its cards
        address = f"{w.spec.node(successor.nodes[0]).address}:{successor.port}"
        for _ in range(3):  # however long the successor loads, the wedged one stays
            await w.controller.tick()
            await asyncio.sleep(0.01)
        assert not w.nodes.stops("duo")
        w.health[address] = 200
        await until(lambda: w.nodes.stops("duo"), "the wedged replica stopped once its successor is ready")
        (stopped,) = w.nodes.stops("duo")
        assert f"{w.spec.node(stopped.nodes[0]).address}:{stopped.port}" == second
        await w.controller.idle()
        assert len(w.nodes.starts("duo")) == 1 and w.controller.phase("duo") is Phase.ready
        done = [(a.action, a.reason) for a in w.controller.actions]
        assert [a for a, _ in done] == ["replace", "start", "stop"]
        assert "a successor starts first" in done[0][1] and "failing its health check" in done[0][1]
        assert done[1][1].startswith("restart of replica 1, successor first: failing its health check")
        assert done[2][1].startswith(f"replaced by its successor at {address}, ready")
        w.metrics.build()
        body = (w.metrics.render() or b"").decode()
        assert 'llmgw_controller_actions_total{action="replace",model="duo",reason="unhealthy"} 1.0' in body
        assert 'llmgw_controller_actions_total{action="stop",model="duo",reason="replaced"} 1.0' in body

    run(scenario)


def test_the_controllers_replacement_is_carried_out_by_the_one_executor(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The successor-first replacement's steps are said by the executor apply uses too
    (``remote/executor.py``): its events, the weights fetch's included, come from it."""
    caplog.set_level(logging.INFO, "llmgw.executor")

    async def scenario() -> None:
        w = World(gpus=2, cluster=DUO)
        await _wedged(w)
        await w.controller.tick()
        await until(lambda: w.nodes.starts("duo"), "the successor's start")
        (successor,) = w.nodes.starts("duo")
        w.health[f"{w.spec.node(successor.nodes[0]).address}:{successor.port}"] = 200
        await until(lambda: w.nodes.stops("duo"), "the wedged replica stopped once its successor is ready")
        await w.controller.idle()

    run(scenario)
    events = [r.getMessage() for r in caplog.records if r.name == "llmgw.executor"]
    assert all(getattr(r, "source", None) == "executor" for r in caplog.records if r.name == "llmgw.executor")
    assert events == [
        "a: weights fetching",  # what the controller's Nodes report goes through it too
        "duo#2: starting (successor of #1)",
        "duo#1: draining",
        "duo#1: drained and stopped; replaced by #2",
    ]


def test_a_replica_failing_its_health_check_is_restarted_in_place_when_nothing_else_fits() -> None:
    async def scenario() -> None:
        w = World(gpus=1, cluster=DUO)
        _, second = await _wedged(w)
        await w.controller.tick()
        await until(lambda: w.nodes.starts("duo"), "the start after the restart's stop")
        (stopped,) = w.nodes.stops("duo")
        assert f"{w.spec.node(stopped.nodes[0]).address}:{stopped.port}" == second
        assert w.nodes.plans.index(stopped) < w.nodes.plans.index(w.nodes.starts("duo")[0])
        (start,) = w.nodes.starts("duo")
        assert start.nodes == stopped.nodes  # on its own cards: the only free ones then
        restart = next(a for a in w.controller.actions if a.action == "restart")
        assert "restarted in place: no free cards for a successor" in restart.reason
        assert "replace" not in [a.action for a in w.controller.actions]

    run(scenario)


def test_a_successor_that_does_not_start_leaves_the_replica_to_be_restarted_in_place() -> None:
    async def scenario() -> None:
        w = World(gpus=2, cluster=DUO)
        _, second = await _wedged(w)
        w.nodes.exit_next = "llmgw-duo-2.service failed\nCUDA error"
        await w.controller.tick()
        await until(
            lambda: len(w.nodes.starts("duo")) == 2, "the restart in place after the failed successor"
        )
        first_start, second_start = w.nodes.starts("duo")
        assert first_start.replica == 2 and second_start.replica == 1
        stopped = [f"{w.spec.node(a.nodes[0]).address}:{a.port}" for a in w.nodes.stops("duo")]
        assert stopped[-1] == second  # the failed successor's units went first, then the old one
        actions = [a.action for a in w.controller.actions]
        assert actions == ["replace", "start", "stop", "start-failed", "stop", "restart", "start"]
        restart = next(a for a in w.controller.actions if a.action == "restart")
        assert "restarted in place: its successor did not start" in restart.reason

    run(scenario)


# --- replicas apply drains ----------------------------------------------------------------


@pytest.mark.parametrize("ahead", [0.0, 500.0, -500.0])
def test_a_draining_replica_is_not_routed_counts_towards_min_then_is_stopped_when_abandoned(
    ahead: float,
) -> None:
    """Its deadline is on its node's clock, whichever way that one is off the gateway's."""

    async def scenario() -> None:
        w = World(cluster=DUO)
        first, second = w.run("duo", "a"), w.run("duo", "b")
        w.discover()
        w.health.update({first: 200, second: 200})
        await w.check_health()
        await w.controller.tick()
        assert w.controller.phase("duo") is Phase.ready
        w.drain(second, 30, ahead=ahead)
        w.nodes.facts = dict(w.nodes.truth)  # a probe of the controller's own sees it first
        await w.controller.tick()
        assert [r.address for r in w.pool.of("duo")] == [first]  # out of rotation at once
        assert w.controller.draining() == {second}
        w.discover()
        assert [r.address for r in w.pool.of("duo")] == [first]
        assert w.controller.phase("duo") is Phase.degraded
        # no start of a replacement (it counts towards min), no restart though it is not
        # checked any more, for as long as apply may take
        w.clock.now += 30 + DRAIN_GRACE - 1
        await w.controller.tick()
        await w.controller.idle()
        assert not w.nodes.plans and not w.controller.actions
        # past its deadline + DRAIN_GRACE its apply is gone: stopped, and replaced
        w.clock.now += 2
        await w.controller.tick()
        await until(lambda: w.nodes.starts("duo"), "a replacement")
        (stopped,) = w.nodes.stops("duo")
        assert f"{w.spec.node(stopped.nodes[0]).address}:{stopped.port}" == second
        stop = next(a for a in w.controller.actions if a.action == "stop")
        assert "left draining by an apply that did not finish" in stop.reason
        (start,) = w.nodes.starts("duo")
        assert start.nodes == ("b",)  # its cards back
        w.health[f"10.0.0.2:{start.port}"] = 200
        await w.controller.idle()
        assert w.controller.draining() == frozenset()  # the marker went with the unit
        w.metrics.build()
        body = (w.metrics.render() or b"").decode()
        assert (
            'llmgw_controller_actions_total{action="stop",model="duo",reason="drain-abandoned"} 1.0' in body
        )

    run(scenario)


def test_a_draining_replica_is_neither_stopped_when_idle_nor_evicted() -> None:
    async def scenario() -> None:
        w = World()
        w.nodes.truth = {"a": w.nodes.truth["a"]}
        w.spec = w.spec.model_copy(update={"nodes": [w.spec.node("a")]})
        address = w.run("lazy", "a")
        w.discover()
        w.health[address] = 200
        await w.check_health()
        await w.controller.tick()
        (r,) = w.pool.of("lazy")
        r.last_used = w.clock.now
        w.drain(address, 3600)
        w.discover()
        w.clock.now += 1800  # idle for 6 times its idle_timeout, and evictable
        await w.controller.tick()
        await w.controller.idle()
        assert not w.nodes.plans
        got = await w.controller.ensure_ready("other", time.monotonic() + FOREVER)
        assert isinstance(got, Unavailable) and got.code == "model_start_failed"
        assert "no idle on-demand replica may be evicted" in got.detail
        assert not w.nodes.stops()

    run(scenario)


SCALE = CLUSTER.replace(
    "gateway: {model_concurrency: 2}", "gateway: {model_concurrency: 1, scale_out_wait: 0s}"
) + (
    "  - {name: busy, source: org/busy, fetch: engine, profile: vllm, scaling: {min: 0, max: 2, idle_timeout: 5m}}\n"
)


def test_a_saturated_model_scales_out_and_the_start_is_counted_as_one() -> None:
    async def scenario() -> None:
        w = World(cluster=SCALE)
        address = w.run("busy", "a")
        w.discover()
        w.health[address] = 200
        await w.check_health()
        assert await w.admission.enter("busy", queue=10)
        waiting = asyncio.create_task(w.admission.enter("busy", queue=10))
        await until(lambda: w.admission.queued().get("busy") == 1, "a request in the queue")
        await w.controller.tick()
        await until(lambda: w.nodes.starts("busy"), "a second replica")
        (start,) = w.nodes.starts("busy")
        assert start.nodes == ("b",)
        w.health[f"10.0.0.2:{start.port}"] = 200
        assert await waiting  # let in by the new replica's slot, nobody left
        w.metrics.build()
        body = (w.metrics.render() or b"").decode()
        assert 'llmgw_scale_outs_total{model="busy"} 1.0' in body
        assert 'llmgw_controller_actions_total{action="start",model="busy",reason="scale-out"} 1.0' in body

    run(scenario)


def test_a_failed_start_is_answered_in_the_openai_shape_with_the_back_off_left() -> None:
    answer = proxy._refused(
        Unavailable(503, "model_start_failed", "The model `m` could not be started.", 7.2, "exit 1"), "req_1"
    )
    assert answer.status == 503 and answer.headers["Retry-After"] == "8"
    assert isinstance(answer.body, bytes)
    error = json.loads(answer.body)["error"]
    assert error["code"] == "model_start_failed" and error["type"] == "server_error"
    assert error["message"] == "The model `m` could not be started. (request id req_1)"
    off = proxy._refused(Unavailable(404, "model_off", "The model `m` is switched off.", 30.0), "req_2")
    assert off.status == 404 and "Retry-After" not in off.headers


def test_weights_come_outside_the_lock_and_a_start_meanwhile_does_not_take_the_same_card() -> None:
    async def scenario() -> None:
        w = World()
        w.nodes.fetch_gate = asyncio.Event()
        first = asyncio.create_task(w.controller.ensure_ready("lazy", time.monotonic() + FOREVER))
        await until(lambda: len(w.nodes.fetched_outside_lock) == 1, "the first start fetching")
        # the lock is free while it fetches: a second model starts meanwhile
        second = asyncio.create_task(w.controller.ensure_ready("other", time.monotonic() + FOREVER))
        await until(lambda: len(w.nodes.fetched_outside_lock) == 2, "the second start fetching")
        w.nodes.fetch_gate.set()
        await until(lambda: len(w.nodes.starts()) == 2, "both started")
        lazy, other = w.nodes.starts("lazy")[0], w.nodes.starts("other")[0]
        assert lazy.nodes != other.nodes  # one card each: the reserved one was left alone
        for a in (lazy, other):
            w.health[f"{w.spec.node(a.nodes[0]).address}:{a.port}"] = 200
        assert isinstance(await first, RoutedReplica) and isinstance(await second, RoutedReplica)

    run(scenario)


def test_a_start_whose_card_was_taken_while_it_fetched_is_placed_again_under_the_lock() -> None:
    async def scenario() -> None:
        w = World()
        w.nodes.fetch_gate = asyncio.Event()
        asked = asyncio.create_task(w.controller.ensure_ready("lazy", time.monotonic() + FOREVER))
        await until(lambda: w.nodes.fetched_outside_lock, "the start fetching")
        planned = w.controller._reserved()[0]
        w.run("other", planned.nodes[0])  # another writer (apply) took that card meanwhile
        w.nodes.fetch_gate.set()
        await until(lambda: w.nodes.starts("lazy"), "the start")
        (start,) = w.nodes.starts("lazy")
        assert start.nodes != planned.nodes
        assert w.nodes.fetched_in_execute == [True]  # its weights, where it goes now
        w.health[f"{w.spec.node(start.nodes[0]).address}:{start.port}"] = 200
        assert isinstance(await asked, RoutedReplica)

    run(scenario)


# --- repositories llmgw fetches: started at the commit apply pinned, never resolved here ----

COMMIT = "c0ffee" + "0" * 34
FETCHED = CLUSTER.replace("address: 10.0.0.1}", "address: 10.0.0.1, weights: [/w]}") + (
    "  - {name: repo, source: org/big@main, profile: vllm, fetch: {},"
    " scaling: {min: 0, max: 1, idle_timeout: 5m}}\n"
)


def fetched_world(tmp_path: Path, pins: str | None) -> World:
    """A world whose spec is loaded as `llmgw gateway run` loads it: the cluster file
    pinned by the pins file beside it (``pins``; None: no such file)."""
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(FETCHED)
    if pins is not None:
        (tmp_path / "pins.json").write_text(pins)
    w = World(gpus=1, cluster=FETCHED)
    w.spec = load_pinned(cluster)
    return w


def test_a_fetched_repository_starts_from_the_snapshot_of_the_pinned_commit(tmp_path: Path) -> None:
    async def scenario() -> None:
        w = fetched_world(tmp_path, pins_text(parse_cluster(FETCHED), {"repo": COMMIT}))
        ctl = w.controller
        asked = asyncio.create_task(ctl.ensure_ready("repo", time.monotonic() + FOREVER))
        await until(lambda: w.nodes.starts("repo"), "a start")
        (action,) = w.nodes.starts("repo")
        assert action.nodes == ("a",)  # the node with the weights folder (placed first)
        (unit,) = action.write
        assert f"/w/hf/org--big/{COMMIT} " in unit.text and "HF_HUB_OFFLINE=1" in unit.text
        assert "org/big@main" not in unit.text and "--revision" not in unit.text
        w.health[f"10.0.0.1:{action.port}"] = 200
        assert isinstance(await asked, RoutedReplica)
        await ctl.idle()

    run(scenario)


def test_an_unpinned_repository_is_refused_with_the_fix_and_other_models_still_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No pins file (a gateway run by hand before any apply): the model's start fails at
    once without probing or placing anything, its 503 gives a request id under which the
    gateway's log says to run apply; the others run."""
    caplog.set_level(logging.WARNING)

    async def scenario() -> None:
        w = fetched_world(tmp_path, None)
        ctl = w.controller
        got = await ctl.ensure_ready("repo", time.monotonic() + FOREVER)
        assert isinstance(got, Unavailable), got
        assert (got.status, got.code) == (503, "model_start_failed")
        assert "org/big@main is not resolved to a commit: run `llmgw apply`" in got.detail
        assert w.nodes.starts("repo") == [] and w.lock.whys == []  # nothing probed nor placed
        error = json.loads(proxy._refused(got, "req_1").body)["error"]  # type: ignore[arg-type]
        # the client reads a reason; the operator finds what to do in the log, under its id
        assert error["message"].endswith("(request id req_1)") and error["code"] == "model_start_failed"
        assert "request req_1: model_start_failed: org/big@main is not resolved" in caplog.text
        asked = asyncio.create_task(ctl.ensure_ready("lazy", time.monotonic() + FOREVER))
        await until(lambda: w.nodes.starts("lazy"), "a start of another model")
        (action,) = w.nodes.starts("lazy")
        w.health[f"{w.spec.node(action.nodes[0]).address}:{action.port}"] = 200
        assert isinstance(await asked, RoutedReplica)
        await ctl.idle()

    run(scenario)
    assert "model repo: org/big@main is not resolved to a commit" in caplog.text
    assert "repo: start failed: org/big@main is not resolved" in caplog.text


def test_a_crash_looping_replica_is_replaced_on_another_node_though_its_own_has_cards() -> None:
    """Its node's other card is free, but the node can be the cause (its engine program
    was replaced by one that exits): the replacement goes to the other node."""
    looping = UnitState(
        name="",
        load_state="loaded",
        active_state="activating",
        sub_state="auto-restart",
        result="exit-code",
        main_pid=0,
        n_restarts=3,
        exec_main_code=1,
        exec_main_status=1,
        age=4.0,
        lived=0.3,
    )

    async def scenario() -> None:
        w = World(gpus=2, cluster=ALONE)
        w.run("alone", "a", shown=looping)
        w.discover()
        await w.controller.tick()
        await until(lambda: w.nodes.starts("alone"), "a start after the stop")
        (stopped,) = w.nodes.stops("alone")
        assert stopped.nodes == ("a",) and "crash-looping on a" in stopped.reason
        (start,) = w.nodes.starts("alone")
        assert start.nodes == ("b",)

    run(scenario)


def test_a_replica_that_served_then_died_is_left_to_systemds_restart_and_judged_anew() -> None:
    """A real engine killed after minutes of serving is still on its way down, then in
    systemd's restart pause: not a crash loop (it served), not a unit to replace; once
    systemd started it again, it is a fresh start that has its start timeout to load."""
    killed = UnitState(
        name="",
        load_state="loaded",
        active_state="deactivating",  # vLLM's worker processes take seconds to go
        sub_state="final-sigterm",
        result="signal",
        main_pid=0,
        n_restarts=0,
        exec_main_code=2,
        exec_main_status=9,
        age=200.0,
        lived=200.0,  # shorter than its start timeout: by the units alone, crash-looping
    )

    async def scenario() -> None:
        w = World(gpus=2, cluster=DUO)
        w.run("duo", "a")
        address = w.run("duo", "b")
        w.discover()
        w.health.update({r.address: 200 for r in w.pool.all()})
        await w.check_health()
        await w.controller.tick()
        assert not w.nodes.stops() and not w.nodes.starts()
        for shown in (
            killed,
            killed.model_copy(update={"active_state": "activating", "sub_state": "auto-restart"}),
        ):
            w.nodes.truth = with_units(w.nodes.truth, _units_of(w, "b"), shown=shown)
            w.health[address] = None
            w.discover()
            await w.check_health()
            w.clock.now += 5
            await w.controller.tick()
            await settle()
            assert not w.nodes.stops(), (shown.active_state, w.nodes.stops())
        # systemd started it again: loading, not ready, for longer than unhealthy_restart
        loading = killed.model_copy(
            update={
                "active_state": "active",
                "sub_state": "running",
                "n_restarts": 1,
                "age": 1.0,
                "main_pid": 7,
            }
        )
        w.nodes.truth = with_units(w.nodes.truth, _units_of(w, "b"), shown=loading)
        for _ in range(3):
            w.discover()
            await w.check_health()
            w.clock.now += 40
            await w.controller.tick()
            await settle()
        assert not w.nodes.stops()  # 120 s of loading, within its start timeout
        w.health[address] = 200
        w.discover()
        await w.check_health()
        await w.controller.tick()
        await settle()
        assert not w.nodes.stops() and not w.nodes.starts()

    run(scenario)


async def settle() -> None:
    """Let the controller's background work (a stop, a start) run as far as it goes."""
    for _ in range(200):
        await asyncio.sleep(0)


def _units_of(w: World, node: str) -> list[tuple[str, str, str]]:
    """(node, name, text) of the units on ``node``: the labels a probe reads back."""
    facts = w.nodes.truth[node]
    return [
        (node, name, "".join(f"X-Llmgw-{k}={v}\n" for k, v in labels.items()))
        for name, labels in facts.unit_labels.items()
    ]


class CordonsUnreadable(SqliteStore):
    """A store whose cordons cannot be read (the rest works)."""

    async def cordons(self) -> list[Cordon]:
        raise OSError("store unreachable")


def test_starts_read_the_cordons_first_and_keep_the_last_read_when_the_store_fails(tmp_path: Path) -> None:
    async def scenario() -> None:
        w = World()
        store = SqliteStore(tmp_path)
        await store.cordon(Cordon("a", "fans", "ops@desk", T0))
        w.controller.store = store
        asked = asyncio.create_task(w.controller.ensure_ready("lazy", time.monotonic() + FOREVER))
        await until(lambda: w.nodes.starts("lazy"), "a start")
        (start,) = w.nodes.starts("lazy")
        assert start.nodes == ("b",)  # a ranks first, but it is cordoned
        w.health[f"10.0.0.2:{start.port}"] = 200
        assert isinstance(await asked, RoutedReplica)
        # b is full, a is cordoned: the other model's start fails, saying so
        w.controller.store = CordonsUnreadable(tmp_path)
        got = await w.controller.ensure_ready("other", time.monotonic() + FOREVER)
        assert isinstance(got, Unavailable) and got.code == "model_start_failed", got
        assert "cordoned: a" in got.detail, got.detail  # the cordon read last still counts
        assert w.nodes.starts("other") == []
        # once the cordon is lifted, the next start (after the back-off) goes to a
        w.controller.store = store
        assert await store.uncordon("a")
        w.clock.now += w.spec.gateway.start_backoff + 1
        again = asyncio.create_task(w.controller.ensure_ready("other", time.monotonic() + FOREVER))
        await until(lambda: w.nodes.starts("other"), "a start on a")
        (on_a,) = w.nodes.starts("other")
        assert on_a.nodes == ("a",)
        w.health[f"10.0.0.1:{on_a.port}"] = 200
        assert isinstance(await again, RoutedReplica)
        await w.controller.idle()

    run(scenario)
