"""The plan: desired vs actual, as a value (pure; the lab tests run it for real)."""

from __future__ import annotations

from llmgw_cli.core.facts import NodeFacts
from llmgw_cli.core.load import parse_cluster
from llmgw_cli.core.plan import Action, Plan, conflicts, grow_plan, make_plan, running_replicas, stop_plan
from llmgw_cli.core.spec import ClusterSpec
from llmgw_cli.core.summary import summarize

from .facts_factory import node_facts, with_units

CLUSTER = """\
cluster: {name: t}
fabrics: {ib: {kind: infiniband}}
nodes:
  - {name: a, address: 10.0.0.1, fabric: ib, hcas: [mlx5_0]}
  - {name: b, address: 10.0.0.2, fabric: ib, hcas: [mlx5_0]}
  - {name: c, address: 10.0.0.3, fabric: ib, hcas: [mlx5_0]}
profiles:
  vllm: {engine: vllm, ports: 8100-8199}
models:
  - {name: small, source: org/small, profile: vllm, scaling: {min: 2, max: 3}}
  - {name: mid, source: org/mid, profile: vllm, tensor_parallel: 4, args: [--x], scaling: {min: 1, max: 1}}
  - {name: big, source: org/big, profile: vllm, tensor_parallel: 8, nodes: 2, scaling: {min: 1, max: 1}}
  - {name: lazy, source: org/lazy, profile: vllm, scaling: {min: 0, max: 1, idle_timeout: 5m}}
"""


def spec(text: str = CLUSTER) -> ClusterSpec:
    return parse_cluster(text)


def fresh() -> dict[str, NodeFacts]:
    return {n: node_facts(n) for n in "abc"}


def applied(plan: Plan, facts: dict[str, NodeFacts]) -> dict[str, NodeFacts]:
    out = dict(facts)
    for action in plan.actions:
        for node, name in action.remove:
            f = out[node]
            out[node] = f.model_copy(
                update={
                    "units": tuple(u for u in f.units if u.name != name),
                    "unit_labels": {k: v for k, v in f.unit_labels.items() if k != name},
                }
            )
        out = with_units(out, [(w.node, w.name, w.text) for w in action.write])
    return out


def ops(plan: Plan) -> list[tuple[str, str, int]]:
    return [(a.op, a.model, a.replica) for a in plan.actions]


def test_fresh_cluster_gets_min_replicas_of_always_on_models_only() -> None:
    plan = make_plan(spec(), fresh())
    assert ops(plan) == [("+", "big", 0), ("+", "mid", 0), ("+", "small", 0), ("+", "small", 1)]
    big = plan.actions[0]
    assert len(big.write) == 2  # one unit per node of the 2-node replica
    assert {w.node for w in big.write} == set(big.nodes)
    assert plan.unplaced == ()


def test_second_plan_changes_nothing() -> None:
    s = spec()
    facts = applied(make_plan(s, fresh()), fresh())
    again = make_plan(s, facts)
    assert again.changes == []
    assert {a.reason for a in again.actions} == {"unchanged"}
    assert len(again.actions) == 4


def test_changing_one_models_args_replaces_only_its_replica() -> None:
    facts = applied(make_plan(spec(), fresh()), fresh())
    changed = make_plan(spec(CLUSTER.replace("args: [--x]", "args: [--y]")), facts)
    assert [(a.op, a.model, a.reason) for a in changed.changes] == [("~", "mid", "spec changed")]
    (mid,) = changed.changes
    assert "--y" in mid.write[0].text
    assert mid.replica == 0  # the same unit name is rewritten in place


def test_removing_a_model_deletes_its_units() -> None:
    facts = applied(make_plan(spec(), fresh()), fresh())
    text = "".join(line for line in CLUSTER.splitlines(keepends=True) if "name: mid," not in line)
    plan = make_plan(spec(text), facts)
    (delete,) = plan.changes
    assert (delete.op, delete.model, delete.reason) == ("-", "mid", "model removed from the cluster file")
    assert delete.remove == ((delete.nodes[0], "llmgw-mid-0.service"),)


