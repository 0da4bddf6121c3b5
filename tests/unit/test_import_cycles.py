"""No import cycle through the gateway's modules or through ``progress``, not even one
hidden behind ``TYPE_CHECKING`` or a function-local import. The import graph and its
cycle search are scripts/architecture_report.py's, the same that tests/test_architecture.py
holds the whole package to; these name the two places a cycle once stood."""

from __future__ import annotations

from pathlib import Path

from tests.test_architecture import ROOT, report


def graph() -> tuple[dict[str, set[str]], list[list[str]]]:
    """Each module's llmgw imports, and the import circles among them."""
    modules, edges, _ = report.import_edges(ROOT)
    imports: dict[str, set[str]] = {m: set() for m in modules}
    for e in edges:
        imports[e.source].add(e.target)
    return imports, report.circles(modules, edges)


def test_the_check_finds_cycles() -> None:
    edges = [report.Edge(a, b, 1, False) for a, b in [("a", "b"), ("b", "c"), ("c", "a"), ("d", "a")]]
    assert report.circles({m: Path() for m in "abcd"}, edges) == [["a", "b", "c"]]
    assert report.circles({"a": Path(), "b": Path()}, [report.Edge("a", "b", 1, False)]) == []


def test_no_gateway_module_imports_itself_through_others() -> None:
    """The gateway's modules form no cycle (state owns the controller, the controller
    is handed what it needs and never imports state)."""
    imports, circles = graph()
    # the graph is read
    assert "llmgw_cli.gateway.control.controller" in imports["llmgw_cli.gateway.control.state"]
    through_gateway = [c for c in circles if any(m.startswith("llmgw_cli.gateway.") for m in c)]
    assert through_gateway == []


def test_progress_callbacks_sit_below_what_reports_through_them() -> None:
    """``progress`` declares what the fetcher reports (``FetchEvent``), so it imports none
    of the modules that report through it."""
    _, circles = graph()
    assert [c for c in circles if "llmgw_cli.progress" in c] == []
