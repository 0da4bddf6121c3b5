"""apply under the cluster lock (``cli/apply_steps.py`` ``_locked``), with the lock and the probe
replaced: it probes again under the lock, goes on with its plan when the nodes did not
change, plans again (and asks again, or goes on with --yes) when they did, never holds
the lock while it asks, and says what to do when the lock cannot be taken."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import typer
from rich.console import Console

from llmgw_cli.cli import apply_steps as apply_cli
from llmgw_cli.cli.host_steps import with_rotation
from llmgw_cli.cli.session import Session
from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.observe.facts import NodeFacts
from llmgw_cli.core.planning.plan import Plan, grow_plan, make_plan
from llmgw_cli.core.planning.steps import GatewayState, HostFacts
from llmgw_cli.core.planning.whole_plan import whole
from llmgw_cli.errors import ApplyFailed, InputError, LockTimeout, NodeError
from llmgw_cli.remote import apply_host, rollout
from llmgw_cli.remote.connect import Connections
from llmgw_cli.remote.execute import Outcome
from llmgw_cli.remote.gateway_install import GatewayPreviews
from llmgw_cli.remote.probe import Snapshot

from .facts_factory import node_facts, with_units

CLUSTER = """\
cluster: {name: t}
fabrics: {ib: {kind: infiniband}}
nodes:
  - {name: a, address: 10.0.0.1, fabric: ib, hcas: [mlx5_0]}
profiles:
  vllm: {engine: vllm, ports: 8100-8199}
gateway: {host: gw.example}
models:
  - {name: steady, source: org/steady, fetch: engine, profile: vllm, scaling: {min: 1, max: 1}}
  - {name: lazy, source: org/lazy, fetch: engine, profile: vllm, scaling: {min: 0, max: 1, idle_timeout: 5m}}
