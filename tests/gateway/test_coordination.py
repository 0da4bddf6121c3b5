"""Many gateway processes over one real store (SQLite, and PostgreSQL from the session's
server): two ``Gateway`` objects in one test, each with its own store object, over fake nodes (a shared truth that executed plans change; an engine
answers its health check as soon as its unit runs).

One leads and the other follows; a follower's on-demand request is started by the leader
(once); a leader whose lock goes is replaced and steps down; a stale leader's fenced nodes
and lock refuse to act, and a refused publication steps it down; the admission share
follows the member count; a revoked key is refused by every process; a follower's last use
keeps the leader from an idle stop; the published set is hostile data.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp import web

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.observe.facts import NodeFacts
from llmgw_cli.core.planning.controller import Phase
from llmgw_cli.core.planning.plan import Action, Plan, grow_plan, running_replicas
from llmgw_cli.core.serving.keys import ApiKey, hash_token
from llmgw_cli.core.serving.routing import serving_address
from llmgw_cli.errors import NotLeader
from llmgw_cli.gateway.control import controller as controller_module
from llmgw_cli.gateway.control import coordination
from llmgw_cli.gateway.control import state as state_module
from llmgw_cli.gateway.control.sources import PublishedSource
from llmgw_cli.gateway.control.state import Gateway
from llmgw_cli.gateway.serving import server
from llmgw_cli.gateway.store.postgres import PostgresStore
from llmgw_cli.gateway.store.sqlite import ModelState, Publication, SqliteStore, Store
from llmgw_cli.progress import FetchEvent, Report, silent
from llmgw_cli.remote.cluster_lock import gateway_lock
from llmgw_cli.remote.execute import Outcome
from llmgw_cli.remote.fetch import _progress_lines
from tests.gateway import harness
from tests.pg import Postgres
from tests.unit.facts_factory import node_facts, with_units
from tests.waiting import wait_until

CLUSTER = """\
cluster: {name: t}
nodes:
  - {name: a, address: 10.0.0.1}
  - {name: b, address: 10.0.0.2}
profiles:
  vllm: {engine: vllm, ports: 8100-8199, readiness: {start_timeout: 10m}}
gateway: {model_concurrency: 2, load_wait: 60s, state_dir: STATE}
models:
  - {name: lazy, source: org/lazy, fetch: engine, profile: vllm, scaling: {min: 0, max: 1, idle_timeout: 5m}}
