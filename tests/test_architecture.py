"""The architecture's rules, checked on the source: layers import downwards only, node/
stands alone, no import circles, no module over 1,000 lines.

The import graph and the layer order are scripts/architecture_report.py's (its docstring
gives the order and why lab/ sits outside it), so this test and the report judge alike.
Every import counts, also those inside functions and under TYPE_CHECKING: an import a
function makes late, or one only the type checker reads, is still a dependency.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _report() -> ModuleType:
    path = ROOT / "scripts" / "architecture_report.py"
    spec = importlib.util.spec_from_file_location("architecture_report", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("architecture_report", module)
    spec.loader.exec_module(module)
    return module


report = _report()
Graph = tuple[dict[str, Path], list[Any], dict[str, list[Any]]]  # modules, edges, outside imports


@pytest.fixture(scope="module")
def graph() -> Graph:
    return report.import_edges(ROOT)


def test_the_graph_sees_the_package(graph: Graph) -> None:
    """A graph that missed the package's modules or imports would pass every rule below."""
    modules, edges, _ = graph
    assert {"llmgw_cli.cli.main", "llmgw_cli.core.clusterfile.spec", "llmgw_cli.errors"} <= set(modules)
    assert any(e.source == "llmgw_cli.cli.main" and e.target == "llmgw_cli.errors" for e in edges)


def test_no_module_imports_a_higher_layer(graph: Graph) -> None:
    _, edges, _ = graph
    bad = [f"{e.source}:{e.line} -> {e.target} ({why})" for e, why in report.layer_violations(edges)]
    assert bad == [], "imports against the layer order:\n" + "\n".join(bad)


def test_the_layer_rule_catches_an_upward_import() -> None:
    assert report.layer_violation("llmgw_cli.core.planning.plan", "llmgw_cli.remote.ssh")
    assert report.layer_violation("llmgw_cli.gateway.serving.proxy", "llmgw_cli.cli.main")
    assert report.layer_violation("llmgw_cli.core.clusterfile.spec", "llmgw_cli.lab.cluster")
    assert report.layer_violation("llmgw_cli.lab.cluster", "llmgw_cli.cli.lab")
    assert report.layer_violation("llmgw_cli.node.helper", "llmgw_cli.errors")
    assert report.layer_violation("llmgw_cli.cli.apply", "llmgw_cli.core.planning.plan") is None
    assert report.layer_violation("llmgw_cli.gateway.control.fleet", "llmgw_cli.remote.ssh") is None
    assert report.layer_violation("llmgw_cli.core.observe.parse.probe", "llmgw_cli.errors") is None
    assert report.layer_violation("llmgw_cli.lab.cluster", "llmgw_cli.remote.ssh") is None


def test_node_imports_only_the_standard_library_and_itself(graph: Graph) -> None:
    """node/ runs on a node as root; it carries nothing of llmgw but itself. Until the
    folder exists there is nothing of it to check, and the graph must say so too."""
    modules, edges, outside = graph
    node_modules = [m for m in modules if report.top_of(m) == "node"]
    assert bool(node_modules) == (ROOT / "llmgw_cli" / "node").is_dir()
    inward = [f"{e.source}:{e.line} -> {e.target}" for e in edges if report.top_of(e.source) == "node"]
    inward = [line for line in inward if not line.split(" -> ")[1].startswith("llmgw_cli.node")]
    foreign = [f"{m}:{i.line} -> {i.target}" for m, i in report.node_outside_imports(outside)]
    assert inward + foreign == [], "node/ imports outside itself:\n" + "\n".join(inward + foreign)


def test_no_import_circles(graph: Graph) -> None:
    modules, edges, _ = graph
    found = report.circles(modules, edges)
    assert found == [], "import circles:\n" + "\n".join(" ".join(c) for c in found)


def test_circles_are_found() -> None:
    edges = [report.Edge("a", "b", 1, False), report.Edge("b", "c", 1, False), report.Edge("c", "a", 1, True)]
    assert report.circles({"a": Path(), "b": Path(), "c": Path(), "d": Path()}, edges) == [["a", "b", "c"]]


def test_no_module_over_1000_lines(graph: Graph) -> None:
    modules, _, _ = graph
    sizes = {str(p.relative_to(ROOT)): report.line_count(p) for p in modules.values()}
    over = sorted(f"{path}: {n} lines" for path, n in sizes.items() if n > report.LIMIT_LINES)
    assert over == [], "modules over 1,000 lines:\n" + "\n".join(over)
