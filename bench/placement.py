#!/usr/bin/env python3
"""Placement speed: 2,000 nodes x 8 GPUs (two fabrics) and 300 models, 3 replicas each.

Run: .venv/bin/python bench/placement.py [--runs 7]
Prints the median and spread of `place()` alone (spec parsing and fact building excluded).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.planning.placement import place
from tests.unit.facts_factory import node_facts


def build(nodes: int, models: int) -> str:
    lines = [
        "cluster: {name: bench}",
        "fabrics: {ib-a: {kind: infiniband}, ib-b: {kind: infiniband}}",
        "nodes:",
    ]
    for i in range(nodes):
        fabric = "ib-a" if i % 2 else "ib-b"
        lines.append(
            f"  - {{name: n{i:04d}, address: 10.{i // 250}.{i % 250}.1, fabric: {fabric}, hcas: [mlx5_0]}}"
        )
    lines += ["profiles: {vllm: {engine: vllm}}", "models:"]
    for i in range(models):
        tp, count = (8, 2) if i % 50 == 0 else (2 ** (i % 4), 1)
        lines.append(
            f"  - {{name: m{i}, source: org/m{i}, profile: vllm, tensor_parallel: {tp}, nodes: {count},"
            " scaling: {min: 3, max: 3}}"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--nodes", type=int, default=2000)
    parser.add_argument("--models", type=int, default=300)
    args = parser.parse_args()
    spec = parse_cluster(build(args.nodes, args.models))
    facts = {n.name: node_facts(n.name) for n in spec.nodes}
    want = {m.name: 3 for m in spec.models}
    times = []
    for _ in range(args.runs):
        started = time.perf_counter()
        result = place(spec, facts, [], want)
        times.append(time.perf_counter() - started)
    print(
        f"placement of {len(result.replicas)} replicas ({len(result.unplaced)} unplaced) on "
        f"{args.nodes} nodes x 8 GPUs, {args.models} models: median {statistics.median(times):.3f}s, "
        f"min {min(times):.3f}s, max {max(times):.3f}s over {args.runs} runs"
    )


if __name__ == "__main__":
    main()
