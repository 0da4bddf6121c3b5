"""What the lab needs from the host: checks, commands, sysctls, cgroups, the state record.

Names are fixed so that ``llmgw lab down`` can find everything even when the state
record is lost: bridge ``lgwbr0``, network namespaces ``lgw-nodeNN``, host-side veths
``lgwvN``, cgroup ``lgw``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from llmgw_cli.errors import LabError, LabUnavailable

SUBNET = "10.213.0"
BRIDGE = "lgwbr0"
NETNS_PREFIX = "lgw-"
CGROUP_NAME = "lgw"
INOTIFY = "fs.inotify.max_user_instances"
TOOLS = ("ip", "unshare", "nsenter", "mount", "umount", "mountpoint", "setsid", "ssh-keygen")
SSHD = Path("/usr/sbin/sshd")
SYSTEMD = Path("/lib/systemd/systemd")


class NodeRecord(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    index: int
    ip: str
    shape: str
    unshare_pid: int = 0
    pid1: int = 0


class LabRecord(BaseModel):
    """``lab.json`` in the state directory: written before anything is created, so a
    failed ``up`` can be undone by ``down``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    state_dir: str
    shape: str
    subnet: str = SUBNET
    bridge: str = BRIDGE
    cgroup: str
    inotify_orig: int | None = None
    nodes: list[NodeRecord]


def record_path(state_dir: Path) -> Path:
    return state_dir / "lab.json"


def save_record(record: LabRecord) -> None:
    path = record_path(Path(record.state_dir))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(record.model_dump_json(indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)


def load_record(state_dir: Path) -> LabRecord | None:
    try:
        return LabRecord.model_validate_json(record_path(state_dir).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None


def require_host() -> None:
    """Refuse early, with the reason, on a machine that cannot host the lab."""
    if not sys.platform.startswith("linux"):
        raise LabUnavailable(f"the lab needs Linux (namespaces, overlayfs); this is {sys.platform}")
    if os.geteuid() != 0:
        raise LabUnavailable("the lab needs root (network namespaces, mounts, cgroups); run it with sudo")
    missing = [t for t in TOOLS if shutil.which(t) is None]
    missing += [str(p) for p in (SSHD, SYSTEMD) if not p.exists()]
    if missing:
        raise LabUnavailable(
            f"missing on this machine: {', '.join(missing)} "
            "(install the packages listed in scripts/lab-packages.txt)"
        )
    cgroup_root()


def cgroup_root() -> Path:
    """The cgroup v2 hierarchy nodes are delegated from (pure v2, or hybrid's ``unified``)."""
    for path in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
        if (path / "cgroup.procs").exists() and (path / "cgroup.subtree_control").exists():
            return path
    raise LabUnavailable("no cgroup v2 hierarchy at /sys/fs/cgroup or /sys/fs/cgroup/unified")


def sh(*cmd: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run a host command; a failure is a LabError carrying its stderr."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise LabError(f"`{' '.join(cmd)}` did not finish in {timeout:.0f}s") from None
    if check and done.returncode != 0:
        raise LabError(f"`{' '.join(cmd)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done


def sysctl_path(name: str) -> Path:
    return Path("/proc/sys") / name.replace(".", "/")


def read_sysctl(name: str) -> int:
    return int(sysctl_path(name).read_text().split()[0])


def write_sysctl(name: str, value: int) -> None:
    sysctl_path(name).write_text(f"{value}\n")


def is_mountpoint(path: Path) -> bool:
    return subprocess.run(["mountpoint", "-q", str(path)], check=False).returncode == 0


VETH_PREFIX = "lgwv"


def lab_links() -> list[str]:
    """The lab's network links on the host that exist now: its bridge and the host-side
    veths of its nodes."""
    found = sorted(p.name for p in Path("/sys/class/net").glob(f"{VETH_PREFIX}*"))
    return ([BRIDGE] if Path(f"/sys/class/net/{BRIDGE}").exists() else []) + found


def leftovers() -> list[str]:
    """What a lab leaves on the host besides its state folder (links, namespaces), named."""
    return lab_links() + [f"netns {n}" for n in netns_names()]


def netns_names() -> list[str]:
    """The lab's network namespaces that exist now."""
    done = sh("ip", "netns", "list", check=False)
    names = [line.split()[0] for line in done.stdout.splitlines() if line.strip()]
    return [n for n in names if n.startswith(NETNS_PREFIX + "node")]


def cgroup_pids(cgroup: Path) -> list[int]:
    """Every process in ``cgroup`` and below."""
    pids: list[int] = []
    if not cgroup.is_dir():
        return pids
    for procs in cgroup.rglob("cgroup.procs"):
        try:
            pids += [int(p) for p in procs.read_text().split()]
        except OSError:
            continue
    return pids


def remove_cgroup(cgroup: Path) -> None:
    """rmdir the tree bottom-up (cgroup dirs are removed with rmdir, never rm -r)."""
    if not cgroup.is_dir():
        return
    for d in sorted((p for p in cgroup.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        try:
            d.rmdir()
        except OSError:
            continue
    cgroup.rmdir()