"""


@dataclass
class FakeHold:
    released: int = 0

    async def release(self) -> None:
        self.released += 1


@dataclass
class World:
    """What the replaced lock and probe saw and did."""

    probes: list[dict[str, NodeFacts]]  # what each probe under the lock finds, in turn
    holds: list[FakeHold] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)
    fails: Exception | None = None
    asked: int = 0
    out: io.StringIO = field(default_factory=io.StringIO)


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    w = World(probes=[])

    async def take(spec: ClusterSpec, conns: Any, *, wait: float, why: str, on_wait: Any) -> FakeHold:
        if w.fails is not None:
            raise w.fails
        w.waits.append(wait)
        w.holds.append(FakeHold())
        return w.holds[-1]

    def probe(spec: ClusterSpec, file: Path, nodes: Any, console: Any, session: Any) -> Snapshot:
        facts = w.probes.pop(0)
        return Snapshot(tuple(facts.values()), 0.0)

    def confirm(text: str, abort: bool, **_: object) -> bool:
        assert all(h.released for h in w.holds), "asked while holding the lock"
        w.asked += 1
        return True

    console = Console(file=w.out, width=200, color_system=None)
    monkeypatch.setattr(apply_cli, "take_for_apply", take)
    monkeypatch.setattr(apply_cli, "probe_with_progress", probe)
    monkeypatch.setattr(typer, "confirm", confirm)
    monkeypatch.setattr(apply_cli, "out", console)
    monkeypatch.setattr(apply_cli, "err", console)
    yield w


def fresh() -> dict[str, NodeFacts]:
    return {"a": node_facts("a")}


def with_lazy_started(spec: ClusterSpec) -> dict[str, NodeFacts]:
    """The nodes once the gateway started `lazy` on the card a fresh plan gives `steady`."""
    start = grow_plan(spec, fresh(), "lazy")
    return with_units(fresh(), [(w.node, w.name, w.text) for a in start.changes for w in a.write])


def locked(spec: ClusterSpec, chosen: Plan, tmp_path: Path, **options: Any) -> tuple[Plan, FakeHold]:
    with Session(spec, tmp_path) as session:
        how = apply_cli.Replan(**{"yes": True, **options})
        plan, _, hold = apply_cli._locked(spec, tmp_path / "cluster.yaml", session, chosen, how)
    assert isinstance(hold, FakeHold)
    return plan, hold


def cards(plan: Plan, model: str) -> set[str]:
    return {g for a in plan.changes if a.model == model for gs in a.gpus.values() for g in gs}


def test_unchanged_nodes_keep_the_plan_and_the_lock(world: World, tmp_path: Path) -> None:
    spec = parse_cluster(CLUSTER)
    chosen = make_plan(spec, fresh())
    world.probes = [fresh()]
    plan, hold = locked(spec, chosen, tmp_path)
    assert plan is chosen
    assert hold.released == 0 and world.waits == [600.0]
    assert world.asked == 0
    assert "changed" not in world.out.getvalue()


def test_with_yes_a_plan_gone_stale_is_made_again_and_applied(world: World, tmp_path: Path) -> None:
    spec = parse_cluster(CLUSTER)
    chosen = make_plan(spec, fresh())
    lazy = with_lazy_started(spec)
    taken = {g for a in grow_plan(spec, fresh(), "lazy").changes for gs in a.gpus.values() for g in gs}
    assert cards(chosen, "steady") == taken  # the stale plan would put steady on lazy's card
    world.probes = [lazy]
    plan, hold = locked(spec, chosen, tmp_path)
    assert plan.facts_digest != chosen.facts_digest
    assert cards(plan, "steady") and not cards(plan, "steady") & taken
    assert hold.released == 0  # goes on under the lock it holds
    assert world.asked == 0
    assert "The nodes changed since the plan above was made; the plan now:" in world.out.getvalue()


def test_a_plan_made_again_under_the_lock_keeps_the_host_steps(world: World, tmp_path: Path) -> None:
    """The lock guards the replicas: what was gathered of helpers, keys and gateway hosts
    holds still, so the plan made again carries those steps (and its own weights steps),
    and the executor carries them out."""
    spec = parse_cluster(CLUSTER)
    host = HostFacts(
        stale_helper=("a",),
        keyless=("a",),
        gateways=(GatewayState(host="gw.example", how="restart", files=(("cluster.yaml", "d1"),)),),
    )
    chosen = whole(spec, make_plan(spec, fresh()), fresh(), host)
    world.probes = [with_lazy_started(spec)]
    plan, _ = locked(spec, chosen, tmp_path)
    assert plan.facts_digest != chosen.facts_digest
    kinds = [(s.kind, s.target, s.action) for s in plan.steps if s.kind != "weights"]
    assert kinds == [
        ("node_helper", "a", "update"),
        ("engine_key", "a", "write"),
        ("gateway", "gw.example", "restart"),
    ]


def test_without_yes_it_lets_go_asks_again_and_checks_again(world: World, tmp_path: Path) -> None:
    spec = parse_cluster(CLUSTER)
    chosen = make_plan(spec, fresh())
    lazy = with_lazy_started(spec)
    world.probes = [lazy, lazy]  # asked again, the nodes as the new plan saw them
    plan, hold = locked(spec, chosen, tmp_path, yes=False)
    assert world.asked == 1  # `confirm` checks that no lock was held while it asked
    assert [h.released for h in world.holds] == [1, 0]  # the second hold goes on
    assert hold is world.holds[1]
    assert plan.facts_digest == make_plan(spec, lazy).facts_digest


def test_a_saved_plan_gone_stale_is_refused_and_the_lock_let_go(world: World, tmp_path: Path) -> None:
    spec = parse_cluster(CLUSTER)
    chosen = make_plan(spec, fresh())
    world.probes = [with_lazy_started(spec)]
    with pytest.raises(InputError, match="the nodes changed since this plan was made"):
        locked(spec, chosen, tmp_path, saved=tmp_path / "plan.json")
    assert [h.released for h in world.holds] == [1]


def test_a_gateway_host_out_of_reach_is_refused_with_the_way_out(world: World, tmp_path: Path) -> None:
    spec = parse_cluster(CLUSTER)
    world.fails = NodeError("gateway", "unreachable", "cannot connect to gw.example: refused")
    with pytest.raises(ApplyFailed) as refused:
        locked(spec, make_plan(spec, fresh()), tmp_path)
    said = str(refused.value)
    assert "cannot take the cluster lock on the gateway host gw.example" in said
    assert "cannot connect to gw.example: refused" in said and "--no-lock" in said


def test_a_lock_held_too_long_changes_nothing(world: World, tmp_path: Path) -> None:
    spec = parse_cluster(CLUSTER)
    world.fails = LockTimeout("the cluster lock on gw.example was still held after 600s")
    with pytest.raises(ApplyFailed, match="still held after 600s; nothing was changed"):
        locked(spec, make_plan(spec, fresh()), tmp_path)


def test_weights_come_before_the_lock_and_count_only_for_the_plan_they_were_for(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = parse_cluster(CLUSTER)
    chosen = make_plan(spec, fresh())
    fetched_for: list[Plan] = []

    async def ensure_for_plan(spec: ClusterSpec, plan: Plan, conns: Any, report: Any) -> dict[str, str]:
        assert all(h.released for h in world.holds), "weights brought under the lock"
        fetched_for.append(plan)
        return {"a": "weights of steady: 404"}

    monkeypatch.setattr(apply_cli, "ensure_for_plan", ensure_for_plan)
    world.probes = [fresh(), with_lazy_started(spec)]
    with Session(spec, tmp_path) as session:
        how = apply_cli.Replan(yes=True)
        same = apply_cli._fetch_and_lock(spec, tmp_path / "c.yaml", session, chosen, how)
        session.run(same[2].release())
        other = apply_cli._fetch_and_lock(spec, tmp_path / "c.yaml", session, chosen, how)
    assert fetched_for == [chosen, chosen]
    assert same[0] is chosen and same[3] == {"a": "weights of steady: 404"}
    assert other[0] is not chosen and other[3] is None  # a new plan: the executor fetches


def test_units_go_only_where_the_weights_are_and_the_lock_goes_before_the_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = CLUSTER.replace(
        "  - {name: a, address: 10.0.0.1, fabric: ib, hcas: [mlx5_0]}\n",
        "  - {name: a, address: 10.0.0.1, fabric: ib, hcas: [mlx5_0]}\n"
        "  - {name: b, address: 10.0.0.2, fabric: ib, hcas: [mlx5_0]}\n",
    ).replace("scaling: {min: 1, max: 1}", "scaling: {min: 2, max: 2}")
    spec = parse_cluster(text)
    chosen = make_plan(spec, {"a": node_facts("a"), "b": node_facts("b")})
    assert sorted(n for a in chosen.changes for n in a.nodes) == ["a", "b"]
    executed: list[tuple[Plan, bool]] = []
    hold = FakeHold()

    async def nothing(*args: Any, **kwargs: Any) -> list[Any]:
        return []

    async def keys(*args: Any, **kwargs: Any) -> tuple[dict[str, str], list[Any]]:
        return {}, []

    async def execute(spec: Any, conns: Any, plan: Plan, report: Any, **kwargs: Any) -> list[Outcome]:
        assert hold.released == 0
        executed.append((plan, kwargs["fetch"]))
        return [Outcome(n, True, "units in place") for a in plan.changes for n in a.nodes]

    async def wait_started(
        spec: Any, conns: Any, plan: Plan, done: list[Outcome], report: Any
    ) -> list[Outcome]:
        assert hold.released == 1, "waited for readiness under the lock"
        return []

    async def install(*args: Any) -> list[Outcome]:
        return [Outcome("gateway", True, "unchanged")]

    for name, fake in (
        ("prepare", nothing),
        ("distribute_engine_keys", keys),
        ("install", install),
    ):
        monkeypatch.setattr(apply_host, name, fake)
    monkeypatch.setattr(rollout, "execute", execute)
    monkeypatch.setattr(rollout, "wait_started", wait_started)
    monkeypatch.setattr(apply_cli, "err", Console(file=io.StringIO(), color_system=None))
    outcomes = asyncio.run(
        apply_cli._execute_with_progress(
            spec,
            Connections(spec, tmp_path),
            chosen,
            wait=True,
            gateway=GatewayPreviews(()),  # no gateway host
            unreachable=set(),
            facts={},
            lock=hold,  # type: ignore[arg-type]
            fetched={"b": "weights of steady: 404"},
        )
    )
    ((plan, fetch),) = executed
    assert fetch is False  # brought before the lock already
    assert [n for a in plan.changes for n in a.nodes] == ["a"]
    assert Outcome("b", False, "weights of steady: 404") in outcomes
    assert hold.released == 1


def test_apply_carries_out_the_whole_plan_through_the_one_executor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Node helpers, engine keys, the replicas, the gateway hosts, a key rotation: in that
    order, each given the steps of its kind, and what each says is an event of the
    executor (logged by it, with ``source="executor"``)."""
    spec = parse_cluster(CLUSTER)
    host = HostFacts(
        stale_helper=("a",),
        keyless=("a",),
        gateways=(GatewayState(host="gw.example", how="reload", files=(("cluster.yaml", "d1"),)),),
    )
    chosen = with_rotation(whole(spec, make_plan(spec, fresh()), fresh(), host), spec, fresh())
    done: list[tuple[str, object]] = []

    async def prepare(spec: Any, conns: Any, nodes: list[str], report: Any, facts: Any) -> list[Outcome]:
        done.append(("helpers", nodes))
        report("a", "node helper in place")
        return []

    async def keys(spec: Any, transports: list[Any], report: Any) -> tuple[dict[str, str], list[Outcome]]:
        done.append(("keys", [t.node for t in transports]))
        report("a", "engine key written")
        return {"a": "k"}, []

    async def carry_out(spec: Any, conns: Any, plan: Plan, report: Any, **kw: Any) -> list[Outcome]:
        done.append(("replicas", [a.model for a in plan.changes]))
        assert kw["engine_keys"] == {"a": "k"}  # the key step ran before
        return []

    async def install(
        spec: Any, conns: Any, previews: GatewayPreviews, keys: Any, report: Any
    ) -> list[Outcome]:
        done.append(("gateways", keys))
        report("gateway", "files in place")
        return [Outcome("gateway", True, "ready")]

    async def rotate(spec: Any, conns: Any, facts: Any, give: Any, report: Any, **kw: Any) -> list[Outcome]:
        done.append(("rotate", sorted(kw["transports"])))
        return []

    for name, fake in (
        ("prepare", prepare),
        ("distribute_engine_keys", keys),
        ("carry_out", carry_out),
        ("install", install),
        ("rotate_engine_keys", rotate),
    ):
        monkeypatch.setattr(apply_host, name, fake)
    monkeypatch.setattr(apply_cli, "err", Console(file=io.StringIO(), color_system=None))
    with caplog.at_level("INFO", logger="llmgw.executor"):
        outcomes = asyncio.run(
            apply_cli._execute_with_progress(
                spec,
                Connections(spec, tmp_path),
                chosen,
                wait=True,
                gateway=GatewayPreviews(()),
                unreachable=set(),
                facts=fresh(),
            )
        )
    assert done == [
        ("helpers", ["a"]),
        ("keys", ["a"]),
        ("replicas", ["steady"]),
        ("gateways", {"a": ("k",)}),
        ("rotate", ["a"]),
    ]
    assert outcomes == [Outcome("gateway", True, "ready")]
    events = [(r.getMessage(), getattr(r, "source", None)) for r in caplog.records]
    assert events == [
        ("a: node helper in place", "executor"),
        ("a: engine key written", "executor"),
        ("gateway: files in place", "executor"),
    ]
