"""The pure fetch decisions: which sources are fetched, which nodes need a file, who
downloads from the origin and who copies from peers."""

from __future__ import annotations

import json
from io import StringIO

import pytest
from rich.console import Console

from llmgw_cli.cli.views import fetch_plan_view
from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.weights.fetch import Peers, held_in_facts, plan_fetch, plan_report, select, token_for
from tests.unit.facts_factory import node_facts

URL = "https://huggingface.co/org/repo/resolve/0123456789abcdef0123456789abcdef01234567/m.Q4.gguf"


def spec(nodes: str, models: str | None = None) -> ClusterSpec:
    models = models or (
        f"  - {{name: big, source: '{URL}', profile: p, scaling: {{min: 1, max: 1}}}}\n"
        "  - {name: repo, source: Qwen/Qwen2.5-7B-Instruct, fetch: engine, profile: v, scaling: {min: 1, max: 1}}\n"
        "  - {name: local, source: ./local.gguf, profile: p, scaling: {min: 1, max: 1}}\n"
        f"  - {{name: unused, source: '{URL}x', profile: p}}\n"
        f"  - {{name: h100, source: '{URL}', profile: p, gpu_class: H100-80GB, scaling: {{min: 0, max: 1}}}}\n"
    )
    return parse_cluster(
        "cluster: {name: t}\nfabrics: {ib0: {kind: infiniband}, ib1: {kind: infiniband}}\n"
        f"nodes:\n{nodes}profiles: {{p: {{engine: llama-server}}, v: {{engine: vllm}}}}\nmodels:\n{models}"
    )


def nodes(*specs: tuple[str, str | None, str]) -> str:
    """(name, fabric, weights) -> YAML lines; weights may be ``shared:/path``."""
    out = ""
    for i, (name, fabric, weights) in enumerate(specs, 1):
        shared = weights.startswith("shared:")
        path = weights.removeprefix("shared:")
        w = f"{{path: {path}, shared: true}}" if shared else path
        fab = f", fabric: {fabric}" if fabric else ""
        out += f"  - {{name: {name}, address: 10.0.0.{i}{fab}, weights: [{w}]}}\n"
    return out


FOUR = nodes(("a", "ib0", "/w"), ("b", "ib0", "/w"), ("c", "ib0", "/w"), ("d", "ib1", "/w"))


def test_only_https_sources_are_fetched_repo_ids_go_to_the_engine_paths_are_checked() -> None:
    s = spec(FOUR)
    plan = plan_fetch(s, {"big": ["a"], "repo": ["a"], "local": ["a"]}, set(), set())
    assert [(sp.model, sp.origin) for sp in plan.spreads] == [("big", "a")]
    assert plan.spreads[0].paths["a"] == "/w/m.Q4.gguf"  # the path the engine is given
    assert [(k.model, k.reason) for k in plan.skipped] == [
        ("repo", "a Hugging Face repo id: the engine downloads it")
    ]
    assert plan.checks == (("local", "a", "/w/local.gguf"),)


def test_one_origin_download_per_fabric_the_rest_copy_from_peers() -> None:
    plan = plan_fetch(spec(FOUR), {"big": ["a", "b", "c", "d"]}, set(), set())
    by_group = {sp.group: (sp.origin, sp.copies, sp.seeds) for sp in plan.spreads}
    assert by_group == {"ib0": ("a", ("b", "c"), ()), "ib1": ("d", (), ())}


def test_peer_scope_cluster_and_off() -> None:
    wanted = {"big": ["a", "b", "c", "d"]}
    cluster = plan_fetch(spec(FOUR), wanted, set(), set(), Peers.cluster)
    assert [(sp.origin, sp.copies) for sp in cluster.spreads] == [("a", ("b", "c", "d"))]
    off = plan_fetch(spec(FOUR), wanted, set(), set(), Peers.off)
    assert sorted(sp.origin or "" for sp in off.spreads) == ["a", "b", "c", "d"]
    assert all(sp.copies == () for sp in off.spreads)


def test_a_node_holding_the_file_seeds_its_fabric_even_when_not_wanted() -> None:
    plan = plan_fetch(spec(FOUR), {"big": ["a", "b"]}, {("big", "c")}, set())
    [sp] = plan.spreads
    assert (sp.seeds, sp.origin, sp.copies) == (("c",), None, ("a", "b"))
    assert "c" in sp.paths


def test_present_everywhere_means_nothing_to_do() -> None:
    held = {("big", n) for n in "abcd"}
    plan = plan_fetch(spec(FOUR), {"big": ["a", "d"]}, held, set())
    assert plan.spreads == ()
    assert sorted((k.node, k.reason) for k in plan.skipped) == [("a", "present"), ("d", "present")]


