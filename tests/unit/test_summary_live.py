"""The Summary with the gateway's view: model states, idle replicas, usage by key, and
NVLink peers where unknown topology is not zero."""

from __future__ import annotations

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.observe.unit_state import UnitState
from llmgw_cli.core.views.summary import IDLE_AFTER, Live, LiveReplica, UseRow, summarize
from tests.unit.facts_factory import node_facts, topology, with_units

SPEC = parse_cluster(
    """\
cluster: {name: t}
fabrics: {ib: {kind: infiniband}}
nodes:
  - {name: a, address: 10.0.0.1, fabric: ib}
  - {name: b, address: 10.0.0.2, fabric: ib}
  - {name: c, address: 10.0.0.3}
profiles: {vllm: {engine: vllm}}
models:
  - {name: always, source: org/a, profile: vllm, scaling: {min: 1, max: 2}}
  - {name: lazy, source: org/b, profile: vllm, scaling: {min: 0, max: 1, idle_timeout: 5m}}
  - {name: starting, source: org/c, profile: vllm, scaling: {min: 1, max: 1}}
  - {name: gone, source: org/d, profile: vllm, scaling: {min: 1, max: 1}}
  - {name: dark, source: org/e, profile: vllm}
"""
)


def replica(
    model: str, address: str, health: str = "ready", idle: float | None = 0.0, busy: int = 0
) -> LiveReplica:
    return LiveReplica(model=model, address=address, health=health, in_flight=busy, idle_seconds=idle)


def test_without_the_gateway_the_live_parts_stay_empty() -> None:
    s = summarize(SPEC, {"a": node_facts("a")})
    assert s.replicas == () and s.keys == ()
    assert all(m.state is None and m.ready is None for m in s.models)


def test_model_states_are_the_controllers_phases_with_ready_counts() -> None:
    """The state is the model controller's phase as the gateway passes it (one owner);
    the ready count is the pool's."""
    live = Live(
        replicas=(
            replica("always", "10.0.0.1:8000"),
            replica("always", "10.0.0.2:8000", health="failing", idle=None),
            replica("starting", "10.0.0.1:8001", health="loading", idle=None),
        ),
        phases={
            "always": "degraded",
            "lazy": "failed",
            "starting": "starting",
            "gone": "stopped",
            "dark": "off",
        },
        progress={"starting": "engine loading"},
    )
    s = summarize(SPEC, {}, live)
    states = {m.name: (m.state, m.ready) for m in s.models}
    assert {m.name: m.progress for m in s.models if m.progress} == {"starting": "engine loading"}
    assert states == {
        "always": ("degraded", 1),
        "lazy": ("failed", 0),
        "starting": ("starting", 0),
        "gone": ("stopped", 0),
        "dark": ("off", 0),
    }


def test_idle_uses_the_models_idle_timeout_else_idle_after() -> None:
    live = Live(
        replicas=(
            replica("lazy", "h:1", idle=301.0),  # idle_timeout 5m: idle
            replica("lazy", "h:2", idle=299.0),  # not yet
            replica("lazy", "h:3", idle=900.0, busy=1),  # a request in flight is use
            replica("always", "h:4", idle=IDLE_AFTER),  # no idle_timeout: IDLE_AFTER
            replica("always", "h:5", idle=IDLE_AFTER - 1),
            replica("always", "h:6", health="loading", idle=None),  # unknown is not idle
        )
    )
    idle = {r.address: r.idle for r in summarize(SPEC, {}, live).replicas}
    assert idle == {"h:1": True, "h:2": False, "h:3": False, "h:4": True, "h:5": False, "h:6": False}


def test_usage_by_key_over_the_hour_and_the_day() -> None:
    live = Live(
        usage=(
            UseRow(window="hour", key="alice", model="always", requests=2, tokens=30),
            UseRow(window="hour", key="alice", model="lazy", requests=1, tokens=5),
            UseRow(window="day", key="alice", model="always", requests=10, tokens=300),
            UseRow(window="day", key="alice", model="lazy", requests=1, tokens=5),
            UseRow(window="day", key="bob", model="always", requests=4, tokens=40),
        )
    )
    keys = {k.key: k for k in summarize(SPEC, {}, live).keys}
    alice, bob = keys["alice"], keys["bob"]
    assert (alice.requests_hour, alice.tokens_hour, alice.requests_day, alice.tokens_day) == (3, 35, 11, 305)
    assert alice.models == ("always", "lazy")
    assert (bob.requests_hour, bob.tokens_hour, bob.requests_day, bob.tokens_day) == (0, 0, 4, 40)


def test_nvlink_peers_unknown_is_not_zero() -> None:
    facts = {
        "a": node_facts("a"),  # NVSwitch: every card reaches 7 others
        "b": node_facts("b", topo="pairs"),  # bridged pairs: 1 peer
        "c": node_facts("c", topo=None),  # topo -m could not be read
    }
    nodes = {n.name: n for n in summarize(SPEC, facts).nodes}
    assert (nodes["a"].nvlink_peers, nodes["a"].topology) == (7, "NVLink (7 peers)")
    assert nodes["b"].nvlink_peers == 1
    assert (nodes["c"].nvlink_peers, nodes["c"].topology) == (None, "unknown")
    pcie = summarize(SPEC, {"a": node_facts("a", topo=topology(8, "PHB"))}).nodes[0]
    assert (pcie.nvlink_peers, pcie.topology) == (0, "PCIe only")


def test_a_young_replica_counts_as_running_once_the_gateway_saw_it_ready() -> None:
    """The probe alone calls a replica younger than its start timeout starting; the
    gateway's health check says whether it is ready (core/observe/health.py)."""
    shown = UnitState(
        name="",
        load_state="loaded",
        active_state="active",
        sub_state="running",
        result="success",
        main_pid=7,
        n_restarts=0,
        exec_main_code=0,
        exec_main_status=0,
        age=5.0,
    )
    labels = "X-Llmgw-Model=always\nX-Llmgw-Replica=0\nX-Llmgw-Members=a\nX-Llmgw-Port=8000\n"
    facts = with_units({"a": node_facts("a")}, [("a", "llmgw-always-0.service", labels)], shown=shown)

    def row(live: Live | None) -> tuple[int, dict[str, int]]:
        (m,) = [m for m in summarize(SPEC, facts, live).models if m.name == "always"]
        return m.running, m.not_ready

    assert row(None) == (0, {"starting": 1})
    loading = replica("always", "10.0.0.1:8000", health="loading", idle=None)
    assert row(Live(replicas=(loading,))) == (0, {"starting": 1})
    assert row(Live(replicas=(replica("always", "10.0.0.1:8000"),))) == (1, {})
