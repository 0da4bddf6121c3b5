"""The code that runs on nodes stands alone: standard library only, nothing of llmgw
outside ``llmgw_cli/node/``; the helper ships as one file and the fetcher as its modules
joined into one, so each must still work as that one file."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import llmgw_cli.node as node_package
from llmgw_cli.node import fetch_main, helper
from llmgw_cli.remote.node_code import HELPER_SOURCE, NODEFETCH_SOURCE, joined_source

NODE = Path(node_package.__file__).parent
MODULES = sorted(NODE.glob("*.py"))
PACKAGE = "llmgw_cli.node"


def imported(path: Path) -> list[str]:
    """Every module ``path`` imports (a relative import as the module it names)."""
    names = []
    for stmt in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(stmt, ast.Import):
            names += [alias.name for alias in stmt.names]
        elif isinstance(stmt, ast.ImportFrom):
            names.append(f"{PACKAGE}.{stmt.module or ''}" if stmt.level else stmt.module or "")
    return names


def foreign(name: str) -> bool:
    """Neither the standard library nor the node package."""
    return (
        name != PACKAGE
        and not name.startswith(f"{PACKAGE}.")
        and (name.partition(".")[0] not in sys.stdlib_module_names and name != "__future__")
    )


def test_every_node_module_is_looked_at() -> None:
    names = {p.stem for p in MODULES}
    assert {"__init__", "helper", *node_package.FETCHER_MODULES} == names


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_a_node_module_imports_the_standard_library_and_the_node_package_only(path: Path) -> None:
    assert [name for name in imported(path) if foreign(name)] == []


def test_the_check_sees_a_foreign_import() -> None:
    assert foreign("llmgw_cli.core.weights.snapshot")
    assert foreign("llmgw_cli")
    assert foreign("yaml")
    assert not foreign("json") and not foreign("http.server") and not foreign(f"{PACKAGE}.fetch_disk")


def test_the_helper_ships_alone() -> None:
    """Installed as one file: an import of a sibling would fail on the node."""
    assert [name for name in imported(NODE / "helper.py") if name.startswith(PACKAGE)] == []
    assert (NODE / "helper.py").read_text(encoding="utf-8") == HELPER_SOURCE


def top_level_names(text: str) -> set[str]:
    names: set[str] = set()
    for stmt in ast.parse(text).body:
        if isinstance(stmt, ast.FunctionDef | ast.ClassDef):
            names.add(stmt.name)
        elif isinstance(stmt, ast.Assign):
            names |= {t.id for t in stmt.targets if isinstance(t, ast.Name)}
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            names.add(stmt.target.id)
    return names


def test_no_two_fetcher_modules_define_one_name() -> None:
    """Joined, they share one namespace: a second definition would replace the first."""
    seen: dict[str, str] = {}
    for module in node_package.FETCHER_MODULES:
        for name in top_level_names((NODE / f"{module}.py").read_text(encoding="utf-8")):
            assert name not in seen, f"{name} is defined in {seen.get(name)} and {module}"
            seen[name] = module


def test_the_joined_fetcher_runs_without_the_package() -> None:
    """Run as the node runs it: ``python3 -I -``, nothing of llmgw importable."""
    script = NODEFETCH_SOURCE + "\nimport sys\nprint(sorted(MODES), VERSION, 'llmgw_cli' in sys.modules)\n"
    done = subprocess.run(
        [sys.executable, "-I", "-"], input=script, text=True, capture_output=True, cwd="/", check=True
    )
    assert done.stdout.split("]")[1].split() == [str(node_package.VERSION), "False"]
    assert "from llmgw_cli" not in NODEFETCH_SOURCE


def test_joining_drops_the_packages_imports_and_keeps_the_rest() -> None:
    first = '"""A."""\n\nfrom __future__ import annotations\n\nimport os\n\nA = os.sep\n'
    second = (
        '"""B."""\n\nfrom __future__ import annotations\n\nfrom llmgw_cli.node.a import (\n    A,\n)\n'
        "from .a import A\n\nC = A + A\n"
    )
    text = joined_source([("a", first), ("b", second)])
    namespace: dict[str, object] = {}
    exec(compile(text, "joined", "exec"), namespace)
    assert text.startswith("from __future__ import annotations\n")
    assert text.count("__future__") == 1
    assert "llmgw_cli" not in text and "from .a" not in text
    assert "import os" in text and namespace["C"] == "//"


def test_the_interface_version_travels_in_both_programs() -> None:
    """A change of VERSION changes the shipped texts, so apply installs them again."""
    assert helper.VERSION == fetch_main.VERSION == node_package.VERSION
    assert f"VERSION = {node_package.VERSION}" in HELPER_SOURCE
    assert f"VERSION = {node_package.VERSION}" in NODEFETCH_SOURCE