"""

WAIT = 20.0  # seconds a test waits for something that takes a fraction of one (a broken one ends)


class Fleet:
    """The nodes' truth, shared by every gateway of a test: units that executed plans
    wrote, and the engines' health answers (one answers once its unit runs); and how a
    gateway of the test opens the store."""

    def __init__(self, spec: ClusterSpec, store: Callable[[], Store]) -> None:
        self.spec = spec
        self.store = store
        self.truth: dict[str, NodeFacts] = {n: node_facts(n, gpus=1) for n in "ab"}
        self.health: dict[str, int] = {}
        self.actions: list[tuple[str, Action]] = []  # (member that executed it, action)
        self.discover_delay = 0.0  # seconds a discovery takes (a slow probe of the nodes)
        # What a start's weights fetch reports (about the node the start goes to), and an
        # event it then waits for (None: it ends at once); the node it went to.
        self.fetch_events: list[FetchEvent] = []
        self.fetch_gate: asyncio.Event | None = None
        self.fetched_on: str | None = None

    def address(self, action: Action) -> str:
        assert action.port is not None
        return serving_address(self.spec.node(action.nodes[0]).engine_host, action.port)

    def run(self, model: str, node: str) -> str:
        """A replica of ``model`` running and ready on ``node``; its address."""
        hidden = {
            n: f if n == node else f.model_copy(update={"error": "hidden"}) for n, f in self.truth.items()
        }
        (action,) = grow_plan(self.spec, hidden, model).changes
        self.truth = with_units(self.truth, [(w.node, w.name, w.text) for w in action.write])
        self.health[self.address(action)] = 200
        return self.address(action)

    def discover(self) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for r in running_replicas(self.truth):
            if r.serving():
                address = serving_address(self.spec.node(r.members[0]).engine_host, r.port)
                found.setdefault(r.model, []).append(address)
        return found


class Watch:
    async def failure(self) -> str | None:
        return None


class FakeNodes:
    """One gateway's view of the fleet: its last probe, its executed plans."""

    def __init__(self, fleet: Fleet, member: Callable[[], str]) -> None:
        self.fleet = fleet
        self.member = member
        self.facts: dict[str, NodeFacts] = {}

    async def probe(self, spec: ClusterSpec) -> dict[str, NodeFacts]:
        self.facts = dict(self.fleet.truth)
        return self.facts

    async def fetch(self, spec: ClusterSpec, plan: Plan, report: Report) -> dict[str, str]:
        """The fetch events become lines as the gateway's remote nodes have them made
        (``ensure_for_plan(..., by_model=True)``), into the controller's report."""
        node = plan.changes[0].nodes[0]
        self.fleet.fetched_on = node
        on_event = _progress_lines(report, by_model=True)
        for e in self.fleet.fetch_events:
            on_event(dataclasses.replace(e, node=node))
        if self.fleet.fetch_gate is not None:
            await self.fleet.fetch_gate.wait()
        return {}

    async def execute(
        self, spec: ClusterSpec, plan: Plan, report: Callable[[str, str], None], *, fetch: bool = False
    ) -> list[Outcome]:
        for action in plan.changes:
            self.fleet.actions.append((self.member(), action))
            for node, name in action.remove:
                f = self.fleet.truth[node]
                self.fleet.truth[node] = f.model_copy(
                    update={
                        "units": tuple(u for u in f.units if u.name != name),
                        "unit_labels": {k: v for k, v in f.unit_labels.items() if k != name},
                    }
                )
            if action.remove:
                self.fleet.health.pop(self.fleet.address(action), None)
            if action.write:
                self.fleet.truth = with_units(
                    self.fleet.truth, [(w.node, w.name, w.text) for w in action.write]
                )
                self.fleet.health[self.fleet.address(action)] = 200
        return [Outcome(n, True, "units in place") for a in plan.changes for n in a.nodes]

    async def watch(self, spec: ClusterSpec, action: Action, since: str = "") -> Watch:
        return Watch()


class FleetSource:
    """What a process that may lead discovers: the nodes' truth (its ProbeSource)."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    async def discover(self, spec: ClusterSpec) -> dict[str, list[str]]:
        await asyncio.sleep(self.fleet.discover_delay)
        return self.fleet.discover()

    async def close(self) -> None:
        return None


def gateway(fleet: Fleet, *, follow: bool = False) -> Gateway:
    """One gateway process: its own store object, fake nodes, the real cluster lock (a file
    in the state folder), health from the fleet."""
    spec = fleet.spec
    store = fleet.store()
    holder: list[Gateway] = []
    nodes = FakeNodes(fleet, lambda: holder[0].coordinator.member)
    gw = Gateway(
        spec,
        PublishedSource(store) if follow else FleetSource(fleet),
        store,
        "k",
        discover_every=0.2,
        health_every=0.1,
        flush_every=0.2,
        manage_replicas=True,
        lock=gateway_lock(spec),
        nodes=nodes,
        can_lead=not follow,
    )
    holder.append(gw)

    async def health(address: str, model: str) -> int | None:
        return fleet.health.get(address)

    gw.health_status = health  # type: ignore[method-assign]
    gw.controller.health = health
    return gw


@pytest.fixture(autouse=True)
def fast(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loops that look often in real time (no test asserts on a duration)."""
    for name, seconds in (
        ("HEARTBEAT_EVERY", 0.05),
        ("LEAD_EVERY", 0.05),
        ("PUBLISH_EVERY", 0.3),
        ("REQUESTS_EVERY", 0.05),
        ("WATCH_EVERY", 0.05),
    ):
        monkeypatch.setattr(coordination, name, seconds)
    monkeypatch.setattr(controller_module, "WATCH_EVERY", 0.01)
    monkeypatch.setattr(controller_module, "UNIT_EVERY", 0.0)
    monkeypatch.setattr(controller_module, "FOLLOWER_LOOK", 0.05)


