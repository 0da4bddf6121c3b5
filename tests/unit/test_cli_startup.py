"""`llmgw` starts at once: building the command line loads none of what only some commands
need (SSH, HTTP, the gateway's server and metrics, templates, the database drivers), and
`validate` loads only what reading a cluster file takes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from llmgw_cli.core.hosts import gateway_install, paths
from llmgw_cli.core.hosts.units import GATEWAY_DIR

ROOT = Path(__file__).resolve().parents[2]

# What a command loads when it runs, never when llmgw starts.
HEAVY = {
    "aiohttp",
    "asyncpg",
    "asyncssh",
    "httptools",
    "httpx",
    "jinja2",
    "prometheus_client",
    "pydantic",
    "rich",
    "yaml",
}


def loaded(code: str) -> list[str]:
    """The heavy top-level packages in sys.modules after running ``code`` in a fresh python."""
    probe = (
        f"{code}\nimport json, sys\n"
        f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({sorted(HEAVY)!r}))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT, timeout=60
    )
    names: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return names


@pytest.mark.parametrize("library", ["aiohttp", "asyncssh", "prometheus_client"])
def test_building_the_command_line_loads_neither_ssh_nor_the_gateway(library: str) -> None:
    assert library not in loaded("import llmgw_cli.cli.main")


def test_building_the_command_line_loads_no_heavy_library_at_all() -> None:
    # typer builds every command (and reads every option) at start: all of them, not
    # only the one that runs, so none of them may import more than typer at its top
    assert (
        loaded("import llmgw_cli.cli.main, typer.main\ntyper.main.get_command(llmgw_cli.cli.main.app)") == []
    )


def test_version_loads_nothing_heavy() -> None:
    code = (
        "import sys\nsys.argv = ['llmgw', '--version']\nfrom llmgw_cli.cli.main import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass"
    )
    assert loaded(code) == []


def test_validate_loads_what_reading_a_cluster_file_takes_and_no_more() -> None:
    code = (
        "import sys\nsys.argv = ['llmgw', 'validate', '-f', 'inventories/single-box.yaml']\n"
        "from llmgw_cli.cli.main import main\ntry:\n    main()\nexcept SystemExit:\n    pass"
    )
    assert loaded(code) == ["pydantic", "rich", "yaml"]


def test_the_paths_the_options_name_are_those_the_core_writes() -> None:
    # core/hosts/paths.py imports nothing, so it holds these paths as text of its own
    assert f"{GATEWAY_DIR}/engine-keys.json" == paths.ENGINE_KEYS_FILE
    assert gateway_install.GATEWAY_DIR == GATEWAY_DIR
