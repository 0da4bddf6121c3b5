"""Placement rules, one test each, on synthetic facts."""

from __future__ import annotations

import time

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.observe.facts import NodeFacts
from llmgw_cli.core.planning.placement import PlacedReplica, Placer, Slot, place

from .facts_factory import node_facts, topology

PROFILES = "profiles: {vllm: {engine: vllm}}\n"


def spec(
    nodes: str, models: str, fabrics: str = "fabrics: {ib-a: {kind: infiniband}, ib-b: {kind: infiniband}}\n"
) -> ClusterSpec:
    return parse_cluster(f"cluster: {{name: t}}\n{fabrics}nodes:\n{nodes}{PROFILES}models:\n{models}")


def hgx(name: str, fabric: str = "ib-a") -> str:
    return f"  - {{name: {name}, address: {name}.example, fabric: {fabric}, hcas: [mlx5_0]}}\n"


def model(name: str, tp: int = 1, nodes: int = 1, extra: str = "") -> str:
    fields = f"source: /data/models/{name}, profile: vllm, tensor_parallel: {tp}, nodes: {nodes}{extra}"
    return f"  - {{name: {name}, {fields}}}\n"


def test_tp_group_on_bridged_pcie_box_is_a_bridged_pair() -> None:
    s = spec(hgx("p1"), model("m", tp=2))
    facts = {"p1": node_facts("p1", gpus=4, gpu_name="NVIDIA A30", topo="pairs")}
    running = [PlacedReplica("other", (Slot("p1", (0,), ("GPU-p1-0",)),))]
    (replica,) = place(s, facts, running, {"m": 1}).replicas
    assert replica.slots[0].gpus == (2, 3)  # 1 is free too, but 1-2 crosses SYS
    assert replica.warnings == ()


def test_no_nvlink_pair_left_gives_a_warning_not_a_refusal() -> None:
    s = spec(hgx("p1"), model("m", tp=2))
    facts = {"p1": node_facts("p1", gpus=4, gpu_name="NVIDIA A30", topo="pairs")}
    running = [PlacedReplica("x", (Slot("p1", (0, 2), ("GPU-p1-0", "GPU-p1-2")),))]
    (replica,) = place(s, facts, running, {"m": 1}).replicas
    assert replica.slots[0].gpus == (1, 3)
    assert "SYS" in replica.warnings[0]


def test_unknown_topology_takes_lowest_indices_with_a_warning() -> None:
    s = spec(hgx("n1"), model("m", tp=4))
    (replica,) = place(s, {"n1": node_facts("n1", topo=None)}, [], {"m": 1}).replicas
    assert replica.slots[0].gpus == (0, 1, 2, 3)
    assert replica.warnings == ("topology unknown: took the lowest free GPU indices",)


def test_faulty_card_is_never_used() -> None:
    s = spec(hgx("n1"), model("m", tp=8))
    result = place(s, {"n1": node_facts("n1", faulty=(3,))}, [], {"m": 1})
    assert result.replicas == ()
    assert result.unplaced[0].reason == "m needs 8 free GPUs on one node; the most any node has is 7"
    (small,) = place(
        spec(hgx("n1"), model("m", tp=4)), {"n1": node_facts("n1", faulty=(0,))}, [], {"m": 1}
    ).replicas
    assert 0 not in small.slots[0].gpus


def test_gpu_class_and_memory_filter() -> None:
    s = spec(
        hgx("a") + hgx("b"),
        model("m", extra=", gpu_class: H200") + model("big", extra=", gpu_memory: 100GiB"),
    )
    facts = {"a": node_facts("a"), "b": node_facts("b", gpu_name="NVIDIA H200", memory=143771)}
    result = place(s, facts, [], {"m": 1, "big": 1})
    assert {r.model: r.slots[0].node for r in result.replicas} == {"m": "b", "big": "b"}


def test_weights_are_a_preference_not_a_filter() -> None:
    s = spec(hgx("a") + hgx("b"), model("m"))
    facts = {"a": node_facts("a"), "b": node_facts("b", models=("m",))}
    (replica,) = place(s, facts, [], {"m": 1}).replicas
    assert replica.slots[0].node == "b"
    facts["b"] = node_facts("b", gpus=0, models=("m",))
    (replica,) = place(s, facts, [], {"m": 1}).replicas
    assert replica.slots[0].node == "a"


def test_replicas_of_a_model_spread_across_nodes() -> None:
    s = spec(hgx("a") + hgx("b"), model("m"))
    result = place(s, {"a": node_facts("a"), "b": node_facts("b")}, [], {"m": 2})
    assert sorted(r.slots[0].node for r in result.replicas) == ["a", "b"]


def test_running_replicas_keep_their_cards() -> None:
    s = spec(hgx("a"), model("m", tp=4))
    running = [PlacedReplica("m", (Slot("a", (0, 1, 2, 3), tuple(f"GPU-a-{i}" for i in range(4))),))]
    (replica,) = place(s, {"a": node_facts("a")}, running, {"m": 1}).replicas
    assert replica.slots[0].gpus == (4, 5, 6, 7)


