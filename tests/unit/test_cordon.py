"""Cordoned nodes in the pure core: placement passes them by (apply's plan, the gateway's
starts), the replicas there are kept, and draining a node plans successor-first moves,
stops what fits nowhere else and refuses when a model would have no serving replica."""

from __future__ import annotations

import pytest

from llmgw_cli.cli.drain_steps import _refuse
from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.observe.facts import NodeFacts
from llmgw_cli.core.planning.cordon import (
    Cordon,
    all_cordons,
    clean_reason,
    cordoned_nodes,
    drain_plan,
    unknown_node,
)
from llmgw_cli.core.planning.plan import grow_plan, make_plan, running_replicas
from llmgw_cli.errors import DowntimeRefused, SpecError

from .facts_factory import node_facts, with_units

CLUSTER = """\
cluster: {{name: t}}
nodes:
  - {{name: node01, address: 10.0.0.1}}
  - {{name: node02, address: 10.0.0.2{extra}}}
  - {{name: node03, address: 10.0.0.3}}
profiles:
  vllm: {{engine: vllm, ports: 8100-8199}}
gateway: {{host: gw.example}}
models:
  - {{name: m, source: org/m, fetch: engine, profile: vllm, tensor_parallel: {tp}, scaling: {{min: {min}, max: 4}}}}
  - {{name: od, source: org/od, fetch: engine, profile: vllm, scaling: {{min: 0, max: 2}}}}
"""


def spec(*, tp: int = 1, min: int = 1, extra: str = "") -> ClusterSpec:
    return parse_cluster(CLUSTER.format(tp=tp, min=min, extra=extra))


def nodes(cards: dict[str, int]) -> dict[str, NodeFacts]:
    return {name: node_facts(name, gpus=n) for name, n in cards.items()}


def run(
    s: ClusterSpec, facts: dict[str, NodeFacts], cordoned: frozenset[str] = frozenset()
) -> dict[str, NodeFacts]:
    """``facts`` once what ``make_plan`` starts runs."""
    plan = make_plan(s, facts, cordoned=cordoned)
    return with_units(facts, [(w.node, w.name, w.text) for a in plan.changes for w in a.write])


def where(facts: dict[str, NodeFacts], model: str = "m") -> list[tuple[str, ...]]:
    return sorted(r.members for r in running_replicas(facts) if r.model == model)


# --- placement ----------------------------------------------------------------------------


def test_apply_places_nothing_on_a_cordoned_node_and_keeps_what_runs_there() -> None:
    s = spec()
    facts = nodes({"node01": 8, "node02": 2, "node03": 2})
    plan = make_plan(s, facts, cordoned=frozenset({"node02", "node03"}))
    (start,) = plan.changes
    assert start.nodes == ("node01",)
    placed = make_plan(s, facts, cordoned=frozenset({"node01", "node03"}))
    assert [a.nodes for a in placed.changes] == [("node02",)]
    # ... and a replica already on a cordoned node stays, unchanged: no new one is made
    running = run(s, facts, frozenset({"node01", "node03"}))
    again = make_plan(s, running, cordoned=frozenset({"node02"}))
    assert not again.changes and [a.op for a in again.actions] == ["="]


def test_a_model_that_fits_only_on_cordoned_nodes_says_so() -> None:
    s = spec()
    plan = make_plan(
        s, nodes({"node01": 2, "node02": 2, "node03": 2}), cordoned=frozenset({"node01", "node02", "node03"})
    )
    assert not plan.changes
    ((model, why),) = plan.unplaced
    assert model == "m" and why.endswith("the most any node has is 0; cordoned: node01, node02, node03"), why


def test_the_gateways_starts_skip_cordoned_nodes() -> None:
    s = spec()
    facts = nodes({"node01": 2, "node02": 2, "node03": 2})
    free = grow_plan(s, facts, "od")
    assert free.changes[0].nodes == ("node01",)
    cordoned = grow_plan(s, facts, "od", cordoned=frozenset({"node01", "node02"}))
    assert [a.nodes for a in cordoned.changes] == [("node03",)]
    # shunned nodes are a preference; cordoned ones are not used even as a last resort
    shunned = grow_plan(s, facts, "od", shun=frozenset({"node03"}), cordoned=frozenset({"node01", "node02"}))
    assert [a.nodes for a in shunned.changes] == [("node03",)]
    none = grow_plan(s, facts, "od", cordoned=frozenset({"node01", "node02", "node03"}))
    assert not none.changes and "cordoned: node01, node02, node03" in none.unplaced[0][1]


def test_a_multi_card_replacement_does_not_prefer_its_cordoned_node() -> None:
    s = spec(tp=2)
    facts = run(s, nodes({"node01": 4, "node02": 0, "node03": 4}), frozenset({"node03"}))
    assert where(facts) == [("node01",)]
    plan = make_plan(s, facts, replace=frozenset({("m", 0)}), cordoned=frozenset({"node01"}))
    (roll,) = plan.changes
    # its own node comes first for a successor, unless it is cordoned
    assert roll.op == "~" and roll.surge and roll.nodes == ("node03",), roll
    kept = make_plan(s, facts, replace=frozenset({("m", 0)}))
    assert [a.nodes for a in kept.changes] == [("node01",)]


