"""The lab cluster for integration tests: booted once per session with `llmgw lab up`.

The ``lab`` fixture (defined in ``tests/conftest.py``, so that ``tests/security`` shares
the same session lab) tears down a stale lab first (a crashed run), boots four hgx nodes,
exposes their names, addresses, the client key, known_hosts and ssh_config, and runs
`llmgw lab down` at the end. Tests that boot their own lab (test_lab_lifecycle.py) run
first, before the session lab exists: only one lab fits on a machine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

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
