"""apply's rolling replacement (``remote/rollout.py``) against fake nodes and a fake
gateway host: the order of its steps, the cluster lock taken per write step and never
held while it waits, the drain marker and the probe-now signal, the requests cut at the
drain bound. ``execute``, ``wait_started`` and the probe are replaced (their own tests
cover them); the nodes answer the commands the steps run."""

from __future__ import annotations

import asyncio
import base64
import logging
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.observe.facts import NodeFacts
from llmgw_cli.core.planning.drain import DRAIN_DIR, Routes, marker_text, routes_text
from llmgw_cli.core.planning.plan import Action, Plan, Retired, make_plan
from llmgw_cli.core.serving.routing import serving_address
from llmgw_cli.progress import Phase
from llmgw_cli.remote import executor, rollout
from llmgw_cli.remote.connect import Connections
from llmgw_cli.remote.execute import Outcome
from llmgw_cli.remote.probe import Snapshot
from llmgw_cli.remote.transport import CommandResult, Transport

from .facts_factory import node_facts, with_units

CLUSTER = """\
cluster: {name: t}
fabrics: {ib: {kind: infiniband}}
nodes:
  - {name: a, address: 10.0.0.1, fabric: ib, hcas: [mlx5_0]}
  - {name: b, address: 10.0.0.2, fabric: ib, hcas: [mlx5_0]}
profiles:
  vllm: {engine: vllm, ports: 8100-8199}
gateway: {host: gw.example, state_dir: /var/lib/llmgw/gateway, drain_timeout: 1s}
models:
  - {name: m, source: org/m, fetch: engine, profile: vllm, scaling: {min: 2, max: 2}}
  - {name: n, source: org/n, fetch: engine, profile: vllm, scaling: {min: 1, max: 1}}
"""
CLOCK = 1700000000
GATEWAY_PID = 4242


@dataclass
class World:
    """What the fake nodes, gateway host and lock saw, in order."""

    spec: ClusterSpec
    locked: bool = False
    events: list[str] = field(default_factory=list)
    markers: dict[tuple[str, str], str] = field(default_factory=dict)
    asked_to_mark: list[tuple[str, str, str]] = field(default_factory=list)  # (node, unit, seconds)
    in_flight: dict[tuple[str, int], list[int]] = field(default_factory=dict)
    gateway: bool = True  # a gateway writes its routing view
    started: set[tuple[str, str]] = field(default_factory=set)  # (model, address) up
    routed: set[tuple[str, str]] = field(default_factory=set)  # what the gateway routes
    ready_fails: set[str] = field(default_factory=set)  # subjects that never get ready
    said: list[tuple[str, str]] = field(default_factory=list)
    phases: dict[str, Phase] = field(default_factory=dict)  # each subject's latest

    def event(self, what: str) -> None:
        self.events.append(what)

    def report(self, who: str, message: str, phase: Phase = Phase.working, /) -> None:
        self.said.append((who, message))
        self.phases[who] = phase

    def address(self, node: str, port: int) -> str:
        return serving_address(self.spec.node(node).engine_host, port)

    units: dict[str, str] = field(default_factory=dict)  # address -> unit name
    lock_in_use: bool = True  # False: --no-lock, the fakes do not check it

    def must_hold(self, what: str) -> None:
        assert self.locked or not self.lock_in_use, f"{what} without the lock"

    def must_not_hold(self, what: str) -> None:
        assert not self.locked, f"{what} under the lock"

    def probe_now(self) -> None:
        """The gateway's discovery: every replica started and not marked draining."""
        draining = {path.rsplit("/", 1)[1] for _, path in self.markers}
        self.routed = {(m, a) for m, a in self.started if self.units.get(a) not in draining}