def test_switching_a_model_off_deletes_it() -> None:
    facts = applied(make_plan(spec(), fresh()), fresh())
    plan = make_plan(spec(CLUSTER.replace("scaling: {min: 2, max: 3}", "scaling: {min: 0, max: 0}")), facts)
    assert sorted((a.op, a.model, a.reason) for a in plan.changes) == [
        ("-", "small", "model is switched off"),
        ("-", "small", "model is switched off"),
    ]


def test_failed_or_stopped_replica_is_started_again() -> None:
    s = spec()
    plan = make_plan(s, fresh())
    facts = applied(plan, fresh())
    mid = next(a for a in plan.actions if a.model == "mid")
    for state in ("failed", "inactive"):
        down = with_units(facts, [(w.node, w.name, w.text) for w in mid.write], state=state)
        again = make_plan(s, down)
        assert [(a.op, a.model, a.reason) for a in again.changes] == [
            ("~", "mid", "not running; started again")
        ]


def test_on_demand_replica_is_left_to_the_gateway() -> None:
    s = spec()
    facts = applied(make_plan(s, fresh()), fresh())
    lazy_unit = make_plan(spec(CLUSTER.replace("min: 0, max: 1", "min: 1, max: 1")), facts)
    facts = applied(lazy_unit, facts)
    again = make_plan(s, facts)
    assert again.changes == []
    lazy = next(a for a in again.actions if a.model == "lazy")
    assert lazy.reason == "on demand: started and stopped by the gateway"


def test_ports_do_not_collide_on_a_node() -> None:
    facts = applied(make_plan(spec(), fresh()), fresh())
    for f in facts.values():
        held: list[int] = []
        for labels in f.unit_labels.values():
            port = int(labels["Port"])
            multi = "," in labels["Members"]
            held += [port, port + 1] if multi else [port]  # a multi-node head also listens on port + 1
        assert len(held) == len(set(held)), (f.node, held)
        assert all(8100 <= p <= 8199 for p in held)


def test_plan_round_trips_through_json() -> None:
    plan = make_plan(spec(), fresh())
    assert Plan.model_validate_json(plan.model_dump_json()) == plan


def test_facts_digest_changes_when_a_card_fails() -> None:
    s = spec()
    before = make_plan(s, fresh()).facts_digest
    facts = fresh()
    facts["a"] = node_facts("a", faulty=(2,))
    assert make_plan(s, facts).facts_digest != before


def test_grow_plan_starts_one_replica_and_changes_nothing_else() -> None:
    s = spec()
    facts = applied(make_plan(s, fresh()), fresh())
    # A changed spec of another model must not leak into an on-demand start.
    changed = spec(CLUSTER.replace("args: [--x]", "args: [--y]"))
    grow = grow_plan(changed, facts, "lazy")
    assert ops(grow) == [("+", "lazy", 0)] and grow.unplaced == ()
    (action,) = grow.actions
    held = {
        (node, uuid)
        for f in facts.values()
        for labels in f.unit_labels.values()
        for node in [f.node]
        for uuid in labels["Gpus"].split(",")
    }
    new = {
        (u.node, uuid)
        for u in action.write
        for uuid in u.text.split("X-Llmgw-Gpus=")[1].split()[0].split(",")
    }
    assert not held & new  # never a card another replica holds
    again = grow_plan(changed, applied(grow, facts), "lazy")
    assert ops(again) == [("+", "lazy", 1)]  # the index after the one taken


def test_grow_plan_explains_when_nothing_fits() -> None:
    s = spec(CLUSTER.replace("tensor_parallel: 4, args", "tensor_parallel: 8, args"))
    facts = applied(make_plan(s, fresh()), fresh())  # big takes 2 nodes, mid the third
    grow = grow_plan(s, facts, "mid")
    assert grow.actions == () and grow.unplaced and grow.unplaced[0][0] == "mid"