def test_unreachable_nodes_are_skipped_and_never_seed() -> None:
    plan = plan_fetch(spec(FOUR), {"big": ["a", "b"]}, {("big", "c")}, {"a", "c"})
    [sp] = plan.spreads
    assert (sp.seeds, sp.origin, sp.copies) == ((), "b", ())
    assert [(k.node, k.reason) for k in plan.skipped] == [("a", "unreachable")]


def test_shared_storage_is_fetched_once_per_fabric_and_folder() -> None:
    shared = nodes(("a", "ib0", "shared:/nfs"), ("b", "ib0", "shared:/nfs"), ("c", "ib1", "shared:/nfs"))
    plan = plan_fetch(spec(shared), {"big": ["a", "b", "c"]}, set(), set())
    assert sorted((sp.group, sp.origin, sp.copies) for sp in plan.spreads) == [
        ("ib0", "a", ()),
        ("ib1", "c", ()),
    ]
    assert [(k.node, k.reason) for k in plan.skipped] == [("b", "shared storage: brought by a")]


def test_select_defaults_to_models_not_off_and_nodes_of_the_right_class() -> None:
    s = spec(FOUR)
    facts = {
        "a": node_facts("a"),
        "b": node_facts("b", gpu_name="NVIDIA A100 80GB PCIe"),
        "c": node_facts("c"),
    }
    wanted = select(s, facts)
    assert "unused" not in wanted
    assert wanted["h100"] == ["a", "c", "d"]  # d: GPUs unknown, not excluded
    assert wanted["big"] == ["a", "b", "c", "d"]
    assert select(s, facts, ["unused"], ["b"]) == {"unused": ["b"]}
    with pytest.raises(ValueError, match="no model named 'nope'"):
        select(s, facts, ["nope"])
    with pytest.raises(ValueError, match="no node named 'z'"):
        select(s, facts, None, ["z"])


def test_held_in_facts_needs_a_complete_file_in_the_target_folder() -> None:
    s = spec(nodes(("a", "ib0", "/data/models"), ("b", "ib0", "/elsewhere")))
    facts = {"a": node_facts("a", models=("m.Q4.gguf",)), "b": node_facts("b", models=("m.Q4.gguf",))}
    assert held_in_facts(s, facts) == {("big", "a"), ("h100", "a")}  # not b: another folder


def test_the_token_goes_only_to_hugging_face() -> None:
    assert token_for(URL, "t") == "t"
    assert token_for("https://cdn.example.org/m.gguf", "t") is None
    assert token_for("https://mirror.internal/org/r/resolve/main/x", "t", "https://mirror.internal") == "t"
    assert token_for("http://huggingface.co/x", "t") is None
    assert token_for(URL, None) is None


def test_the_dry_run_report_names_each_pair_and_where_it_comes_from() -> None:
    plan = plan_fetch(
        spec(FOUR), {"big": ["a", "b", "d"], "repo": ["a"], "local": ["a"]}, {("big", "c")}, set()
    )
    report = plan_report(plan)
    assert json.loads(json.dumps(report)) == report  # what --json prints, as it is
    fetches = {(f["model"], f["node"]): f for f in report["fetches"]}
    assert sorted(fetches) == [("big", "a"), ("big", "b"), ("big", "d")]
    # ib0 has c holding the file: a and b copy from it; ib1 has nobody: d downloads
    assert (fetches["big", "a"]["from"], fetches["big", "a"]["seeds"]) == ("peer", ["c"])
    assert fetches["big", "b"]["from"] == "peer"
    assert (fetches["big", "d"]["from"], fetches["big", "d"]["origin"]) == ("origin", "d")
    assert fetches["big", "d"]["url"] == URL and fetches["big", "d"]["path"] == "/w/m.Q4.gguf"
    assert report["checks"] == [{"model": "local", "node": "a", "path": "/w/local.gguf"}]
    assert report["skipped"] == [
        {"model": "repo", "node": "a", "reason": "a Hugging Face repo id: the engine downloads it"}
    ]
    shown = StringIO()
    Console(file=shown, width=200, color_system=None).print(fetch_plan_view(plan))
    lines = shown.getvalue().splitlines()
    assert any(line.split()[:4] == ["big", "a", "copy", "a"] and "peer: c" in line for line in lines)
    assert any(line.split()[:4] == ["big", "d", "download", URL] for line in lines)
    assert lines[-1] == (
        "Fetch: 1 download(s) from the origin, 2 copy(ies) from peers, 1 path(s) to check, 1 left out."
    )