@dataclass
class Host:
    """A node or the gateway host, answering the commands the rolling steps run."""

    node: str
    world: World

    async def run(self, command: str, *, root: bool = False, stdin: str | None = None) -> CommandResult:
        w = self.world
        if "base64 -w0" in command:  # the routes files of live gateways
            if not w.gateway:
                return CommandResult(0, "", "")
            ready: dict[str, frozenset[str]] = {}
            for model, address in w.routed:
                ready[model] = ready.get(model, frozenset()) | {address}
            text = routes_text(Routes(pid=GATEWAY_PID, written=0.0, ready=ready))
            return CommandResult(0, f"{GATEWAY_PID} {base64.b64encode(text.encode()).decode()}\n", "")
        if f"kill -USR1 {GATEWAY_PID} " in command:
            # read and signalled as the routes folder's owner, never as root
            assert 'runuser -u "$o"' in command
            w.event("probe now")
            w.probe_now()
            return CommandResult(0, "", "")
        words = shlex.split(command)
        if words[0].endswith("node-helper") and words[1] == "date":
            return CommandResult(0, f"{CLOCK}\n", "")
        if words[0].endswith("node-helper") and words[1] == "drain-mark":
            # the helper writes the marker: the node's clock plus the seconds asked
            w.must_hold("marker written")
            w.asked_to_mark.append((self.node, words[2], words[3]))
            w.markers[(self.node, f"{DRAIN_DIR}/{words[2]}")] = marker_text(CLOCK + float(words[3]))
            w.event(f"marker {self.node}")
            return CommandResult(0, "", "")
        if words[0].endswith("node-helper") and words[1] == "drain-clear":
            for unit in words[2:]:
                w.markers.pop((self.node, f"{DRAIN_DIR}/{unit}"), None)
            return CommandResult(0, "", "")
        if words[:2] == ["ss", "-Htn"]:
            port = int(words[-1].split(":")[-1].rstrip(" )"))
            counts = w.in_flight.get((self.node, port), [0])
            count = counts.pop(0) if len(counts) > 1 else counts[0]
            w.must_not_hold("connections counted")
            w.event(f"count {self.node}:{port}={count}")
            return CommandResult(0, "ESTAB 0 0 x y\n" * count, "")
        if words[:2] == ["python3", "-I"] and words[4] == "remove":
            for path in words[5:]:
                w.markers.pop((self.node, path), None)
            return CommandResult(0, "", "")
        raise AssertionError(f"{self.node}: unexpected command {command!r}")

    async def close(self) -> None:
        pass


@dataclass
class Hold:
    world: World

    async def release(self) -> None:
        assert self.world.locked
        self.world.locked = False
        self.world.event("unlock")


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    spec = parse_cluster(CLUSTER)
    w = World(spec)

    async def execute(spec: Any, conns: Any, plan: Plan, report: Any, **kwargs: Any) -> list[Outcome]:
        w.must_hold("units written")
        (action,) = plan.actions
        kind = {"+": "start", "-": "stop", "~": "stop and start"}[action.op]
        w.event(f"{kind} {action.model}#{action.replica}")
        for node, unit in action.remove:
            for key in [k for k in w.markers if k[0] == node and k[1].endswith("/" + unit)]:
                del w.markers[key]  # execute removes a unit's marker with it
        if action.op == "-" and action.port is not None:
            w.started.discard((action.model, w.address(action.nodes[0], action.port)))
        if action.write and action.port is not None:
            address = w.address(action.nodes[0], action.port)
            w.started.add((action.model, address))
            w.units[address] = action.write[0].name
        return [Outcome(n, True, "units in place") for n in action.nodes]

    async def wait_started(
        spec: Any, conns: Any, plan: Plan, done: list[Outcome], report: Any
    ) -> list[Outcome]:
        w.must_not_hold("waited for readiness")
        (action,) = plan.actions
        who = f"{action.model}#{action.replica}"
        w.event(f"ready {who}")
        ok = who not in w.ready_fails
        return [Outcome(who, ok, "ready" if ok else "not ready")]

    async def gather(spec: Any, conns: Any, nodes: list[str], *args: Any) -> Snapshot:
        w.must_hold("probed for a start")
        return Snapshot(tuple(node_facts(n) for n in nodes), 0.0)

    monkeypatch.setattr(rollout, "execute", execute)
    monkeypatch.setattr(rollout, "wait_started", wait_started)
    monkeypatch.setattr(rollout, "gather", gather)
    monkeypatch.setattr(rollout, "POLL", 0.01)
    monkeypatch.setattr(rollout, "HEALTH_INTERVAL", 0.01)
    monkeypatch.setattr(rollout, "ROUTED_BOUND", 2.0)
    yield w


