"""The lab cluster for integration tests: booted once per session with `llmgw lab up`.

The ``lab`` fixture tears down a stale lab first (a crashed run), boots four hgx nodes,
exposes their names, addresses, the client key, known_hosts and ssh_config, and runs
`llmgw lab down` at the end. Tests that boot their own lab (test_lab_lifecycle.py) run
first, before the session lab exists: only one lab fits on a machine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

STATE = Path(os.environ.get("LLMGW_LAB_STATE", "/var/lib/llmgw-lab"))
NODES = int(os.environ.get("LLMGW_LAB_NODES", "4"))


def lab_unavailable() -> str | None:
    """Why the lab cannot run here, or None."""
    if not sys.platform.startswith("linux"):
        return f"the lab needs Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return "the lab needs root (namespaces, mounts, cgroups)"
    for tool in ("ssh", "ssh-keygen", "ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} is missing (install scripts/lab-packages.txt)"
    for path in ("/usr/sbin/sshd", "/lib/systemd/systemd"):
        if not Path(path).exists():
            return f"{path} is missing (install scripts/lab-packages.txt)"
    return None


def llmgw(*args: str, check: bool = True, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """Run the real CLI in a subprocess, as a user would."""
    done = subprocess.run(
        [sys.executable, "-m", "llmgw_cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if check and done.returncode != 0:
        raise AssertionError(
            f"llmgw {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
        )
    return done


@dataclass(frozen=True)
class LabNode:
    name: str
    index: int
    ip: str
    pid1: int


@dataclass(frozen=True)
class Lab:
    state: Path
    nodes: list[LabNode]
    key: Path
    known_hosts: Path
    ssh_config: Path
    cluster_file: Path

    def ssh(
        self, node: str, command: str, *, timeout: float = 60, opts: tuple[str, ...] = ()
    ) -> subprocess.CompletedProcess[str]:
        """Run ``command`` on ``node`` with the real ssh client and the lab's ssh_config."""
        return subprocess.run(
            ["ssh", "-F", str(self.ssh_config), *opts, node, command],
            capture_output=True, text=True, timeout=timeout, check=False,
        )  # fmt: skip

    def fault(self, node: str, *args: str) -> None:
        llmgw("lab", "fault", node, *args, "--state", str(self.state))


@pytest.fixture(scope="session")
def lab() -> Iterator[Lab]:
    reason = lab_unavailable()
    if reason:
        pytest.skip(reason)
    llmgw("lab", "down", "--state", str(STATE), check=False)  # a stale lab from a crashed run
    llmgw("lab", "up", "--nodes", str(NODES), "--state", str(STATE))
    try:
        record = json.loads((STATE / "lab.json").read_text())
        nodes = [LabNode(n["name"], n["index"], n["ip"], n["pid1"]) for n in record["nodes"]]
        yield Lab(
            state=STATE,
            nodes=nodes,
            key=STATE / "id_ed25519",
            known_hosts=STATE / "known_hosts",
            ssh_config=STATE / "ssh_config",
            cluster_file=STATE / "cluster.yaml",
        )
    finally:
        llmgw("lab", "down", "--state", str(STATE))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that boot their own lab go first, before the session lab is up."""
    items.sort(key=lambda item: 0 if item.path.name == "test_lab_lifecycle.py" else 1)
