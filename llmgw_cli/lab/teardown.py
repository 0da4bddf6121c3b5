"""Remove the lab: the inverse of ``cluster.up``, safe to repeat.

Works from ``lab.json`` when it is there and from the fixed names (netns ``lgw-node*``,
bridge ``lgwbr0``, cgroup ``lgw``) when it is not. Only processes in the lab's cgroup
are killed: the lab started all of them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from llmgw_cli.lab import host
from llmgw_cli.lab.host import sh
from llmgw_cli.progress import LineReport, quiet


def read_pid(path: Path) -> int:
    try:
        return int(path.read_text().strip() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def down(state_dir: Path, progress: LineReport = quiet) -> list[str]:
    """Remove everything ``up`` created; returns warnings about what could not be removed."""
    host.require_host()
    state = state_dir.resolve()
    record = host.load_record(state)
    warnings: list[str] = []
    cgroup = Path(record.cgroup) if record else host.cgroup_root() / host.CGROUP_NAME
    seen = {pid: _starttime(pid) for pid in host.cgroup_pids(cgroup)}
    for pidfile in state.glob("nodes/*/unshare.pid"):
        pid = read_pid(pidfile)
        if _is_node_init(pid):
            seen[pid] = _starttime(pid)
            os.kill(pid, signal.SIGKILL)
    for _ in range(100):
        pids = host.cgroup_pids(cgroup)
        if not pids:
            break
        for pid in pids:  # only processes the lab started live in its cgroup
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    else:
        warnings.append(f"processes still in {cgroup}: {host.cgroup_pids(cgroup)}")

    # killed nodes' PID 1s are zombies until the host's init reaps them: wait for that,
    # so that nothing of the lab is left when down returns
    def unreaped() -> list[int]:
        return [pid for pid, start in seen.items() if start is not None and _starttime(pid) == start]

    for _ in range(100):
        if not unreaped():
            break
        time.sleep(0.05)
    else:
        warnings.append(f"not reaped yet by the host's init: {unreaped()}")
    try:
        host.remove_cgroup(cgroup)
    except OSError as exc:
        warnings.append(f"could not remove {cgroup}: {exc}")
    for ns in host.netns_names():
        sh("ip", "netns", "del", ns, check=False)
    # A namespace's veth goes with it only when the kernel has finished with the namespace,
    # which it does in the background: delete the host ends (each takes its peer) and the
    # bridge now, and return only once they are gone, whatever faults downed them.
    for _ in range(100):
        links = host.lab_links()
        if not links:
            break
        for link in links:
            sh("ip", "link", "del", link, check=False)
        time.sleep(0.05)
    else:
        warnings.append(f"links still on the host: {', '.join(host.lab_links())}")
    if record and record.inotify_orig is not None:
        host.write_sysctl(host.INOTIFY, record.inotify_orig)
    warnings += _unmount_state(state)
    run_netns = Path("/run/netns")
    if host.is_mountpoint(run_netns) and not any(run_netns.iterdir()):
        sh("umount", str(run_netns), check=False)
        run_netns.rmdir()
    progress("lab removed")
    return warnings


def _starttime(pid: int) -> int | None:
    """The process's start time (clock ticks since boot): tells a PID from its reuse."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _is_node_init(pid: int) -> bool:
    try:
        return b"node-init.sh" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _unmount_state(state: Path) -> list[str]:
    if host.is_mountpoint(state):
        for _ in range(10):
            if sh("umount", str(state), check=False).returncode == 0:
                break
            time.sleep(0.1)
        else:
            sh("umount", "-l", str(state), check=False)
            return [f"{state} was busy; detached it lazily"]
    try:
        state.rmdir()
    except FileNotFoundError:
        pass
    except OSError:
        return [f"{state} is not empty; left it in place"]
    return []