def replaced(
    w: World, model: str, old: int, node: str, port: int, *, new: int, new_port: int, surge: bool = True
) -> Action:
    """A ``~`` of ``model#old`` on ``node:port`` by ``#new`` on the same node."""
    unit = f"llmgw-{model}-{old}.service"
    w.started.add((model, w.address(node, port)))
    w.units[w.address(node, port)] = unit
    w.routed.add((model, w.address(node, port)))
    grown = make_plan(w.spec, {"a": node_facts("a"), "b": node_facts("b")})
    write = next(a for a in grown.changes if a.model == model).write[:1]
    write = tuple(u.model_copy(update={"node": node, "name": f"llmgw-{model}-{new}.service"}) for u in write)
    return Action(
        op="~",
        model=model,
        replica=new,
        nodes=(node,),
        reason="spec changed",
        write=write,
        remove=((node, unit),),
        port=new_port,
        gpus={node: (f"GPU-{node}-7",)},
        retire=Retired(replica=old, nodes=(node,), unit=unit, port=port),
        surge=surge,
    )


def rolled(w: World, actions: list[Action], *, lock: bool = True) -> list[Outcome]:
    class Take:
        async def take(self, spec: Any, conns: Any, why: str) -> Hold:
            assert not w.locked, "the lock taken twice"
            w.locked = True
            w.event("lock")
            return Hold(w)

    def opener(spec: Any, node: Any, base: Any, access: Any) -> Transport:
        return Host(node.name, w)

    async def scenario() -> list[Outcome]:
        async with Connections(w.spec, Path(), opener=opener) as conns:
            rolled = await rollout.roll_each(
                w.spec, conns, actions, w.report, take_lock=Take() if lock else None, fetch=False
            )
            return [o for r in rolled for o in r.outcomes]

    return asyncio.run(scenario())


def test_a_surge_starts_the_successor_then_drains_and_stops_the_old_one(world: World) -> None:
    action = replaced(world, "m", 0, "a", 8100, new=1, new_port=8102)
    world.in_flight[("a", 8100)] = [2, 1, 0]
    outcomes = rolled(world, [action])
    assert world.events == [
        "lock",
        "start m#1",
        "unlock",
        "ready m#1",
        "probe now",  # the successor: routed once the gateway probed
        "lock",
        "marker a",
        "unlock",
        "probe now",  # the old one: out of rotation once the gateway saw its marker
        "count a:8100=2",
        "count a:8100=1",
        "count a:8100=0",
        "lock",
        "stop m#0",
        "unlock",
    ]
    assert ("m", world.address("a", 8102)) in world.routed
    assert ("m", world.address("a", 8100)) not in world.routed
    assert world.markers == {}  # removed with the units
    last = outcomes[-1]
    assert last == Outcome("m#0", True, "drained and stopped; replaced by #1")
    said = [m for who, m in world.said if who in ("m#0", "m#1")]
    assert said == [
        "starting (successor of #0)",
        "routed by the gateway",
        "draining",
        "draining (2 in flight)",
        "draining (1 in flight)",
        "draining (0 in flight)",
        "drained and stopped; replaced by #1",
    ]
    assert world.phases == {"m#1": Phase.done, "m#0": Phase.done}  # the successor routed, the old one stopped


def test_a_replica_a_drain_stops_is_taken_out_of_rotation_and_drained_first(world: World) -> None:
    """``llmgw drain`` of a replica with nowhere to go (``Executor.retire``): the same steps
    as the old half of a surge, the lock held for the marker and the stop only."""
    world.started.add(("m", world.address("a", 8100)))
    world.units[world.address("a", 8100)] = "llmgw-m-0.service"
    world.routed.add(("m", world.address("a", 8100)))
    world.in_flight[("a", 8100)] = [1, 0]
    stop = Action(
        op="-",
        model="m",
        replica=0,
        nodes=("a",),
        reason="drain a: fits on no other node",
        remove=(("a", "llmgw-m-0.service"),),
        port=8100,
    )

    class Take:
        async def take(self, spec: Any, conns: Any, why: str) -> Hold:
            world.locked = True
            world.event("lock")
            return Hold(world)

    async def scenario() -> list[Outcome]:
        opener = lambda spec, node, base, access: Host(node.name, world)  # noqa: E731
        async with Connections(world.spec, Path(), opener=opener) as conns:
            made = rollout.apply_executor(
                world.spec,
                conns,
                world.report,
                take_lock=Take(),
                engine_keys=None,
                fetch=False,
                gateways=None,
            )
            return await made.retire(stop)

    outcomes = asyncio.run(scenario())
    assert world.events == [
        "lock",
        "marker a",
        "unlock",
        "probe now",
        "count a:8100=1",
        "count a:8100=0",
        "lock",
        "stop m#0",
        "unlock",
    ]
    assert outcomes[-1] == Outcome("m#0", True, "drained and stopped")
    assert ("m", world.address("a", 8100)) not in world.routed