def test_stop_plan_removes_the_replica_on_every_member() -> None:
    s = spec()
    facts = applied(make_plan(s, fresh()), fresh())
    big = next(r for r in running_replicas(facts) if r.model == "big")
    stop = stop_plan(facts, "big", big.replica, "idle for 300s")
    (action,) = stop.actions
    assert action.op == "-" and action.reason == "idle for 300s"
    assert set(action.remove) == {(n, big.unit) for n in big.members} and len(big.members) == 2
    assert "big" not in {r.model for r in running_replicas(applied(stop, facts))}
    assert stop_plan(facts, "big", 7, "x").actions == ()


def test_plan_and_status_agree_on_a_half_failed_multi_node_replica() -> None:
    s = spec()
    plan = make_plan(s, fresh())
    facts = applied(plan, fresh())
    big = next(a for a in plan.actions if a.model == "big")
    assert len(big.nodes) == 2
    assert summarize(s, facts).models[2].running == 1
    # one member's unit fails, the other member's keeps running
    head, failed_node = big.nodes
    half = with_units(facts, [(w.node, w.name, w.text) for w in big.write if w.node == failed_node], "failed")
    (replica,) = [r for r in running_replicas(half) if r.model == "big"]
    assert replica.states == {head: "active", failed_node: "failed"}
    assert not replica.up
    # the gateway routes by the same units: a failed member takes the replica out of rotation,
    # a member on a node that could not be read this time does not
    (whole,) = [r for r in running_replicas(facts) if r.model == "big"]
    assert whole.serving() and not replica.serving()
    assert replica.serving(frozenset({failed_node})) is False  # seen failed, not unknown
    (unseen,) = [
        r for r in running_replicas({n: f for n, f in facts.items() if n != failed_node}) if r.model == "big"
    ]
    assert unseen.serving(frozenset({failed_node})) and not unseen.serving()
    assert [(a.op, a.model, a.reason) for a in make_plan(s, half).changes] == [
        ("~", "big", "not running; started again")
    ]
    summary = summarize(s, half)
    row = summary.models[2]
    assert (row.name, row.running, row.where) == ("big", 0, ())
    # the member that runs still holds its cards
    used = {n.name: n.used for n in summary.nodes}
    assert used[head] == 8 and used[failed_node] == 0


def _cards(action: Action) -> set[tuple[str, str]]:
    return {(node, uuid) for node, uuids in action.gpus.items() for uuid in uuids}


def test_grow_plan_keeps_off_the_cards_ports_and_numbers_of_reserved_starts() -> None:
    s = spec()
    facts = applied(make_plan(s, fresh()), fresh())
    (first,) = grow_plan(s, facts, "small").actions
    assert _cards(first) and first.gpus == {first.nodes[0]: first.gpus[first.nodes[0]]}
    # The first start's units are not on the nodes yet (its weights are being fetched):
    # a second start planned meanwhile must not take its cards, port or replica number.
    (second,) = grow_plan(s, facts, "small", reserved=[first]).actions
    assert not _cards(first) & _cards(second)
    assert second.replica != first.replica
    assert second.nodes[0] != first.nodes[0] or second.port != first.port


def test_grow_plan_avoids_the_cards_it_is_told_to() -> None:
    s = spec()
    facts = fresh()
    (plain,) = grow_plan(s, facts, "lazy").actions
    (moved,) = grow_plan(s, facts, "lazy", avoid=frozenset(plain.gpus[plain.nodes[0]])).actions
    assert not _cards(plain) & _cards(moved)


def test_a_start_planned_before_a_lock_is_rechecked_under_it() -> None:
    s = spec()
    facts = fresh()
    (action,) = grow_plan(s, facts, "lazy").actions
    assert conflicts(facts, action) is None
    # meanwhile another writer started a replica on the same cards
    (other,) = grow_plan(s, facts, "small").actions
    taken = applied(Plan(actions=(other,), unplaced=(), warnings=(), facts_digest=""), facts)
    assert _cards(other) == _cards(action)  # both planned on the same facts: the same card
    assert "now held by small replica 0" in (conflicts(taken, action) or "")
    assert conflicts(taken, other) is not None  # its own number exists now
    lost = dict(facts)
    lost[action.nodes[0]] = facts[action.nodes[0]].model_copy(update={"error": "unreachable"})
    assert "not reachable" in (conflicts(lost, action) or "")