@pytest.fixture(params=["sqlite", "postgres"])
def fleet(request: pytest.FixtureRequest, tmp_path: Path) -> Fleet:
    spec = parse_cluster(CLUSTER.replace("STATE", str(tmp_path / "state")))
    (tmp_path / "state").mkdir(mode=0o700)  # where the cluster lock is, whatever the store
    if request.param == "sqlite":
        return Fleet(spec, lambda: SqliteStore(tmp_path / "state"))
    server: Postgres = request.getfixturevalue("postgres")
    url = server.new_database()
    return Fleet(spec, lambda: PostgresStore(url, server.password))


async def until(condition: Callable[[], object], what: str) -> None:
    end = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < end, f"never happened: {what}"
        await asyncio.sleep(0.01)


@asynccontextmanager
async def started(*gws: Gateway) -> AsyncIterator[None]:
    try:
        for gw in gws:
            await gw.start()
        yield
    finally:
        for gw in reversed(gws):
            await gw.stop()


def run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(scenario())


@asynccontextmanager
async def serving(gw: Gateway, key: str) -> AsyncIterator[openai.AsyncOpenAI]:
    """The gateway's public API on a loopback port, and the official client to it."""
    runner = web.AppRunner(server.public_app(gw))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)
    try:
        yield client
    finally:
        await client.close()
        await runner.cleanup()


def test_one_leads_the_other_follows_and_a_followers_request_is_started_by_the_leader(fleet: Fleet) -> None:
    async def scenario() -> None:
        leader, follower = gateway(fleet), gateway(fleet)
        async with started(leader, follower):
            assert leader.coordinator.leading and leader.controller.manages
            assert not follower.coordinator.leading and not follower.controller.manages
            assert follower.controller.following is not None
            assert isinstance(follower.source, PublishedSource)
            # the follower's model state is the leader's publication
            await until(
                lambda: follower.controller.following is not None and follower.controller.following.models,
                "a publication read",
            )
            assert follower.controller.phases()["lazy"] is Phase.stopped
            found = await follower.controller.ensure_ready("lazy", time.monotonic() + WAIT)
            assert not isinstance(found, controller_module.Unavailable), found
            starts = [(who, a) for who, a in fleet.actions if a.op == "+"]
            assert [(who, a.model) for who, a in starts] == [(leader.coordinator.member, "lazy")]
            assert found.address == fleet.address(starts[0][1])
            await until(lambda: follower.controller.phases()["lazy"] is Phase.ready, "ready published")
            # asked again (another request): nothing more is started
            again = await follower.controller.ensure_ready("lazy", time.monotonic() + WAIT)
            assert not isinstance(again, controller_module.Unavailable)
            await asyncio.sleep(0.3)
            assert len([a for _, a in fleet.actions if a.op == "+"]) == 1

    run(scenario)


def test_a_request_to_a_follower_waits_for_the_leaders_first_publication(fleet: Fleet) -> None:
    """Workers start together: a follower can serve before its leader has published
    anything. A request for an always-on model that runs waits for that publication
    instead of a 503 at once."""
    spec = parse_cluster(
        CLUSTER.replace("STATE", str(fleet.spec.gateway.state_dir)).replace(
            "scaling: {min: 0, max: 1, idle_timeout: 5m}", "scaling: {min: 1, max: 1}"
        )
    )
    fleet.spec = spec
    address = fleet.run("lazy", "a")

    async def scenario() -> None:
        follower = gateway(fleet, follow=True)
        async with started(follower):
            assert follower.controller.following is not None
            assert not follower.controller.following.published
            asking = asyncio.create_task(follower.controller.ensure_ready("lazy", time.monotonic() + WAIT))
            await asyncio.sleep(0.5)
            assert not asking.done(), asking.result()  # not a 503 at once: it waits
            leader = gateway(fleet)
            async with started(leader):
                found = await asking
                assert not isinstance(found, controller_module.Unavailable), found
                assert found.address == address
                assert follower.controller.following.published
            assert not [a for _, a in fleet.actions if a.op == "+"]  # the leader started nothing

    run(scenario)