def test_the_node_helper_marks_the_old_replica_for_the_drain_bound(world: World) -> None:
    """The helper writes the marker with the node's own clock (tests/unit/test_node_helper.py);
    apply asks it for the model's drain bound, on each member node of the old replica."""
    action = replaced(world, "m", 0, "a", 8100, new=1, new_port=8102)
    rolled(world, [action])
    assert world.asked_to_mark == [("a", "llmgw-m-0.service", "1.000")]


def test_in_place_drains_first_then_stops_and_starts_in_one_hold(world: World) -> None:
    action = replaced(world, "m", 0, "a", 8100, new=0, new_port=8100, surge=False)
    world.in_flight[("a", 8100)] = [1, 0]
    outcomes = rolled(world, [action])
    assert world.events == [
        "lock",
        "marker a",
        "unlock",
        "probe now",
        "count a:8100=1",
        "count a:8100=0",
        "lock",
        "stop and start m#0",
        "unlock",
        "ready m#0",
        "probe now",  # routed within a second, not at the gateway's next round
    ]
    assert Outcome("m#0", True, "drained and stopped; replaced in place") in outcomes
    assert ("m", world.address("a", 8100)) in world.routed
    assert ("m#0", "routed by the gateway") in world.said


def test_requests_still_open_at_the_drain_bound_are_counted_as_cut(world: World) -> None:
    action = replaced(world, "m", 0, "a", 8100, new=1, new_port=8102)
    world.in_flight[("a", 8100)] = [3, 2]  # never falls to 0 within the bound (1s)
    outcomes = rolled(world, [action])
    text = "stopped at the drain bound (1s) with 2 requests in flight: cut; replaced by #1"
    assert outcomes[-1] == Outcome("m#0", True, text)
    assert world.said.count(("m#0", text)) == 1  # said once: apply prints each report line
    assert "stop m#0" in world.events
    assert executor.cut_text(30, 1) == "stopped at the drain bound (30s) with 1 request in flight: cut"


def test_a_successor_that_never_gets_ready_leaves_the_old_one_serving(world: World) -> None:
    action = replaced(world, "m", 0, "a", 8100, new=1, new_port=8102)
    world.ready_fails.add("m#1")
    outcomes = rolled(world, [action])
    assert world.events == ["lock", "start m#1", "unlock", "ready m#1"]
    assert world.markers == {}
    assert outcomes[-1].subject == "m#0" and not outcomes[-1].ok
    assert "its successor did not start" in outcomes[-1].message


def test_a_model_replaces_one_at_a_time_and_models_at_once(world: World) -> None:
    first = replaced(world, "m", 0, "a", 8100, new=2, new_port=8104)
    second = replaced(world, "m", 1, "b", 8100, new=3, new_port=8102)
    other = replaced(world, "n", 0, "b", 8110, new=1, new_port=8112)
    rolled(world, [first, second, other])
    ev = world.events
    # m#1 is replaced only once m#0 is stopped
    assert ev.index("stop m#0") < ev.index("start m#3")
    # n's replacement does not wait for m's: it starts before m's first one is done
    assert ev.index("start n#1") < ev.index("stop m#0")
    # the lock is never held by two steps at once (Hold checks) and every step let it go
    assert ev.count("lock") == ev.count("unlock") == 9


