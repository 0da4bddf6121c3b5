"""`llmgw status --nodes`: the Summary of the named nodes only, and what runs on them."""

from __future__ import annotations

from io import StringIO

from rich.console import Console

from llmgw_cli.cli.views import status_view
from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.observe.facts import NodeFacts
from llmgw_cli.core.planning.plan import make_plan
from llmgw_cli.core.views.summary import Summary, summarize

from .facts_factory import node_facts, with_units

SPEC = parse_cluster(
    """\
cluster: {name: t}
fabrics: {ib: {kind: infiniband}, roce: {kind: roce}}
nodes:
  - {name: a, address: 10.0.0.1, fabric: ib, hcas: [mlx5_0]}
  - {name: b, address: 10.0.0.2, fabric: ib, hcas: [mlx5_0]}
  - {name: c, address: 10.0.0.3, fabric: roce, hcas: [mlx5_0]}
profiles:
  vllm: {engine: vllm, ports: 8100-8199}
models:
  - {name: small, source: org/small, fetch: engine, profile: vllm, tensor_parallel: 8, scaling: {min: 2, max: 3}}
  - {name: big, source: org/big, fetch: engine, profile: vllm, tensor_parallel: 8, nodes: 2, scaling: {min: 1, max: 1}}
  - {name: lazy, source: org/lazy, fetch: engine, profile: vllm, scaling: {min: 0, max: 1, idle_timeout: 5m}}
"""
)


def running() -> dict[str, NodeFacts]:
    """Every node as the plan leaves it: big on a and b, small on c and ... wherever it fits."""
    facts = {n: node_facts(n, gpu_name="NVIDIA A100-SXM4-80GB" if n == "c" else "NVIDIA H100 80GB HBM3")
             for n in "abc"}  # fmt: skip
    plan = make_plan(SPEC, facts)
    return with_units(facts, [(w.node, w.name, w.text) for a in plan.actions for w in a.write])


def test_the_summary_of_some_nodes_holds_those_nodes_only() -> None:
    facts = running()
    where = {m.name: m.where for m in summarize(SPEC, facts).models}
    assert where["big"] == ("a", "b")
    [small_node] = where["small"]  # one replica fits: the other nodes are big's
    assert small_node == "c"
    # what status --nodes c probes, and shows
    seen = {"c": facts["c"]}
    scoped = summarize(SPEC, seen, scope=["c"])
    assert scoped.scope == ("c",)
    assert [n.name for n in scoped.nodes] == ["c"]
    assert [(c.gpu_class, c.total, c.used) for c in scoped.classes] == [("A100-80GB", 8, 8)]
    assert [f.name for f in scoped.fabrics] == ["roce"]
    assert [(m.name, m.running, m.desired, m.where) for m in scoped.models] == [("small", 1, 2, ("c",))]
    # the whole fleet, unscoped, still counts every node declared
    whole = summarize(SPEC, seen)
    assert whole.scope is None
    assert [(n.name, n.reachable, n.error) for n in whole.nodes][:2] == [
        ("a", False, "not probed"),
        ("b", False, "not probed"),
    ]


def test_a_replica_with_members_left_out_runs_when_its_units_here_run() -> None:
    facts = running()
    scoped = summarize(SPEC, {"a": facts["a"]}, scope=["a"])
    assert [(m.name, m.running, m.where) for m in scoped.models] == [("big", 1, ("a", "b"))]
    assert [(f.name, f.nodes) for f in scoped.fabrics] == [("ib", 1)]


def shown(summary: Summary) -> str:
    out = StringIO()
    Console(file=out, width=120, force_terminal=True, color_system="standard").print(
        status_view(summary, 0.5)
    )
    return out.getvalue()


RED = "\x1b[31m"


def test_the_view_of_some_nodes_names_them_and_shows_no_shortfall() -> None:
    facts = running()
    text = shown(summarize(SPEC, {"c": facts["c"]}, scope=["c"]))
    assert "Models with a unit on c" in text
    assert "│ a " not in text and "10.0.0.1" not in text and "unreachable" not in text
    assert "1 / 2" in text
    # min counts the fleet: one replica of two on these nodes is no shortfall here...
    assert RED not in text
    # ...and is one in the fleet's view
    assert RED in shown(summarize(SPEC, facts))
