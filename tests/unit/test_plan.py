"""The plan: desired vs actual, as a value (pure; the lab tests run it for real)."""

from __future__ import annotations

import json

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.observe.facts import GpuHealth, NodeFacts
from llmgw_cli.core.observe.unit_state import UnitState
from llmgw_cli.core.planning.controller import UnitCondition
from llmgw_cli.core.planning.plan import (
    Action,
    Plan,
    Retired,
    conflicts,
    grow_plan,
    held_faults,
    make_plan,
    running_replicas,
    stop_plan,
)
from llmgw_cli.core.planning.replicas import unit_condition
from llmgw_cli.core.views.summary import summarize

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
  - {name: small, source: org/small, fetch: engine, profile: vllm, scaling: {min: 2, max: 3}}
  - {name: mid, source: org/mid, fetch: engine, profile: vllm, tensor_parallel: 4, args: [--x], scaling: {min: 1, max: 1}}
  - {name: big, source: org/big, fetch: engine, profile: vllm, tensor_parallel: 8, nodes: 2, scaling: {min: 1, max: 1}}
  - {name: lazy, source: org/lazy, fetch: engine, profile: vllm, scaling: {min: 0, max: 1, idle_timeout: 5m}}
"""


def spec(text: str = CLUSTER) -> ClusterSpec:
    return parse_cluster(text)


def fresh() -> dict[str, NodeFacts]:
    return {n: node_facts(n) for n in "abc"}


def applied(plan: Plan, facts: dict[str, NodeFacts]) -> dict[str, NodeFacts]:
    """The nodes once ``plan`` ran: what it removes is gone (with its drain marker), what it
    writes runs. A surge's old replica goes too: its units are in its ``remove``."""
    out = dict(facts)
    for action in plan.actions:
        for node, name in action.remove:
            f = out[node]
            out[node] = f.model_copy(
                update={
                    "units": tuple(u for u in f.units if u.name != name),
                    "unit_labels": {k: v for k, v in f.unit_labels.items() if k != name},
                    "draining": {k: v for k, v in f.draining.items() if k != name},
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
    assert [(a.op, a.model) for a in changed.changes] == [("~", "mid")]
    (mid,) = changed.changes
    assert "--y" in mid.write[0].text
    # big holds two whole nodes, mid and small the third: no 4 cards are free beside mid
    assert mid.replica == 0 and not mid.surge  # the same unit name is rewritten in place
    assert mid.reason == "spec changed; replaced in place: no free cards, no other replica serves"
    assert changed.downtime == [
        "mid will be unavailable for its load time: no free cards to start the new replica first"
    ]


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
    for state, said in (("failed", "failed"), ("inactive", "stopped")):
        down = with_units(facts, [(w.node, w.name, w.text) for w in mid.write], state=state)
        again = make_plan(s, down)
        assert [(a.op, a.model, a.reason, a.unhealthy) for a in again.changes] == [
            ("~", "mid", f"{said}; started again", said)
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
        ("~", "big", "failed; started again")
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


def test_grow_plan_passes_shunned_nodes_by_unless_nothing_else_fits() -> None:
    s = spec()
    facts = fresh()
    (plain,) = grow_plan(s, facts, "lazy").actions
    (moved,) = grow_plan(s, facts, "lazy", shun=frozenset(plain.nodes)).actions
    assert moved.nodes != plain.nodes
    # every node shunned: placed as if none were (a preference, never a filter)
    (same,) = grow_plan(s, facts, "lazy", shun=frozenset(facts)).actions
    assert (same.nodes, same.gpus) == (plain.nodes, plain.gpus)


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


# --- rolling replacements ------------------------------------------------------------

ROLLING = """\
cluster: {{name: t}}
nodes:
  - {{name: a, address: 10.0.0.1}}
  - {{name: b, address: 10.0.0.2}}
profiles:
  vllm: {{engine: vllm, ports: 8100-8199}}
models:
  - {{name: m, source: org/m, fetch: engine, profile: vllm, tensor_parallel: 2, args: [{arg}]{extra},
      scaling: {{min: {min}, max: 4}}}}
"""


def rolling(arg: str = "--x", *, min: int = 1, extra: str = "") -> ClusterSpec:
    return parse_cluster(ROLLING.format(arg=arg, min=min, extra=extra))


def cluster(a: int, b: int = 0) -> dict[str, NodeFacts]:
    """Node a with ``a`` cards, node b with ``b``."""
    return {"a": node_facts("a", gpus=a), "b": node_facts("b", gpus=b)}


def settled(s: ClusterSpec, facts: dict[str, NodeFacts]) -> dict[str, NodeFacts]:
    """The nodes once ``make_plan`` was applied, checked to need nothing more."""
    out = applied(make_plan(s, facts), facts)
    assert make_plan(s, out).changes == []
    return out


def converges(s: ClusterSpec, plan: Plan, facts: dict[str, NodeFacts]) -> dict[str, NodeFacts]:
    """Applying ``plan`` leaves nothing to do for a second plan."""
    after = applied(plan, facts)
    again = make_plan(s, after)
    assert again.changes == [] and again.unplaced == (), ops(again)
    return after


def test_a_changed_replica_with_free_cards_beside_it_is_replaced_new_one_first() -> None:
    facts = settled(rolling(), cluster(8, 8))
    (old,) = running_replicas(facts)
    assert (old.replica, old.members, old.port) == (0, ("a",), 8100)
    s = rolling("--y")
    plan = make_plan(s, facts)
    (action,) = plan.changes
    assert (action.op, action.replica, action.surge) == ("~", 1, True)
    assert action.nodes == ("a",)  # beside the old one, though node b is empty
    assert action.port == 8102 and action.gpus == {"a": ("GPU-a-2", "GPU-a-3")}
    assert action.retire == Retired(replica=0, nodes=("a",), unit="llmgw-m-0.service", port=8100)
    assert action.remove == (("a", "llmgw-m-0.service"),)
    assert [w.name for w in action.write] == ["llmgw-m-1.service"]
    assert action.reason == "spec changed; new replica first, then #0 drained and stopped"
    assert action.downtime == "" and plan.downtime == []
    # planned before a lock: the old replica it retires is not in its way
    assert conflicts(facts, action) is None
    after = converges(s, plan, facts)
    assert [(r.replica, r.port) for r in running_replicas(after)] == [(1, 8102)]


def test_a_replica_on_a_card_gone_faulty_is_replaced_on_healthy_cards_new_one_first() -> None:
    s = rolling()
    facts = settled(s, cluster(8, 8))
    (old,) = running_replicas(facts)
    assert old.gpus == {"a": ("GPU-a-0", "GPU-a-1")}
    assert held_faults(old, facts) == () and unit_condition(old, facts, set()) is UnitCondition.up
    bad = {
        "health": GpuHealth.faulty,
        "reasons": ("XID 79: GPU has fallen off the bus",),
        "causes": ("xid-79",),
    }
    cards = tuple(g.model_copy(update=bad) if g.index == 1 else g for g in facts["a"].gpus)
    facts["a"] = facts["a"].model_copy(update={"gpus": cards})
    assert held_faults(old, facts) == ("a GPU 1: XID 79: GPU has fallen off the bus",)
    assert unit_condition(old, facts, set(), served=True) is UnitCondition.faulty_card
    plan = make_plan(s, facts)
    (action,) = plan.changes
    assert (action.op, action.surge, action.retire and action.retire.replica) == ("~", True, 0)
    assert action.gpus == {"a": ("GPU-a-2", "GPU-a-3")}  # healthy cards beside it
    assert action.reason.startswith("on a faulty card (a GPU 1: XID 79: GPU has fallen off the bus)")
    converges(s, plan, facts)
    # a card nvidia-smi no longer lists (fallen off the bus) is a faulty one too
    gone = facts["a"].model_copy(update={"gpus": cards[1:], "lost_gpus": ("0000:18:00.0",)})
    assert held_faults(old, {**facts, "a": gone}) == (
        "a: card GPU-a-0 is gone from nvidia-smi's list (fallen off the bus)",
        "a GPU 1: XID 79: GPU has fallen off the bus",
    )


def test_two_replicas_with_room_for_one_successor_roll_onto_each_others_cards() -> None:
    # 6 cards, two replicas of 2: one successor fits at a time
    s0 = rolling(min=2)
    facts = settled(s0, cluster(6))
    olds = {r.replica: r for r in running_replicas(facts)}
    assert set(olds) == {0, 1}
    s = rolling("--y", min=2)
    plan = make_plan(s, facts)
    first, second = plan.changes
    assert [(a.op, a.replica, a.surge, a.retire and a.retire.replica) for a in plan.changes] == [
        ("~", 2, True, 0),
        ("~", 3, True, 1),
    ]
    free = {"GPU-a-4", "GPU-a-5"}
    assert set(first.gpus["a"]) == free
    # the second successor takes the first old replica's cards once it is stopped: never
    # the cards of the old replica still serving, never both old replicas down
    assert set(second.gpus["a"]) == set(olds[0].gpus["a"])
    assert plan.downtime == []
    assert {first.port, second.port}.isdisjoint({olds[0].port, olds[1].port})
    converges(s, plan, facts)


def test_no_free_cards_with_another_replica_serving_is_in_place_without_downtime() -> None:
    s0 = rolling(min=2)
    facts = settled(s0, cluster(4))
    s = rolling("--y", min=2)
    plan = make_plan(s, facts)
    assert [(a.replica, a.surge, a.retire and a.retire.replica) for a in plan.changes] == [
        (0, False, 0),
        (1, False, 1),
    ]
    assert all(
        a.reason == "spec changed; replaced in place: no free cards, 1 other replica serves"
        for a in plan.changes
    )
    assert plan.downtime == []
    for a in plan.changes:
        assert conflicts(facts, a) is None  # its own old replica is not in its way
    converges(s, plan, facts)


def test_no_free_cards_and_no_other_replica_is_downtime_named_by_class() -> None:
    facts = settled(rolling(), cluster(2))
    s = rolling("--y", extra=", gpu_class: H100-80GB")
    plan = make_plan(s, facts)
    (action,) = plan.changes
    assert (action.replica, action.surge) == (0, False)
    assert action.retire is not None and action.retire.replica == 0
    assert action.reason == "spec changed; replaced in place: no free cards, no other replica serves"
    assert plan.downtime == [
        "m will be unavailable for its load time: no free H100-80GB cards to start the new replica first"
    ]
    converges(s, plan, facts)


def test_a_down_replica_is_replaced_in_place_without_drain_or_downtime() -> None:
    s = rolling()
    for room in (2, 8):  # no room beside it, and room
        facts = settled(s, cluster(room))
        (old,) = running_replicas(facts)
        down = with_units(facts, [("a", old.unit, unit_text(facts, "a", old.unit))], state="failed")
        plan = make_plan(s, down)
        (action,) = plan.changes
        assert (action.op, action.replica, action.surge) == ("~", 0, False)
        assert action.reason == "failed; started again"
        assert action.downtime == ""
        converges(s, plan, down)


def unit_text(facts: dict[str, NodeFacts], node: str, unit: str) -> str:
    """A unit's labels back as unit text (what ``with_units`` reads)."""
    return "".join(f"X-Llmgw-{k}={v}\n" for k, v in facts[node].unit_labels[unit].items())


def test_replace_requested_rolls_an_unchanged_replica() -> None:
    s = rolling()
    facts = settled(s, cluster(8))
    assert make_plan(s, facts).changes == []
    plan = make_plan(s, facts, replace=frozenset({("m", 0)}))
    (action,) = plan.changes
    assert (action.replica, action.surge, action.retire and action.retire.replica) == (1, True, 0)
    assert action.reason == "replace requested; new replica first, then #0 drained and stopped"
    converges(s, plan, facts)
    # a pair that does not run changes nothing
    assert make_plan(s, facts, replace=frozenset({("m", 7), ("x", 0)})).changes == []


def test_a_replica_left_draining_is_deleted_and_min_kept() -> None:
    s = rolling()
    facts = settled(s, cluster(8))
    (old,) = running_replicas(facts)
    marked = dict(facts)
    marked["a"] = facts["a"].model_copy(update={"draining": {old.unit: 1700000000.0}})
    (r,) = running_replicas(marked)
    assert r.draining == 1700000000.0 and r.up and not r.serving()
    plan = make_plan(s, marked)
    assert [(a.op, a.replica, a.reason) for a in plan.changes] == [
        ("-", 0, "left draining by an interrupted apply"),
        ("+", 1, "below min"),
    ]
    assert plan.changes[0].remove == (("a", old.unit),)
    converges(s, plan, marked)


def test_another_models_retired_cards_wait_for_it() -> None:
    # Models are replaced side by side: one model's successor never takes the cards of
    # another model's old replica, which may still run.
    text = ROLLING.format(arg="--x", min=1, extra="") + (
        "  - {name: n, source: org/n, fetch: engine, profile: vllm, tensor_parallel: 2, args: [--x],"
        " scaling: {min: 1, max: 1}}\n"
    )
    facts = settled(parse_cluster(text), cluster(6))
    s = parse_cluster(text.replace("--x", "--y"))
    plan = make_plan(s, facts)
    first, second = plan.changes
    assert first.surge and not second.surge
    assert second.downtime  # the 2 free cards went to the first model's successor
    assert not _cards(first) & _cards(second)
    converges(s, plan, facts)


def test_a_saved_plan_without_the_rolling_fields_still_loads() -> None:
    plan = make_plan(rolling("--y"), settled(rolling(), cluster(8)))
    data = json.loads(plan.model_dump_json())
    for action in data["actions"]:
        for key in ("retire", "surge", "downtime"):
            del action[key]
    loaded = Plan.model_validate(data)
    (action,) = loaded.changes
    assert action.retire is None and not action.surge and action.downtime == ""
    assert Plan.model_validate_json(plan.model_dump_json()) == plan


def test_a_url_source_without_sha256_is_warned_about_once_per_model() -> None:
    url = "https://example.org/w/m.gguf"
    text = CLUSTER + (
        f"  - {{name: loose, source: '{url}', profile: vllm}}\n"
        f"  - {{name: pinned, source: '{url}p', sha256: '{'ab' * 32}', profile: vllm}}\n"
        f"  - {{name: loose2, source: '{url}q', profile: vllm, scaling: {{min: 0, max: 1}}}}\n"
    )
    warnings = [w for w in make_plan(spec(text), fresh()).warnings if "sha256" in w]
    assert [w.split(":")[0] for w in warnings] == ["loose", "loose2"]
    assert "checked only against what the seed node downloaded" in warnings[0]
    assert "`sha256: <hex>`" in warnings[0] and url in warnings[0]
    assert not [w for w in make_plan(spec(), fresh()).warnings if "sha256" in w]  # repo ids: none


def _looping(restarts: int, sub_state: str = "auto-restart", age: float = 3.0) -> UnitState:
    """An engine that exits at once, as `systemctl show` says it (``core/observe/health.py``)."""
    return UnitState(
        name="",
        load_state="loaded",
        active_state="activating" if sub_state == "auto-restart" else "active",
        sub_state=sub_state,
        result="exit-code",
        main_pid=0,
        n_restarts=restarts,
        exec_main_code=1,
        exec_main_status=2,
        age=age,
        lived=0.2 if sub_state == "auto-restart" else None,
    )


def test_a_crash_looping_replica_is_no_change_it_is_started_again() -> None:
    """systemd keeps a crashing engine `activating`: the plan must not call that as it
    should be, nor count its cards as held."""
    s = spec()
    facts = applied(make_plan(s, fresh()), fresh())
    mid = next(r for r in running_replicas(facts) if r.model == "mid")
    writes = [(n, mid.unit, unit_text(facts, n, mid.unit)) for n in mid.members]
    for shown in (_looping(7), _looping(3, "running")):
        looping = with_units(facts, writes, shown=shown)
        plan = make_plan(s, looping)
        (action,) = plan.changes
        assert (action.op, action.model, action.retire and action.retire.replica) == ("~", "mid", 0)
        assert action.unhealthy == f"crash-looping ({shown.n_restarts} restarts, exit status 2)"
        assert action.reason == f"{action.unhealthy}; started again"
        row = next(m for m in summarize(s, looping).models if m.name == "mid")
        assert row.running == 0
        used = sum(c.used for c in summarize(s, looping).classes)
        assert used == sum(c.used for c in summarize(s, facts).classes) - 4


def test_a_replica_still_starting_is_left_alone_and_said_so() -> None:
    s = spec()
    facts = applied(make_plan(s, fresh()), fresh())
    mid = next(r for r in running_replicas(facts) if r.model == "mid")
    young = _looping(0, "running", age=10.0).model_copy(update={"result": "success", "exec_main_status": 0})
    starting = with_units(
        facts, [(n, mid.unit, unit_text(facts, n, mid.unit)) for n in mid.members], shown=young
    )
    plan = make_plan(s, starting)
    assert plan.changes == []
    (kept,) = [a for a in plan.actions if a.model == "mid"]
    assert kept.starting and kept.reason == "starting: not seen ready yet"
    # its health check answered: ready, nothing to say
    answered = make_plan(s, starting, answers={("mid", 0): True})
    assert not next(a for a in answered.actions if a.model == "mid").starting