def test_without_a_routing_view_it_says_so_once_and_goes_by_health_checks(world: World) -> None:
    world.gateway = False
    first = replaced(world, "m", 0, "a", 8100, new=2, new_port=8104)
    second = replaced(world, "m", 1, "b", 8100, new=3, new_port=8102)
    outcomes = rolled(world, [first, second])
    said = [m for who, m in world.said if who == "gateway"]
    assert said == ["no gateway's routing view on gw.example; going by health checks only"]
    assert "probe now" not in world.events
    assert [o for o in outcomes if o.subject in ("m#0", "m#1")] == [
        Outcome("m#0", True, "drained and stopped; replaced by #2"),
        Outcome("m#1", True, "drained and stopped; replaced by #3"),
    ]


def test_no_lock_means_none_is_taken(world: World) -> None:
    action = replaced(world, "m", 0, "a", 8100, new=1, new_port=8102)
    world.lock_in_use = False
    outcomes = rolled(world, [action], lock=False)
    assert "lock" not in world.events and outcomes[-1] == Outcome(
        "m#0", True, "drained and stopped; replaced by #1"
    )


def test_views_of_dead_or_foreign_processes_are_left_out() -> None:
    text = routes_text(Routes(pid=7, written=1.0, ready={"m": frozenset({"10.0.0.1:8100"})}))
    good = base64.b64encode(text.encode()).decode()
    views = rollout.parse_views(f"7 {good}\n8 {good}\n9 !!!\n")
    assert [v.pid for v in views] == [7]  # 8: the file names another process; 9: not base64
    script = rollout._views_script("/var/lib/llmgw/gateway/routes")
    assert "kill -0" in script and "/proc/$p/cmdline" in script


def test_a_start_that_takes_what_a_replacement_frees_waits_for_it() -> None:
    spec = parse_cluster(CLUSTER)
    fresh: dict[str, NodeFacts] = {"a": node_facts("a"), "b": node_facts("b")}
    start = make_plan(spec, fresh)
    running = with_units(fresh, [(u.node, u.name, u.text) for a in start.changes for u in a.write])
    old = next(a for a in start.changes if a.model == "n")
    cards = old.gpus
    roll = Action(
        op="~",
        model="n",
        replica=1,
        nodes=old.nodes,
        reason="spec changed",
        port=(old.port or 0) + 2,
        retire=Retired(replica=0, nodes=old.nodes, unit=old.write[0].name, port=old.port or 0),
        surge=True,
    )
    on_freed = Action(
        op="+", model="m", replica=5, nodes=old.nodes, reason="below min", gpus=cards, port=8150
    )
    elsewhere = Action(
        op="+",
        model="m",
        replica=6,
        nodes=old.nodes,
        reason="below min",
        gpus={old.nodes[0]: ("GPU-x",)},
        port=8160,
    )
    on_port = Action(op="+", model="m", replica=7, nodes=old.nodes, reason="below min", port=old.port)
    assert rollout.rolling(running, [roll, on_freed, elsewhere, on_port]) == [roll]
    assert rollout.after_rolls(running, [roll], [roll, on_freed, elsewhere, on_port]) == [1, 3]
    # a replica that serves nothing is replaced as any action is: nothing waits for it
    down = with_units(running, [(u.node, u.name, u.text) for u in old.write], state="failed")
    assert rollout.rolling(down, [roll]) == []
    assert rollout.after_rolls(down, [], [roll, on_freed]) == []


def test_every_event_of_a_replacement_is_the_executors(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    """apply's rolling steps say nothing of their own: each line the report gets (the
    routing views' and the drain counts' included) is an event of the one executor."""
    world.gateway = False  # so the "no routing view" line is said too
    action = replaced(world, "m", 0, "a", 8100, new=1, new_port=8102)
    world.in_flight[("a", 8100)] = [1, 0]
    with caplog.at_level(logging.INFO, logger="llmgw.executor"):
        rolled(world, [action])
    events = [
        (r.getMessage(), getattr(r, "source", None)) for r in caplog.records if r.name == "llmgw.executor"
    ]
    assert ("gateway", "no gateway's routing view on gw.example; going by health checks only") in world.said
    assert events == [(f"{who}: {message}", "executor") for who, message in world.said]
