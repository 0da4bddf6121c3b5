"""Architecture measurements of llmgw_cli/: sizes, duplicates, import circles, layering,
and (with --trace) how one `llmgw` command moves between modules while it runs.

Run through scripts/architecture-report. tests/test_architecture.py loads this file for
the import graph and the layer order, so the test and the report judge the same way.

Layers, lowest first; a module may import (and call) its own layer and the ones below:
    node < foundation (errors, progress, polling, the root package) < core < remote
    < gateway < cli (with __main__)
node/ runs on a node as root: it imports only the standard library and itself. lab/ is
tooling, outside the order: it may import every layer but cli, and only cli (and lab)
may import it. A sub-package (core/observe/parse/, gateway/serving/...) is in its top package's
layer.
"""

from __future__ import annotations

import argparse
import ast
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "llmgw_cli"
LIMIT_LINES = 1000
TOOLING = "lab"
LAYERS: dict[str, int] = {
    "node": 0,
    "errors": 1,
    "progress": 1,
    "polling": 1,
    "": 1,  # the root package itself (its __init__: the version)
    "core": 2,
    "remote": 3,
    "gateway": 4,
    "cli": 5,
    "__main__": 5,
}
LAYER_NAMES = {0: "node", 1: "foundation", 2: "core", 3: "remote", 4: "gateway", 5: "cli"}


def top_of(module: str) -> str:
    """The top-level part of an llmgw_cli module name: 'core' for llmgw_cli.core.observe.parse.x."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_of(module: str) -> int | None:
    """The module's layer; None for lab (tooling) and anything outside the order."""
    return LAYERS.get(top_of(module))


# ---------------------------------------------------------------- modules and imports


def module_files(root: Path) -> dict[str, Path]:
    """Every module of the package below root, by dotted name."""
    found: dict[str, Path] = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


@dataclass(frozen=True)
class Import:
    target: str  # a dotted name as written, resolved to absolute
    names: tuple[str, ...]  # for `from X import a, b`: a, b; else empty
    line: int
    type_only: bool  # under `if TYPE_CHECKING:`: never runs


def _imports(tree: ast.Module, module: str, is_package: bool) -> Iterator[Import]:
    """Every import statement in the module, those inside functions and under
    TYPE_CHECKING too: each is a dependency of the design, whenever it runs."""
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body
        for inner in ast.walk(stmt)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(alias.name, (), node.lineno, id(node) in typing_only)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join([*package, base] if base else package)
            yield Import(base, tuple(a.name for a in node.names), node.lineno, id(node) in typing_only)


def _resolve(imp: Import, modules: dict[str, Path]) -> set[str]:
    """The llmgw_cli modules an import statement names: `from pkg import sub` names the
    module pkg.sub when there is one, else pkg itself."""
    if imp.target != PACKAGE and not imp.target.startswith(PACKAGE + "."):
        return set()
    hits = {f"{imp.target}.{name}" for name in imp.names if f"{imp.target}.{name}" in modules}
    if len(hits) < len(imp.names) or not imp.names:
        target = imp.target
        while target not in modules and "." in target:
            target = target.rsplit(".", 1)[0]
        hits.add(target)
    return hits


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    type_only: bool