# --- the cluster file's cordons and the store's -------------------------------------------


def test_cordons_of_the_file_and_of_the_store_add_up() -> None:
    s = spec(extra=", cordoned: true, cordon_reason: PSU swap")
    stored = [Cordon("node03", "fans", "ops@desk", 5.0, draining=True)]
    assert cordoned_nodes(s, stored) == {"node02", "node03"}
    assert [(c.node, c.reason, c.source) for c in all_cordons(s, stored)] == [
        ("node02", "PSU swap", "file"),
        ("node03", "fans", "store"),
    ]


def test_a_cordon_reason_is_one_printable_line() -> None:
    with pytest.raises(SpecError):
        spec(extra=', cordoned: true, cordon_reason: "a\\x1b[2Jb"')
    assert clean_reason("  disk swap ") == "disk swap"
    for bad in ("two\nlines", "\x1b[31mred", "x" * 201):
        with pytest.raises(ValueError):
            clean_reason(bad)


def test_an_unknown_node_is_named_with_the_nodes_there_are() -> None:
    assert unknown_node(spec(), "node01") is None
    assert unknown_node(spec(), "node9") == (
        "no node named 'node9' in the cluster file; its nodes: node01, node02, node03"
    )


# --- drain ------------------------------------------------------------------------------


def test_drain_moves_each_replica_successor_first_to_another_node() -> None:
    s = spec(min=2)
    facts = run(s, nodes({"node01": 2, "node02": 0, "node03": 4}), frozenset({"node03"}))
    assert where(facts) == [("node01",), ("node01",)]
    planned = drain_plan(s, facts, "node01")
    assert not planned.refusals
    assert [
        (a.op, a.surge, a.nodes, a.retire.replica if a.retire else None) for a in planned.plan.actions
    ] == [
        ("~", True, ("node03",), 0),
        ("~", True, ("node03",), 1),
    ]
    assert [(m.replica, m.nodes, m.to) for m in planned.moves] == [
        (0, ("node01",), ("node03",)),
        (1, ("node01",), ("node03",)),
    ]
    assert all(a.reason.startswith("drain node01; ") for a in planned.plan.actions)
    # what the CLI prints, and --json
    assert planned.as_dict()["moves"][0] == {
        "model": "m",
        "replica": 0,
        "from": ["node01"],
        "to": ["node03"],
        "successor": 2,
        "reason": "drain node01: successor first",
    }


def test_drain_refuses_when_a_model_would_have_no_serving_replica() -> None:
    s = spec(tp=2)
    facts = run(s, nodes({"node01": 2, "node02": 2, "node03": 1}), frozenset({"node02", "node03"}))
    assert where(facts) == [("node01",)]
    # node02 could take it, but it is cordoned too; node03 has one card for two
    planned = drain_plan(s, facts, "node01", frozenset({"node02"}))
    ((op, nodes_),) = [(a.op, a.nodes) for a in planned.plan.actions]
    assert (op, nodes_) == ("-", ("node01",))
    (refusal,) = planned.refusals
    assert refusal.startswith("m would have no serving replica: replica 0 fits on no other node (m needs 2")
    assert "cordoned: node01, node02" in refusal
    with pytest.raises(
        DowntimeRefused, match=r"draining node01: m would have no serving replica.*--allow-downtime"
    ):
        _refuse(planned, allowed=False)
    _refuse(planned, allowed=True)  # --allow-downtime: the replica is stopped
    # once node02 is back, the same drain moves it there without a refusal
    back = drain_plan(s, facts, "node01")
    assert not back.refusals and [a.nodes for a in back.plan.changes] == [("node02",)]


def test_drain_stops_a_replica_that_fits_nowhere_while_another_serves() -> None:
    s = spec(min=2)
    facts = run(s, nodes({"node01": 1, "node02": 1, "node03": 0}))
    assert where(facts) == [("node01",), ("node02",)]
    planned = drain_plan(s, facts, "node01")
    assert not planned.refusals
    ((op, reason),) = [(a.op, a.reason) for a in planned.plan.actions]
    assert op == "-" and "fits on no other node" in reason and "1 other replica(s) serve" in reason


def test_drain_of_an_empty_node_and_of_a_switched_off_model() -> None:
    s = spec()
    facts = run(s, nodes({"node01": 1, "node02": 1, "node03": 1}))
    (here,) = where(facts)
    empty = next(n for n in ("node01", "node02", "node03") if (n,) != here)
    assert drain_plan(s, facts, empty).plan.actions == ()
    off = parse_cluster(
        CLUSTER.format(tp=1, min=1, extra="").replace(
            "scaling: {min: 1, max: 4}", "scaling: {min: 0, max: 0}"
        )
    )
    planned = drain_plan(off, facts, here[0])
    ((op, reason),) = [(a.op, a.reason) for a in planned.plan.actions]
    assert op == "-" and reason == f"drain {here[0]}: model is switched off" and not planned.refusals
