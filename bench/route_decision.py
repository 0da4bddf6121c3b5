#!/usr/bin/env python3
"""Route decision speed: prefix_key + choose for one 8 KB chat prompt over 8 replicas.

Run: .venv/bin/python bench/route_decision.py [--runs 20000]
Prints the median and 99th percentile of one decision (key, rendezvous order, bounded-load
walk) in microseconds; the target is a median of 50 µs or less. Every replica carries
engine signals, and the key's first replica is overloaded, so the walk goes one step on.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llmgw_cli.core.serving.affinity import Candidate, Policy, choose, prefix_key, rendezvous
from llmgw_cli.core.serving.engine_signals import Signals

TARGET_US = 50.0


def turns() -> list[dict[str, str]]:
    """A 6,400-char system prompt and 8 turns: 8,192 characters of content."""
    system = "You are a careful assistant. Answer briefly and cite the policy section. " * 90
    out = [{"role": "system", "content": system[:6400]}]
    for i in range(8):
        role = "user" if i % 2 == 0 else "assistant"
        out.append({"role": role, "content": f"Turn {i}: " + "details " * 27})
    return out


def candidates(key: str) -> list[Candidate]:
    addresses = [f"10.0.0.{i}:8000" for i in range(1, 9)]
    first = rendezvous(key, addresses)[0]
    return [
        Candidate(a, 2, Signals(running=3.0, waiting=9.0 if a == first else 0.0, kv_usage=0.4))
        for a in addresses
    ]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=20000)
    args = parser.parse_args()
    messages = turns()
    request: dict[str, object] = {"model": "m", "messages": messages}
    size = sum(len(m["content"]) for m in messages)
    key = prefix_key(request)
    assert key is not None
    cands = candidates(key)
    samples = []
    for turn in range(args.runs):
        t0 = time.perf_counter_ns()
        choice = choose(Policy.prefix, prefix_key(request), cands, turn=turn)
        samples.append((time.perf_counter_ns() - t0) / 1000)
    assert choice is not None
    median = statistics.median(samples)
    p99 = statistics.quantiles(samples, n=100)[98]
    print(f"prompt {size} chars, {len(cands)} replicas, {args.runs} runs, last reason {choice.reason}")
    print(f"median {median:.1f} µs, p99 {p99:.1f} µs (target median ≤ {TARGET_US:.0f} µs)")
    return 0 if median <= TARGET_US else 1


if __name__ == "__main__":
    raise SystemExit(main())
