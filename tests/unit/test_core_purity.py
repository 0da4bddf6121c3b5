import subprocess
import sys


def test_core_imports_no_io_libraries() -> None:
    """The core stays pure: importing all of it pulls in no SSH, HTTP, terminal or CLI library."""
    code = (
        "import sys, pkgutil, importlib, llmgw_cli.core as core\n"
        "for m in pkgutil.walk_packages(core.__path__, 'llmgw_cli.core.'): importlib.import_module(m.name)\n"
        "io = {'asyncssh', 'httpx', 'rich', 'typer', 'asyncio'}\n"
        "bad = sorted({n.split('.')[0] for n in sys.modules} & io)\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
