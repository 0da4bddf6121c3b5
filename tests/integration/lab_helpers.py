"""Shared steps for tests that drive llmgw against the lab cluster."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from .conftest import Lab

RESET_UNITS = (
    "systemctl stop 'llmgw-*' 2>/dev/null; rm -f /etc/systemd/system/llmgw-*.service; "
    "systemctl daemon-reload; systemctl reset-failed 2>/dev/null; rm -f /etc/llmgw/engine.env; true"
)


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmgw_cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def reset(lab: Lab) -> None:
    """Heal every fault and remove every llmgw unit, so each test starts from a clean lab."""
    for node in lab.nodes:
        lab.fault(node.name, "clear")
    for node in lab.nodes:
        lab.ssh(node.name, RESET_UNITS)


def cluster_variant(
    lab: Lab, folder: Path, edit: str = "", replace: tuple[tuple[str, str], ...] = ()
) -> Path:
    """A copy of the lab's cluster file with text replaced (key paths are absolute)."""
    text = lab.cluster_file.read_text()
    for old, new in replace:
        assert old in text, old
        text = text.replace(old, new)
    path = folder / "cluster.yaml"
    path.write_text(text + edit)
    return path


def status(cluster: Path) -> dict[str, Any]:
    done = run("status", "-f", str(cluster), "--json")
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def node_row(report: dict[str, Any], name: str) -> dict[str, Any]:
    return dict(next(n for n in report["nodes"] if n["name"] == name))


def unit_props(lab: Lab, node: str, unit: str) -> dict[str, str]:
    done = lab.ssh(node, f"systemctl show -p MainPID,NRestarts,ActiveState,Environment {unit}")
    return dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)


def llmgw_units(lab: Lab) -> dict[str, list[str]]:
    out = {}
    for node in lab.nodes:
        done = lab.ssh(node.name, "ls /etc/systemd/system/ | grep '^llmgw-' || true")
        out[node.name] = sorted(done.stdout.split())
    return out