def test_a_follower_is_told_the_leaders_start_failure(fleet: Fleet) -> None:
    async def scenario() -> None:
        leader, follower = gateway(fleet), gateway(fleet)
        async with started(leader, follower):
            fleet.truth = {n: f.model_copy(update={"gpus": ()}) for n, f in fleet.truth.items()}  # no room
            found = await follower.controller.ensure_ready("lazy", time.monotonic() + WAIT)
            assert isinstance(found, controller_module.Unavailable)
            assert found.code == "model_start_failed", found
            assert "could not be started" in found.message
            assert float(found.headers["Retry-After"]) >= 1
            assert follower.controller.phases()["lazy"] is Phase.failed

    run(scenario)


def test_the_follower_takes_over_when_the_leaders_lock_goes(fleet: Fleet) -> None:
    async def scenario() -> None:
        first, second = gateway(fleet), gateway(fleet)
        async with started(first, second):
            old = first.coordinator.fence
            assert old is not None and second.coordinator.fence is None
            leadership = first.coordinator.leadership
            assert leadership is not None
            await leadership.release()  # what a dead process's lock does
            await until(lambda: second.coordinator.leading, "the follower leads")
            assert second.controller.following is None
            await until(lambda: second.controller.manages, "the new leader manages, once it probed the nodes")
            assert second.coordinator.fence is not None and second.coordinator.fence > old
            await until(lambda: not first.coordinator.leading, "the old leader steps down")
            assert not first.controller.manages and first.controller.following is not None
            assert isinstance(first.source, PublishedSource)
            # the new leader serves the followers' requests
            found = await first.controller.ensure_ready("lazy", time.monotonic() + WAIT)
            assert not isinstance(found, controller_module.Unavailable), found
            assert [who for who, a in fleet.actions if a.op == "+"] == [second.coordinator.member]

    run(scenario)


def test_a_request_during_a_take_over_waits_for_the_new_leader_to_manage(fleet: Fleet) -> None:
    """A process that took the lead manages only once it has probed the nodes; an on-demand
    request it gets meanwhile waits for that and is started, not refused."""

    async def scenario() -> None:
        first, second = gateway(fleet), gateway(fleet)
        async with started(first, second):
            fleet.discover_delay = 1.0
            await first.coordinator.resign()  # what a gateway stopping does: another leads
            await until(lambda: second.coordinator.leading, "the follower leads")
            assert not second.controller.manages and second.controller.taking_over
            found = await second.controller.ensure_ready("lazy", time.monotonic() + WAIT)
            assert not isinstance(found, controller_module.Unavailable), found
            assert second.controller.manages and not second.controller.taking_over
            assert [who for who, a in fleet.actions if a.op == "+"] == [second.coordinator.member]

    run(scenario)