def import_edges(root: Path = REPO) -> tuple[dict[str, Path], list[Edge], dict[str, list[Import]]]:
    """The package's modules, the import edges between them, and each module's imports
    from outside the package (for node/'s stdlib-only rule)."""
    modules = module_files(root)
    edges: list[Edge] = []
    outside: dict[str, list[Import]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        for imp in _imports(tree, name, path.name == "__init__.py"):
            targets = _resolve(imp, modules)
            if not targets and not imp.target.startswith(PACKAGE):
                outside.setdefault(name, []).append(imp)
            edges.extend(Edge(name, t, imp.line, imp.type_only) for t in sorted(targets) if t != name)
    return modules, edges, outside


def circles(modules: dict[str, Path], edges: list[Edge]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), largest first."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for e in edges:
        graph[e.source].add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(found, key=lambda c: (-len(c), c))


def layer_violation(source: str, target: str) -> str | None:
    """Why importing target from source breaks the layer order, or None."""
    s_top, t_top = top_of(source), top_of(target)
    if t_top == TOOLING and s_top not in (TOOLING, "cli", "__main__"):
        return "only cli and lab may import lab (tooling)"
    if s_top == TOOLING:
        return "lab (tooling) may not import cli" if t_top in ("cli", "__main__") else None
    if s_top == "node" and t_top != "node":
        return "node/ imports only the standard library and node/"
    s_layer, t_layer = layer_of(source), layer_of(target)
    if s_layer is not None and t_layer is not None and t_layer > s_layer:
        return f"{LAYER_NAMES[s_layer]} imports the higher layer {LAYER_NAMES[t_layer]}"
    return None


def layer_violations(edges: list[Edge]) -> list[tuple[Edge, str]]:
    return [(e, why) for e in edges if (why := layer_violation(e.source, e.target))]


def node_outside_imports(outside: dict[str, list[Import]]) -> list[tuple[str, Import]]:
    """Imports in node/ of anything that is neither the standard library nor node/."""
    return [
        (module, imp)
        for module, imps in sorted(outside.items())
        if top_of(module) == "node"
        for imp in imps
        if imp.target.split(".")[0] not in sys.stdlib_module_names and imp.target != "__future__"
    ]


# ---------------------------------------------------------------- sizes and duplicates


def line_count(path: Path) -> int:
    return len(path.read_text().splitlines())


def lines_per_folder(modules: dict[str, Path], root: Path = REPO) -> dict[str, int]:
    """Physical lines (blank and comment lines included) of every folder, recursively."""
    totals: dict[str, int] = {}
    for path in modules.values():
        n = line_count(path)
        for folder in path.relative_to(root).parents:
            if str(folder) != ".":
                totals[str(folder)] = totals.get(str(folder), 0) + n
    return dict(sorted(totals.items()))


def largest_classes(modules: dict[str, Path], root: Path = REPO, most: int = 10) -> list[tuple[str, int]]:
    found = []
    for path in modules.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                found.append((f"{path.relative_to(root)}:{node.lineno} {node.name}", size))
    return sorted(found, key=lambda x: -x[1])[:most]


def duplicates(root: Path = REPO) -> dict[str, Any]:
    """Identical runs of 6+ lines as the `duplicates` command lists them: its rows not
    marked `shape` (a shape row shares no run to the letter)."""
    tool = shutil.which("duplicates")
    if tool is None:
        return {"available": False, "how": "the `duplicates` command is not on PATH"}
    command = [tool, "--repo", str(root / PACKAGE), "--most", "200", "--min-lines", "6", "--seconds", "120"]
    out = subprocess.run(command, capture_output=True, text=True, check=False).stdout.splitlines()
    rows = [line for line in out if line[:1] == "D" and line[1:2].isdigit()]
    identical = [r for r in rows if " shape" not in r]
    return {
        "available": True,
        "how": f"`{' '.join(['duplicates', *command[1:]])}`: rows without the word `shape`",
        "summary": out[0] if out else "",
        "identical": len(identical),
        "identical_rows": identical,
        "shape_rows": len(rows) - len(identical),
        "notes": [line for line in out if line.startswith(("(+", "left out:", "incomplete:"))],
    }


def static_report(root: Path = REPO) -> dict[str, Any]:
    modules, edges, outside = import_edges(root)
    sizes = sorted(((str(p.relative_to(root)), line_count(p)) for p in modules.values()), key=lambda x: -x[1])
    return {
        "lines_per_folder": lines_per_folder(modules, root),
        "modules": len(modules),
        "largest_files": sizes[:10],
        "largest_classes": largest_classes(modules, root),
        "duplicates": duplicates(root),
        "import_circles": circles(modules, edges),
        "import_circles_at_run_time": circles(modules, [e for e in edges if not e.type_only]),
        "layer_violations": [
            {"from": e.source, "to": e.target, "line": e.line, "type_only": e.type_only, "why": why}
            for e, why in layer_violations(edges)
        ],
        "node_outside_imports": [
            {"module": m, "import": i.target, "line": i.line} for m, i in node_outside_imports(outside)
        ],
        "over_1000_lines": [(f, n) for f, n in sizes if n > LIMIT_LINES],
    }


def print_static(r: dict[str, Any]) -> None:
    print(f"== lines per folder (physical lines of .py files, recursive; {r['modules']} modules)")
    for folder, n in r["lines_per_folder"].items():
        print(f"  {n:7d}  {folder}/")
    print("== 10 largest files (lines)")
    for f, n in r["largest_files"]:
        print(f"  {n:7d}  {f}")
    print("== 10 largest classes (lines from `class` to its last line)")
    for c, n in r["largest_classes"]:
        print(f"  {n:7d}  {c}")
    d = r["duplicates"]
    print("== identical duplicate runs of 6+ lines")
    if not d["available"]:
        print(f"  not measured: {d['how']}")
    else:
        print(f"  {d['identical']} identical pairs (counted: {d['how']}); {d['shape_rows']} shape-only rows")
        print(f"  tool said: {d['summary']}")
        for row in d["identical_rows"] + d["notes"]:
            print(f"    {row}")
    print(f"== import circles (strongly connected components > 1 module): {len(r['import_circles'])}")
    print("   (every import counts: module level, inside functions, under TYPE_CHECKING)")
    for c in r["import_circles"]:
        print(f"  {len(c)} modules: {' '.join(c)}")
    print(f"   of those, without the imports under TYPE_CHECKING: {len(r['import_circles_at_run_time'])}")
    for c in r["import_circles_at_run_time"]:
        print(f"  {len(c)} modules: {' '.join(c)}")
    print(f"== imports against the layer order: {len(r['layer_violations'])}")
    for v in r["layer_violations"]:
        kind = ", under TYPE_CHECKING" if v["type_only"] else ""
        print(f"  {v['from']}:{v['line']} -> {v['to']}  ({v['why']}{kind})")
    print(f"== node/ imports outside the standard library and node/: {len(r['node_outside_imports'])}")
    for v in r["node_outside_imports"]:
        print(f"  {v['module']}:{v['line']} -> {v['import']}")
    print(f"== modules over {LIMIT_LINES} lines: {len(r['over_1000_lines'])}")
    for f, n in r["over_1000_lines"]:
        print(f"  {n:7d}  {f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="one JSON object instead of text")
    parser.add_argument(
        "--trace", action="store_true", help="run `llmgw ARGS` (after --) in-process and trace it"
    )
    parser.add_argument(
        "--from", dest="start", help="with --trace: count only inside this function (module:qualname)"
    )
    parser.add_argument("--show", type=Path, help="print a trace saved with --trace --json as text")
    parser.add_argument("llmgw_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if args.show:
        from architecture_trace import print_trace  # noqa: PLC0415

        print_trace(json.loads(args.show.read_text()))
        return
    if args.trace:
        from architecture_trace import print_trace, trace_command  # noqa: PLC0415

        llmgw_args = args.llmgw_args[1:] if args.llmgw_args[:1] == ["--"] else args.llmgw_args
        result = trace_command(llmgw_args, args.start)
        print(json.dumps(result, indent=2)) if args.json else print_trace(result)
        return
    report = static_report()
    print(json.dumps(report, indent=2)) if args.json else print_static(report)


if __name__ == "__main__":
    main()
