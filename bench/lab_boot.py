"""Boot time and memory of the lab: `llmgw lab up` / `down`, N nodes, a few runs each.

    sudo .venv/bin/python bench/lab_boot.py --nodes 4 32 --runs 3

For each run: wall time of `llmgw lab up` (returns when every node's systemd reports
running), PSS of every process in the lab's cgroup (from /proc/PID/smaps_rollup),
tmpfs in use (the state tmpfs holding the nodes' upper layers, plus each node's own
/run, /tmp and /dev/shm), and the wall time of `llmgw lab down`. Prints medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

STATE = Path("/var/lib/llmgw-lab")


def llmgw(*args: str) -> float:
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "llmgw_cli", *args], check=True, capture_output=True)
    return time.monotonic() - t0


def pss_kib(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total


def used_kib(path: Path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize // 1024


def measure(n: int) -> dict[str, float]:
    llmgw("lab", "down", "--state", str(STATE))
    boot = llmgw("lab", "up", "--nodes", str(n), "--state", str(STATE))
    record = json.loads((STATE / "lab.json").read_text())
    cgroup = Path(record["cgroup"])
    pids = [int(p) for f in cgroup.rglob("cgroup.procs") for p in f.read_text().split()]
    node_tmpfs = sum(
        used_kib(Path(f"/proc/{node['pid1']}/root") / sub)
        for node in record["nodes"]
        for sub in ("run", "tmp", "dev/shm")
    )
    result = {
        "boot_s": boot,
        "processes": len(pids),
        "pss_mib": pss_kib(pids) / 1024,
        "state_tmpfs_mib": used_kib(STATE) / 1024,
        "node_tmpfs_mib": node_tmpfs / 1024,
    }
    result["down_s"] = llmgw("lab", "down", "--state", str(STATE))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, nargs="+", default=[4, 32])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    print("| nodes | boot s | PSS MiB | state tmpfs MiB | node tmpfs MiB | processes | down s | runs |")
    print("|---|---|---|---|---|---|---|---|")
    for n in args.nodes:
        runs = [measure(n) for _ in range(args.runs)]
        for r in runs:
            print(
                f"<!-- {n} nodes: {json.dumps({k: round(v, 2) for k, v in r.items()})} -->", file=sys.stderr
            )
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(
            f"| {n} | {med['boot_s']:.2f} | {med['pss_mib']:.0f} | {med['state_tmpfs_mib']:.1f} | "
            f"{med['node_tmpfs_mib']:.1f} | {med['processes']:.0f} | {med['down_s']:.2f} | {len(runs)} |"
        )


if __name__ == "__main__":
    main()
