"""No import cycle through the gateway's modules, not even one hidden behind
``TYPE_CHECKING`` or a function-local import: each module's imports are read from its
source (every import statement at any depth counts)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "llmgw_cli"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The llmgw modules ``path`` imports (``from pkg import module`` names the module)."""
    own = _module_name(path)
    package = own if path.name == "__init__.py" else own.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return {m for m in found if m in modules and m != own}


def graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    return {_module_name(p): _imports(p, modules) for p in paths}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_check_finds_cycles() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_gateway_module_imports_itself_through_others() -> None:
    """The gateway's modules form no cycle (state owns the controller, the controller
    is handed what it needs and never imports state)."""
    edges = graph()
    # the graph is read
    assert "llmgw_cli.gateway.control.controller" in edges["llmgw_cli.gateway.control.state"]
    through_gateway = [c for c in cycles(edges) if any(m.startswith("llmgw_cli.gateway.") for m in c)]
    assert through_gateway == []


def test_progress_callbacks_sit_below_what_reports_through_them() -> None:
    """``progress`` declares what the fetcher reports (``FetchEvent``), so it imports none
    of the modules that report through it."""
    assert [c for c in cycles(graph()) if "llmgw_cli.progress" in c] == []
