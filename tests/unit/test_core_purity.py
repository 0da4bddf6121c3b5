import ast
import subprocess
import sys
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "llmgw_cli" / "core"

# What the core must not use: SSH, HTTP (client, server, parser), terminal and CLI
# libraries, the event loop, metrics, the database, processes, sockets and the Hub's client.
FORBIDDEN = {
    "asyncssh",
    "httpx",
    "aiohttp",
    "httptools",
    "rich",
    "typer",
    "asyncio",
    "prometheus_client",
    "sqlite3",
    "subprocess",
    "socket",
    "huggingface_hub",
}
# Standard modules that the core's own dependencies load (pydantic's plugin loader reads
# package metadata, which imports `socket` through `email`): forbidden in the core's own
# imports, but they may be in sys.modules after importing it.
LOADED_BY_DEPENDENCIES = {"socket"}


def test_core_imports_no_io_libraries() -> None:
    """The core stays pure: importing all of it pulls in no forbidden library."""
    code = (
        "import sys, pkgutil, importlib, llmgw_cli.core as core\n"
        "for m in pkgutil.walk_packages(core.__path__, 'llmgw_cli.core.'): importlib.import_module(m.name)\n"
        f"io = {sorted(FORBIDDEN - LOADED_BY_DEPENDENCIES)!r}\n"
        "bad = sorted({n.split('.')[0] for n in sys.modules} & set(io))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_core_sources_import_no_io_library() -> None:
    """No module of the core names a forbidden library in an import, at any depth of the
    code (a function-local import counts too)."""
    found = []
    for path in sorted(CORE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            found += [
                f"{path.relative_to(CORE)}:{node.lineno} {n}" for n in names if n.split(".")[0] in FORBIDDEN
            ]
    assert found == []
