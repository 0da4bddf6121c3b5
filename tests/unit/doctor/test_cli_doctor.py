"""`llmgw doctor` input errors: exit 2 with a message, before any node is contacted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_unknown_node_in_nodes_is_a_usage_error() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "llmgw_cli", "doctor", "-f", str(ROOT / "inventories/hgx-two-fabrics.yaml"),
         "--nodes", "nosuchnode"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--nodes: no node nosuchnode" in done.stderr
    assert "Traceback" not in done.stderr
