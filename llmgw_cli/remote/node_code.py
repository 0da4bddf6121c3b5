"""The code that runs on nodes, as the control host ships it: the one place that reads
the sources of ``llmgw_cli/node/`` (``node/__init__.py`` describes the package, its
verbs and how it is shipped). ``remote/node_access.py`` installs these texts on every
node; ``remote/fetch.py`` pipes them to ``python3`` where nothing is installed yet.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from importlib import resources

from llmgw_cli import node as node_package


def _ours(node: ast.stmt) -> bool:
    """An import the joined source must not run: of the package itself (its names are
    in the one namespace already) or ``__future__`` (valid only at the top)."""
    if not isinstance(node, ast.ImportFrom):
        return False
    module = node.module or ""
    return node.level > 0 or module == "__future__" or module.startswith(f"{node_package.__name__}.")


def joined_source(sources: Sequence[tuple[str, str]]) -> str:
    """``(module name, source)`` pairs as one program for ``python3``: each module's text
    in order, its imports of the package and of ``__future__`` dropped, one
    ``from __future__`` first (``node/__init__.py`` says why)."""
    parts = ["from __future__ import annotations\n"]
    for name, text in sources:
        drop = {
            line
            for stmt in ast.parse(text).body
            if _ours(stmt)
            for line in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1)
        }
        kept = (line for number, line in enumerate(text.splitlines(keepends=True), 1) if number not in drop)
        parts.append(f"\n# --- {name}.py ---\n\n{''.join(kept)}")
    return "".join(parts)


_SOURCES = resources.files(node_package)
HELPER_SOURCE = _SOURCES.joinpath("helper.py").read_text(encoding="utf-8")
"""The node helper, shipped alone."""
NODEFETCH_SOURCE = joined_source(
    [(m, _SOURCES.joinpath(f"{m}.py").read_text(encoding="utf-8")) for m in node_package.FETCHER_MODULES]
)
"""The weights fetcher: installed as ``nodefetch.py`` and piped to ``python3 -``."""
