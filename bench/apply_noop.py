#!/usr/bin/env python3
"""A no-op `llmgw apply` on a 32-node lab: the wall time of the whole command (Python
start-up, probing every node, planning, printing "No changes"), median of several runs.

Run as root on a machine where no lab is up (it boots its own and takes it down):
    .venv/bin/python bench/apply_noop.py --nodes 32 --runs 5
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

STATE = Path("/var/lib/llmgw-bench-lab")


def llmgw(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmgw_cli", *args], capture_output=True, text=True, timeout=600, check=False
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=32)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    llmgw("lab", "down", "--state", str(STATE))
    assert llmgw("lab", "up", "--nodes", str(args.nodes), "--state", str(STATE)).returncode == 0
    cluster = str(STATE / "cluster.yaml")
    try:
        first = llmgw("apply", "-f", cluster, "--yes")
        assert first.returncode == 0, first.stdout + first.stderr
        times = []
        for _ in range(args.runs):
            started = time.perf_counter()
            again = llmgw("apply", "-f", cluster, "--yes")
            times.append(time.perf_counter() - started)
            assert "No changes." in again.stdout, again.stdout + again.stderr
        print(
            f"no-op apply on {args.nodes} lab nodes: median {statistics.median(times):.2f} s "
            f"(min {min(times):.2f}, max {max(times):.2f}) over {args.runs} runs"
        )
    finally:
        llmgw("lab", "down", "--state", str(STATE))


if __name__ == "__main__":
    main()
