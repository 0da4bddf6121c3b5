#!/usr/bin/env python3
"""How long a command takes before it does anything: `llmgw --version` and `llmgw validate`
against the floor under them, run side by side (alternating) in fresh processes.

    .venv/bin/python bench/cli_start.py --runs 21

Peers: a bare interpreter (`python -c pass`) and one that imports what every llmgw
command needs to parse its options and a cluster file (typer, pydantic, rich, yaml).
Prints one markdown row per command: median and min-max wall time.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "import typer, pydantic, rich.console, yaml": [
        sys.executable,
        "-c",
        "import typer, pydantic, rich.console, yaml",
    ],
    "llmgw --version": [sys.executable, "-m", "llmgw_cli", "--version"],
    "llmgw validate (single-box)": [
        sys.executable,
        "-m",
        "llmgw_cli",
        "validate",
        "-f",
        str(ROOT / "inventories/single-box.yaml"),
    ],
    "llmgw validate (hgx-two-fabrics)": [
        sys.executable,
        "-m",
        "llmgw_cli",
        "validate",
        "-f",
        str(ROOT / "inventories/hgx-two-fabrics.yaml"),
    ],
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=21)
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for run in range(args.runs + 1):
        for name, command in COMMANDS.items():
            started = time.perf_counter()
            done = subprocess.run(command, capture_output=True, cwd=ROOT, check=False)
            took = time.perf_counter() - started
            if done.returncode != 0:
                raise SystemExit(f"{name} failed: {done.stderr.decode()[-2000:]}")
            if run:  # the first round fills the page cache and writes the .pyc files
                times[name].append(took)
    print("| command | median | min-max |")
    print("|---|---|---|")
    for name, values in times.items():
        print(f"| `{name}` | {statistics.median(values):.3f} s | {min(values):.3f}-{max(values):.3f} s |")


if __name__ == "__main__":
    main()
