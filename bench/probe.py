#!/usr/bin/env python3
"""Probe wall time on the lab: llmgw's one-script-per-node probe against Ansible's `setup`
fact gathering, on the same lab nodes, in the same run.

Run as root on a machine where no lab is up (it boots its own and takes it down):
    .venv/bin/python bench/probe.py --sizes 8,16,32 --runs 5 --ansible /path/to/ansible-venv/bin/ansible
ansible-core comes from PyPI: python3 -m venv /opt/ansible && /opt/ansible/bin/pip install ansible-core
Prints one markdown row per size: medians (and min-max) of `gather()` and of
`ansible all -m setup`, both with one fork/connection per node.

With `--status`, instead: the whole `llmgw status` command (a process of its own: the
interpreter's start, the imports, the cluster file, the probe, the tables) against
bench/minimal_probe.py (a process of its own that connects with asyncssh and sends each
node the same probe script, nothing else), runs alternating, on the largest size:
    .venv/bin/python bench/probe.py --status --sizes 32 --runs 11
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.observe.parse.probe import probe_script
from llmgw_cli.remote.connect import Connections, resolve_path
from llmgw_cli.remote.probe import Snapshot, gather

STATE = Path("/var/lib/llmgw-bench-lab")


def llmgw(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "llmgw_cli", *args], check=True, capture_output=True, timeout=600)


def time_llmgw(spec_path: Path, nodes: list[str], runs: int) -> list[float]:
    spec = parse_cluster(spec_path.read_text())

    async def probe() -> Snapshot:  # new connections each run, as `llmgw status` opens them
        async with Connections(spec, spec_path.parent) as conns:
            return await gather(spec, conns, nodes)

    times = []
    for _ in range(runs):
        started = time.perf_counter()
        snapshot = asyncio.run(probe())
        times.append(time.perf_counter() - started)
        failed = [n.node for n in snapshot.nodes if not n.reachable]
        if failed:
            raise SystemExit(f"probe failed on {failed}")
    return times


def time_ansible(ansible: str, ssh_config: Path, nodes: list[str], runs: int) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        inventory = Path(tmp) / "hosts.ini"
        inventory.write_text("[lab]\n" + "\n".join(nodes) + "\n")
        env = {
            **os.environ,
            "ANSIBLE_HOST_KEY_CHECKING": "True",
            "ANSIBLE_PIPELINING": "True",
            "ANSIBLE_SSH_ARGS": f"-F {ssh_config} -o ControlMaster=auto -o ControlPersist=60s",
            "ANSIBLE_PYTHON_INTERPRETER": "/usr/bin/python3",
            "ANSIBLE_LOCAL_TEMP": tmp,
            "ANSIBLE_REMOTE_TEMP": "/tmp/.ansible-bench",
        }
        times = []
        for _ in range(runs):
            started = time.perf_counter()
            done = subprocess.run(
                [ansible, "lab", "-i", str(inventory), "-m", "setup", "-f", str(len(nodes)), "-u", "root"],
                capture_output=True,
                text=True,
                env=env,
                timeout=600,
            )
            times.append(time.perf_counter() - started)
            if done.returncode != 0:
                raise SystemExit(f"ansible failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        return times


def status_against_minimal(cluster: Path, runs: int) -> tuple[list[float], list[float]]:
    """Wall times of `llmgw status` and of the minimal asyncssh probe of the same nodes,
    each a fresh process, alternating so both see the same machine."""
    spec = parse_cluster(cluster.read_text())
    targets = []
    for node in spec.nodes:
        ssh = spec.ssh_for(node)
        assert ssh.identity_file is not None
        targets.append(
            {
                "host": node.address,
                "port": ssh.port,
                "user": ssh.user,
                "key": str(resolve_path(ssh.identity_file, cluster.parent)),
                "known_hosts": str(resolve_path(ssh.known_hosts, cluster.parent)),
                "script": probe_script(spec, node),
            }
        )
    minimal = Path(__file__).resolve().parent / "minimal_probe.py"
    env = {**os.environ, "COLUMNS": "160"}
    with tempfile.TemporaryDirectory() as tmp:
        listing = Path(tmp) / "targets.json"
        listing.write_text(json.dumps(targets))
        commands = {
            "status": [sys.executable, "-m", "llmgw_cli", "status", "-f", str(cluster)],
            "minimal": [sys.executable, str(minimal), str(listing)],
        }
        times: dict[str, list[float]] = {"status": [], "minimal": []}
        for run in range(runs + 1):
            for name, command in commands.items() if run % 2 else reversed(commands.items()):
                started = time.perf_counter()
                done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
                took = time.perf_counter() - started
                if done.returncode != 0:
                    raise SystemExit(
                        f"{name} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
                    )
                if run:  # the first round warms the page cache for both
                    times[name].append(took)
    return times["status"], times["minimal"]


def fmt(times: list[float]) -> str:
    return f"{statistics.median(times):.2f} s ({min(times):.2f}-{max(times):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="8,16,32")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--ansible", default="ansible")
    parser.add_argument("--status", action="store_true", help="llmgw status against a minimal asyncssh probe")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    llmgw("lab", "down", "--state", str(STATE))
    llmgw("lab", "up", "--nodes", str(max(sizes)), "--state", str(STATE))
    try:
        cluster = STATE / "cluster.yaml"
        if args.status:
            ours, minimal = status_against_minimal(cluster, args.runs)
            ratio = statistics.median(ours) / statistics.median(minimal)
            print(
                "| nodes | llmgw status (median, min-max) | minimal asyncssh probe (median, min-max) | ratio |"
            )
            print("|---|---|---|---|")
            print(f"| {max(sizes)} | {fmt(ours)} | {fmt(minimal)} | {ratio:.2f}x |")
            return
        names = [n.name for n in parse_cluster(cluster.read_text()).nodes]
        print("| nodes | llmgw probe (median, min-max) | ansible setup (median, min-max) | ratio |")
        print("|---|---|---|---|")
        for size in sizes:
            chosen = names[:size]
            ours = time_llmgw(cluster, chosen, args.runs)
            theirs = time_ansible(args.ansible, STATE / "ssh_config", chosen, max(3, args.runs // 2))
            ratio = statistics.median(theirs) / statistics.median(ours)
            print(f"| {size} | {fmt(ours)} | {fmt(theirs)} | {ratio:.1f}x |", flush=True)
    finally:
        llmgw("lab", "down", "--state", str(STATE))


if __name__ == "__main__":
    main()