def test_a_preferred_node_comes_first_and_released_cards_are_free_again() -> None:
    s = spec(hgx("a") + hgx("b"), model("m", tp=4))
    facts = {"a": node_facts("a", faulty=(7,)), "b": node_facts("b")}
    old = PlacedReplica("m", (Slot("a", (0, 1, 2, 3), tuple(f"GPU-a-{i}" for i in range(4))),))
    placer = Placer(s, facts, [old])
    m = s.model("m")
    # spread alone would take the empty node b; the old replica's node is preferred, but
    # it has 3 healthy cards left
    spread = placer.one(m)
    assert isinstance(spread, PlacedReplica) and spread.slots[0].node == "b"
    placer.release(spread)
    assert placer.one(m, prefer=("a",)) == spread  # a does not fit: the usual rules
    placer.release(spread)
    placer.release(old)
    beside = placer.one(m, prefer=("a",))
    assert isinstance(beside, PlacedReplica) and beside.slots[0] == old.slots[0]
    placer.release(beside)
    placer.take(PlacedReplica("x", (Slot("a", (0, 1, 2, 3, 4, 5, 6), ()),)))
    placer.release(PlacedReplica("x", (Slot("a", (0, 1, 2, 3, 4, 5, 6, 7), ()),)))
    assert placer.states["a"].free == [0, 1, 2, 3, 4, 5, 6]  # the faulty card stays out


def test_multi_node_takes_whole_nodes_in_one_advertising_fabric() -> None:
    nodes = hgx("a1") + hgx("a2") + hgx("b1", "ib-b") + hgx("b2", "ib-b")
    s = spec(nodes, model("big", tp=8, nodes=2))
    facts = {
        "a1": node_facts("a1"),
        "a2": node_facts("a2", ib={"mlx5_0": "INIT"}),
        "b1": node_facts("b1"),
        "b2": node_facts("b2"),
    }
    (replica,) = place(s, facts, [], {"big": 1}).replicas
    assert [slot.node for slot in replica.slots] == ["b1", "b2"]
    assert all(slot.gpus == tuple(range(8)) for slot in replica.slots)


def test_multi_node_unplaced_explains_each_fabric() -> None:
    nodes = hgx("a1") + hgx("a2") + hgx("b1", "ib-b") + hgx("b2", "ib-b")
    s = spec(nodes, model("big", tp=8, nodes=2, extra=", gpu_class: H100-80GB"))
    facts: dict[str, NodeFacts] = {
        "a1": node_facts("a1"),
        "a2": node_facts("a2", faulty=(3,)),
        "b1": node_facts("b1", ib={"mlx5_0": "INIT"}),
        "b2": NodeFacts(node="b2", error="timeout", error_kind="timeout"),
    }
    (why,) = place(s, facts, [], {"big": 1}).unplaced
    assert why.reason == (
        "big needs 2 whole H100-80GB nodes in one fabric; ib-a has 1 free (a2: GPU 3 faulty), "
        "ib-b has 0 free (b1: mlx5_0 INIT: link up but no subnet manager has configured it; b2: unreachable)"
    )


def test_multi_node_first_so_small_models_do_not_fragment_whole_nodes() -> None:
    s = spec(hgx("a1") + hgx("a2"), model("small") + model("big", tp=8, nodes=2))
    result = place(s, {"a1": node_facts("a1"), "a2": node_facts("a2")}, [], {"small": 1, "big": 1})
    assert [r.model for r in result.replicas] == ["big"]
    assert result.unplaced[0].model == "small"


def test_deterministic() -> None:
    nodes = "".join(hgx(f"n{i}") for i in range(6))
    models = "".join(model(f"m{i}", tp=2 ** (i % 4)) for i in range(8))
    s = spec(nodes, models)
    facts = {f"n{i}": node_facts(f"n{i}") for i in range(6)}
    want = {f"m{i}": 2 for i in range(8)}
    assert place(s, facts, [], want) == place(s, dict(reversed(list(facts.items()))), [], want)


def test_topology_helper_builds_pairs() -> None:
    t = topology(4, "NV12", pairs=True)
    assert (t.link(0, 1), t.link(1, 2), t.nvlink_peers(0)) == ("NV12", "SYS", 1)


def test_placement_scale_smoke() -> None:
    """2,000 nodes x 8 GPUs and 300 models place completely (timing lives in bench/)."""
    nodes = "".join(hgx(f"n{i:04d}", "ib-a" if i % 2 else "ib-b") for i in range(2000))
    models = "".join(
        model(f"m{i}", tp=2 ** (i % 4), nodes=2 if i % 50 == 0 else 1)
        .replace("tensor_parallel: 1, nodes: 2", "tensor_parallel: 8, nodes: 2")
        .replace("tensor_parallel: 2, nodes: 2", "tensor_parallel: 8, nodes: 2")
        for i in range(300)
    )
    s = spec(nodes, models)
    facts = {n.name: node_facts(n.name) for n in s.nodes}
    started = time.perf_counter()
    result = place(s, facts, [], {m.name: 3 for m in s.models})
    assert not result.unplaced
    assert len(result.replicas) == 900
    assert time.perf_counter() - started < 60  # a hang guard only; speed is measured in bench/