def test_a_stale_leader_refuses_to_touch_the_nodes_and_steps_down(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(coordination, "LEAD_EVERY", 3600.0)  # the stale one must not notice by itself

    async def scenario() -> None:
        stale, other = gateway(fleet), gateway(fleet)
        async with started(stale, other):
            assert stale.coordinator.leading
            leadership, rival = stale.coordinator.leadership, other.coordinator.leadership
            assert leadership is not None and rival is not None
            old = stale.coordinator.fence
            assert old is not None
            await leadership.release()  # its lock went (the process does not know yet)
            stale.coordinator.fence = leadership.fence = old  # it still believes it leads
            assert await rival.try_acquire() is not None  # another member took the lead
            plan = grow_plan(fleet.spec, fleet.truth, "lazy")
            nodes = stale.controller.nodes
            assert nodes is not None
            with pytest.raises(NotLeader):
                await nodes.execute(fleet.spec, plan, silent)
            assert fleet.actions == []
            assert not stale.coordinator.leading and not stale.controller.manages  # stepped down
            stale.coordinator.fence = old  # believes it again
            with pytest.raises(NotLeader):
                async with stale.controller.lock.hold("place a replica"):
                    raise AssertionError("held the lock without leading")
            stale.coordinator.fence = old
            stale.controller.manages = True
            stale.controller.following = None
            stale.controller.want("lazy")  # a start begins, and meets the fence
            await stale.controller.idle()
            assert fleet.actions == []
            # a publication under a stale fence is refused: it steps down
            stale.coordinator.fence = old
            stale.coordinator._dirty.set()
            await stale.coordinator.publish()
            assert not stale.coordinator.leading and stale.controller.following is not None
            await rival.release()

    run(scenario)


def test_each_process_takes_its_share_of_a_replicas_concurrency(fleet: Fleet) -> None:
    fleet.run("lazy", "a")

    async def scenario() -> None:
        first = gateway(fleet)
        async with started(first):
            await until(lambda: first.pool.ready_count("lazy") == 1, "the replica ready")
            assert first.admission.limit("lazy") == 2  # alone: model_concurrency
            second = gateway(fleet)
            async with started(second):
                await until(lambda: first.admission.limit("lazy") == 1, "the first one's share halved")
                await until(lambda: second.admission.limit("lazy") == 1, "the second one's share")
            await until(lambda: first.admission.limit("lazy") == 2, "the whole again once alone")

    run(scenario)


def test_a_revoked_key_is_refused_by_every_process(fleet: Fleet) -> None:
    async def scenario() -> None:
        admin = fleet.store()
        await admin.add_key(ApiKey(name="k1", digest=hash_token("secret-1"), models=()))
        one, two = gateway(fleet), gateway(fleet, follow=True)
        async with started(one, two):
            assert one.authenticate("secret-1") is not None and two.authenticate("secret-1") is not None
            await admin.revoke("k1")
            await until(lambda: one.authenticate("secret-1") is None, "refused by the leader")
            await until(lambda: two.authenticate("secret-1") is None, "refused by the follower")
        await admin.close()

    run(scenario)


def test_a_key_made_a_moment_ago_is_accepted_by_a_process_that_has_not_looked_yet(fleet: Fleet) -> None:
    """A client uses a key as soon as ``keys create`` printed it. The process it reaches
    may not have seen the change yet (here its watch never looks): an unknown token makes
    it look at the store once, and a flood of unknown tokens makes it look once."""

    async def late(timeout: float) -> None:
        await asyncio.sleep(3600)  # a change notice that never comes in this test

    async def scenario() -> None:
        admin = fleet.store()
        one = gateway(fleet)
        one.store.wait_change = late  # type: ignore[method-assign]
        async with started(one), serving(one, "secret-new") as client:
            await admin.add_key(ApiKey(name="new", digest=hash_token("secret-new"), models=()))
            assert one.authenticate("secret-new") is None  # not in memory yet
            # through the public API with the official client: past the key, to the model
            with pytest.raises(openai.NotFoundError):
                await client.chat.completions.create(model="no-such-model", messages=[], max_tokens=1)
            assert one.authenticate("secret-new") is not None

            reads = 0
            version = one.store.keys_version

            async def counted() -> int:
                nonlocal reads
                reads += 1
                return await version()

            one.store.keys_version = counted  # type: ignore[method-assign]
            await asyncio.sleep(state_module.MISS_LOOK_EVERY)  # the last look is old enough
            began = time.monotonic()
            refused = await asyncio.gather(*(one.authenticate_fresh(f"wrong-{i}") for i in range(50)))
            assert refused == [None] * 50
            for i in range(50):
                assert await one.authenticate_fresh(f"wrong-again-{i}") is None
            # one look per MISS_LOOK_EVERY at most (one in all, unless the machine is slow)
            assert 1 <= reads <= 1 + (time.monotonic() - began) // state_module.MISS_LOOK_EVERY
        await admin.close()

    run(scenario)


def test_a_followers_last_use_keeps_the_leader_from_an_idle_stop(fleet: Fleet) -> None:
    address = fleet.run("lazy", "a")

    async def scenario() -> None:
        leader, follower = gateway(fleet), gateway(fleet, follow=True)
        async with started(leader, follower):
            await until(lambda: follower.pool.ready_count("lazy") == 1, "the follower routes it")
            spec = leader.spec
            stale = time.time() - 3600
            for r in leader.pool.all():
                r.last_used = stale  # unused here for an hour
            leader.controller.saved = {}
            assert leader.controller._still_idle(spec, "lazy", address)
            (routed,) = follower.pool.of("lazy")
            routed.last_used = time.time()  # used through the follower just now
            await follower.flush()
            await leader.controller._read_last_use()
            assert not leader.controller._still_idle(spec, "lazy", address)

    run(scenario)


def test_the_published_set_is_hostile_data(tmp_path: Path) -> None:
    spec = parse_cluster(CLUSTER.replace("STATE", str(tmp_path)))

    async def scenario() -> None:
        store = SqliteStore(tmp_path)
        leadership = store.leadership("writer")
        fence = await leadership.try_acquire()
        assert fence is not None
        good = serving_address(spec.node("a").engine_host, 8100)
        replicas = {
            "lazy": [good, "203.0.113.9:8100", "10.0.0.1:0", "10.0.0.1:99999", "10.0.0.1:+81", "x" * 400],
            "not-in-the-catalog": [good],
        }
        weird = {"lazy": ModelState(phase="no-such-phase")}
        assert await store.publish(fence, Publication(replicas, [], weird), "writer")
        source = PublishedSource(store)
        assert await source.discover(spec) == {"lazy": [good]}
        await leadership.release()

    run(scenario)


def test_a_follow_process_routes_to_the_published_replicas_and_needs_no_ssh_key(tmp_path: Path) -> None:
    """`llmgw gateway run --follow`, a real process with no SSH key and a node it could
    not reach anyway: it routes to what the leader (here the test) publishes, and answers
    from the published model states."""
    engine = harness.Engine(tmp_path, "m")
    model = {
        "name": "m",
        "source": "org/m",
        "fetch": "engine",
        "profile": "sim",
        "scaling": {"min": 0, "max": 1, "idle_timeout": "5m"},
    }
    gw = harness.Gateway(tmp_path, [model], {})
    key = gw.cli("keys", "create", "--name", "user")
    state = tmp_path / "state"

    async def publish(replicas: dict[str, list[str]], models: dict[str, ModelState]) -> None:
        store = SqliteStore(state)
        leadership = store.leadership("the-test")
        fence = await leadership.try_acquire()
        assert fence is not None
        assert await store.publish(fence, Publication(replicas, [], models), "the-test")
        await leadership.release()

    asyncio.run(publish({"m": [engine.address]}, {"m": ModelState(phase="ready")}))
    gw.proc = harness.start_gateway(
        gw.cluster,
        gw.log,
        *("--follow", "--engine-key-file", str(tmp_path / "engine.env"), "--health-every", "0.2"),
        port=gw.port,
    )
    try:
        client = gw.client(key)
        messages: list[Any] = [{"role": "user", "content": "hi"}]
        wait_until(
            lambda: client.chat.completions.create(model="m", messages=messages).choices,
            timeout=WAIT,
            retry_on=(openai.APIStatusError,),
            what="an answer through the follower",
        )
        (listed,) = client.models.list().data
        assert listed.model_dump()["state"] == "ready"
        failed = ModelState(
            phase="failed", failures=1, last_failure="no room on any node", retry_at=time.time() + 60
        )
        asyncio.run(publish({}, {"m": failed}))

        def refused() -> str | None:
            """The request id of a 503 model_start_failed, once the follower answers one."""
            try:
                client.chat.completions.create(model="m", messages=messages)
            except openai.APIStatusError as exc:
                if exc.status_code == 503 and exc.code == "model_start_failed":
                    return exc.request_id
            return None

        rid = wait_until(refused, timeout=WAIT, what="the leader's start failure through the follower")
    finally:
        assert gw.stop() == 0
        engine.stop()
    log = gw.log.read_text()
    assert "ssh" not in log.lower(), log
    # why, under the request id the client was given
    assert f"request {rid}: model_start_failed: no room on any node" in log, log


def test_a_start_fetching_a_repository_says_how_far_in_its_503_and_in_v1_models(fleet: Fleet) -> None:
    """A start whose fetch reports a snapshot's files and bytes: how far it is, in fixed
    words, reaches the 503 ``model_loading`` message and ``/v1/models`` (read by the
    official client) of the leader, and of a follower through the leader's publication; it
    is gone once the model is ready."""
    fleet.spec = parse_cluster(
        CLUSTER.replace("STATE", str(fleet.spec.gateway.state_dir)).replace("load_wait: 60s", "load_wait: 1s")
    )
    gb = 10**9
    fleet.fetch_events = [
        FetchEvent("lazy", "", "fetching", "origin", 0, 810 * gb, files=0, files_total=191),
        FetchEvent("lazy", "", "fetching", "origin", 512 * gb, 810 * gb, files=142, files_total=191),
    ]
    messages: list[Any] = [{"role": "user", "content": "hi"}]

    async def loading(client: openai.AsyncOpenAI) -> tuple[int, object, str]:
        """A chat request's refusal: status, code and message (the client's own
        ``message`` puts the status before it)."""
        with pytest.raises(openai.InternalServerError) as refused:
            await client.chat.completions.create(model="lazy", messages=messages)
        error = refused.value
        assert isinstance(error.body, dict)
        # without the request id the message ends with (each answer has its own)
        message = str(error.body["message"]).removesuffix(f" (request id {error.request_id})")
        return error.status_code, error.code, message

    async def listed(client: openai.AsyncOpenAI) -> dict[str, object]:
        (model,) = (await client.models.list()).data
        return dict(model.model_extra or {})

    async def scenario() -> None:
        fleet.fetch_gate = asyncio.Event()
        admin = fleet.store()
        await admin.add_key(ApiKey(name="k1", digest=hash_token("secret-1"), models=()))
        await admin.close()
        leader, follower = gateway(fleet), gateway(fleet, follow=True)
        async with (
            started(leader, follower),
            serving(leader, "secret-1") as to_leader,
            serving(follower, "secret-1") as to_follower,
        ):
            assert (await listed(to_leader))["progress"] == ""  # stopped: nothing to say
            refused = await loading(to_leader)  # began the start, waited load_wait
            said = "fetching weights: 142/191 files, 512 of 810 GB"  # in fixed words, without nodes
            assert refused == (503, "model_loading", f"The model `lazy` is loading ({said}); retry shortly.")
            assert await listed(to_leader) == {"state": "starting", "mode": "on-demand", "progress": said}
            # the whole text, for the operator (the dashboard, the log)
            whole = f"lazy@{fleet.fetched_on}: fetching 142/191 files, 512 of 810 GB from origin"
            assert leader.controller.model_state("lazy").progress == whole
            end = time.monotonic() + WAIT
            while (await listed(to_follower)).get("progress") != said:  # once published
                assert time.monotonic() < end, "the follower never said the leader's progress"
                await asyncio.sleep(0.05)
            assert await loading(to_follower) == refused
            fleet.fetch_gate.set()
            await until(lambda: leader.controller.phases()["lazy"] is Phase.ready, "ready")
            assert await listed(to_leader) == {"state": "ready", "mode": "on-demand", "progress": ""}

    run(scenario)
