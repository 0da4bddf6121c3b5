#!/usr/bin/env python3
"""What per-key limits cost the gateway, and how closely four processes hold one limit.

    .venv/bin/python bench/limits.py                      # both parts, defaults below
    .venv/bin/python bench/limits.py --rounds 5 --seconds 5
    .venv/bin/python bench/limits.py --skip overshoot

Part 1, cost. One `llmgw gateway run` (one worker, pinned to CPU 0, as in
bench/gateway.py) in front of the fast fake upstream of bench/gateway.py (CPU 1, with the
load client), two keys in its store: ``bench`` without limits, and ``limited`` with rpm,
tpm, a monthly budget and max_parallel all set far above what the run reaches, so every
request is counted and admitted (leases, the sliding cap, the x-ratelimit-* headers, the
settlement of its tokens) and none is refused. Both keys are measured on the same gateway,
alternately, ``--rounds`` times: requests/s at concurrency 64 for non-streamed answers
and for 50-chunk streams, and the gateway's CPU time per request. Printed: the median of
each, and the ratio limited / none.

Part 2, overshoot. A gateway with four workers (SQLite store, one host) and a key with
``--rpm`` (default 600) driven at 3x that rate for 60 s over new connections, so the
kernel spreads them over the workers: how many passed in the 60 s, against the
documented bound (docs/gateway.md, "Limits and priorities": between ``rpm - 6 x P x
lease`` and ``rpm + ceil(rpm / 6) + P x lease`` for P processes, a lease being
``ceil(rpm / (8 x P x 6))``).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gateway import LLMGW, Gateway, free_port, throughput, wait_port

LIMITED = ["--rpm", "1000000000", "--tpm", "1000000000000", "--budget", "100000000000000/month"]
LIMITED += ["--max-parallel", "100000"]


def new_key(g: Gateway, name: str, *options: str) -> str:
    return subprocess.run(
        [*LLMGW, "keys", "create", "-f", str(g.cluster), "--name", name, *options],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def start(g: Gateway, cpu: str, procs: list[subprocess.Popen[bytes]]) -> int:
    procs.append(
        subprocess.Popen(["taskset", "-c", cpu, *g.command()], stdout=g.log, stderr=subprocess.STDOUT)
    )
    wait_port(g.port)
    time.sleep(1.0)  # the first health check done
    return procs[-1].pid


def cost(args: argparse.Namespace, work: Path, up_port: int, procs: list[subprocess.Popen[bytes]]) -> None:
    g = Gateway(work, "cost", "auto", up_port, gateway={"workers": 1})
    keys = {"none": g.key, "limited": new_key(g, "limited", *LIMITED)}
    pid = start(g, args.gateway_cpu, procs)
    got: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        for stream in (False, True):
            for name, key in keys.items():
                rps, cpu = asyncio.run(throughput(g.port, stream, key, 64, args.seconds, pid=pid))
                got.setdefault(("stream50" if stream else "plain", name), []).append((rps, cpu))
    print(f"Part 1: c=64, {args.rounds} alternating rounds of {args.seconds:g} s each, medians")
    print("| mode | key | req/s | gateway CPU us/req |")
    print("|---|---|---|---|")
    for (mode, name), runs in got.items():
        rps = statistics.median(r for r, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        print(f"| {mode} | {name} | {rps:,.0f} | {cpu:.0f} |")
    for mode in ("plain", "stream50"):
        none = got[(mode, "none")]
        limited = got[(mode, "limited")]
        ratios = sorted(b[0] / a[0] for a, b in zip(none, limited, strict=True))
        cpus = sorted(b[1] / a[1] for a, b in zip(none, limited, strict=True))
        print(
            f"{mode}: limited / none req/s per round {', '.join(f'{r:.3f}' for r in ratios)} "
            f"(median {statistics.median(ratios):.3f}); CPU per request median {statistics.median(cpus):.3f}"
        )


async def _drive(port: int, key: str, per_minute: int, seconds: float) -> dict[int, int]:
    """``per_minute`` requests a minute for ``seconds``, each on a new connection."""
    body = b'{"model":"bench","messages":[{"role":"user","content":"hi"}],"max_tokens":4}'
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer %s\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
    ) % (key.encode(), len(body))
    statuses: dict[int, int] = {}

    async def one() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head + body)
        status = int((await reader.readline()).split()[1])
        await reader.read()
        writer.close()
        statuses[status] = statuses.get(status, 0) + 1

    interval = 60 / per_minute
    tasks = []
    start = time.monotonic()
    i = 0
    while (due := start + i * interval) < start + seconds:
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        tasks.append(asyncio.create_task(one()))
        i += 1
    await asyncio.gather(*tasks)
    return statuses


def overshoot(
    args: argparse.Namespace, work: Path, up_port: int, procs: list[subprocess.Popen[bytes]]
) -> None:
    workers = 4
    g = Gateway(work, "overshoot", "auto", up_port, gateway={"workers": workers})
    key = new_key(g, "rpm", "--rpm", str(args.rpm))
    start(g, args.gateway_cpu, procs)
    statuses = asyncio.run(_drive(g.port, key, 3 * args.rpm, 60.0))
    passed = statuses.get(200, 0)
    lease = math.ceil(args.rpm / (8 * workers * 6))
    low, high = args.rpm - 6 * workers * lease, args.rpm + math.ceil(args.rpm / 6) + workers * lease
    print(
        f"Part 2: rpm {args.rpm}, driven at {3 * args.rpm}/min for 60 s over {workers} workers: "
        f"{passed} passed ({passed / args.rpm:.3f} of the limit; documented bound {low}..{high}); "
        f"answers {dict(sorted(statuses.items()))}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0, help="Duration of each throughput run.")
    parser.add_argument("--rpm", type=int, default=600, help="The limit of part 2.")
    parser.add_argument("--skip", default="", help="Comma-separated parts to skip: cost, overshoot.")
    parser.add_argument("--gateway-cpu", default="0")
    parser.add_argument("--client-cpu", default="1")
    args = parser.parse_args()
    skip = set(args.skip.split(","))
    os.sched_setaffinity(0, {int(args.client_cpu)})
    work = Path(tempfile.mkdtemp(prefix="llmgw-bench-limits-"))
    up_port = free_port()
    gateway_py = str(Path(__file__).resolve().parent / "gateway.py")
    procs = [
        subprocess.Popen(
            ["taskset", "-c", args.client_cpu, sys.executable, gateway_py, "--upstream", str(up_port)]
        )
    ]
    try:
        wait_port(up_port)
        if "cost" not in skip:
            cost(args, work, up_port, procs)
        if "overshoot" not in skip:
            overshoot(args, work, up_port, procs)
    finally:
        for p in reversed(procs):
            p.terminate()
            p.wait(30)
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
