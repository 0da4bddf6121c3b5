#!/usr/bin/env python3
"""Gateway workers: requests/s of `llmgw gateway run --workers 1` against `--workers 2`.

    .venv/bin/python bench/workers.py                  # 3 rounds of 5 s per configuration
    .venv/bin/python bench/workers.py --rounds 5 --seconds 10 --cpus 0,1
    .venv/bin/python bench/workers.py --cpus 0,1 --load-cpus 2,3   # 4 cores: the load apart

Both gateways run at once (each idle while the other is measured), in front of the same
fake upstream of bench/gateway.py (a raw asyncio protocol), loaded by the same raw
keep-alive client at concurrency 64: plain chat completions, then 50-chunk streams. Each
round measures both, the order alternating from round to round; the figures are the
medians over the rounds, and the ratio of the medians (2 workers / 1).

Fairness on a small machine: every process (both gateways with their workers, the
upstream, this client) may run on the same CPUs (``--cpus``, all of this process's by
default), so the only difference between the two is the number of gateway processes;
``--load-cpus`` puts the client and the upstream on CPUs of their own instead.
The client and the upstream use CPU too: on 2 cores they take part of the second core the
second worker would use, so 2x is out of reach there; the gateways' CPU time per request
(summed over the supervisor and its workers, from ``/proc``) shows whether a worker costs
more per request than one process does.

Memory: the RSS of each process (the one process of ``--workers 1``; the supervisor and
each worker of ``--workers 2``) is read from ``/proc`` once all are ready and idle, and
again after the measured rounds. ``--rss-only`` starts both, prints the idle figures,
sends 20 requests and 20 streams to each and prints them again, without the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gateway as one  # bench/gateway.py: the upstream, the client, the cluster file


def tree(pid: int) -> list[int]:
    """``pid`` and its children (the supervisor's workers)."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return [pid]
    return [pid, *(int(c) for c in children)]


def cpu_of(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):  # a worker that exited meanwhile
            total += one.cpu_seconds(pid)
    return total


def rss_mib(pid: int, field: str = "Rss:") -> float:
    """Resident memory of ``pid`` in MiB (0 when it is gone); ``field="Pss:"``: its
    proportional share, each page shared with other processes (the libraries every worker
    maps) counted as a share of it."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    return 0.0


def print_rss(when: str, pids: dict[int, list[int]]) -> None:
    """One line per configuration: the RSS of each of its processes."""
    for n, ps in pids.items():
        if n == 1:
            print(f"RSS {when}, workers=1: the serving process {rss_mib(ps[0]):.1f} MiB", flush=True)
            continue
        each = ", ".join(f"{rss_mib(p):.1f}" for p in ps[1:])
        pss = ", ".join(f"{rss_mib(p, 'Pss:'):.1f}" for p in ps)
        print(
            f"RSS {when}, workers={n}: supervisor {rss_mib(ps[0]):.1f} MiB; workers {each} MiB "
            f"(PSS, supervisor first: {pss} MiB)",
            flush=True,
        )


async def touch(port: int, key: str, count: int) -> None:
    """``count`` requests and ``count`` streams on one connection: what serving loads is loaded."""
    for stream in (False, True):
        await one.latency(port, stream, key, count)


def wait_ready(log: Path, workers: int, seconds: float = 120) -> None:
    want = "event loop:" if workers == 1 else f"all {workers} workers ready"
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if want in log.read_text(errors="replace"):
            return
        time.sleep(0.1)
    raise SystemExit(f"the gateway did not get ready:\n{log.read_text()[-3000:]}")


async def measure(
    port: int, key: str, stream: bool, *, concurrency: int, seconds: float, pids: list[int], load: list[int]
) -> dict[str, float]:
    """Requests/s, and the CPU time per request of the gateway's processes (``pids``) and
    of the load (``load``: this client and the upstream) over the same measured window."""
    marks: list[tuple[float, float]] = []

    def sample() -> float:  # throughput() calls it at the start and the end of the window
        marks.append((cpu_of(pids), cpu_of(load)))
        return marks[-1][0]

    rate, cpu_us = await one.throughput(port, stream, key, concurrency, seconds, cpu_time=sample)
    (gw0, load0), (gw1, load1) = marks
    return {"rps": rate, "cpu_us": cpu_us, "load_us": cpu_us * (load1 - load0) / max(gw1 - gw0, 1e-9)}


def main() -> None:  # noqa: PLR0915 (one linear script)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0, help="Duration of each throughput run.")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--cpus", default="", help="CPUs for every process (taskset list); default: all.")
    parser.add_argument(
        "--load-cpus", default="", help="CPUs for the client and the upstream; default: --cpus."
    )
    parser.add_argument(
        "--rss-only", action="store_true", help="Only the RSS of each process, idle and after a few requests."
    )
    args = parser.parse_args()

    cpus = args.cpus or ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    load_cpus = args.load_cpus or cpus
    os.sched_setaffinity(0, {int(c) for c in load_cpus.split(",")})
    pin = ["taskset", "-c", cpus]
    work = Path(tempfile.mkdtemp(prefix="llmgw-bench-workers-"))
    up_port = one.free_port()
    upstream = ["taskset", "-c", load_cpus, sys.executable, one.__file__, "--upstream", str(up_port)]
    procs = [subprocess.Popen(upstream)]
    configs = {
        1: one.Gateway(work, "workers-1", "auto", up_port),
        2: one.Gateway(work, "workers-2", "auto", up_port),
    }
    pids: dict[int, list[int]] = {}
    rows: dict[tuple[str, int], list[dict[str, float]]] = {}
    try:
        one.wait_port(up_port)
        for n, g in configs.items():
            procs.append(
                subprocess.Popen(
                    [*pin, *g.command(), "--workers", str(n)], stdout=g.log, stderr=subprocess.STDOUT
                )
            )
            wait_ready(g.dir / "gateway.log", n)
            pids[n] = tree(procs[-1].pid)
            assert len(pids[n]) == (1 if n == 1 else n + 1), pids[n]
        time.sleep(2.0)  # the first health checks are done
        print_rss("idle", pids)
        if args.rss_only:
            for g in configs.values():
                asyncio.run(touch(g.port, g.key, 20))
            time.sleep(1.0)
            print_rss("after 20 requests and 20 streams each", pids)
            return
        for r in range(args.rounds):
            order = [1, 2] if r % 2 == 0 else [2, 1]
            for stream in (False, True):
                mode = "stream50" if stream else "plain"
                for n in order:
                    g = configs[n]
                    result = asyncio.run(
                        measure(
                            g.port,
                            g.key,
                            stream,
                            concurrency=args.concurrency,
                            seconds=args.seconds,
                            pids=pids[n],
                            load=[os.getpid(), procs[0].pid],
                        )
                    )
                    rows.setdefault((mode, n), []).append(result)
                    print(
                        f"round {r + 1} {mode} workers={n}: {result['rps']:,.0f} req/s, gateway {result['cpu_us']:.0f} "
                        f"us CPU/req, client+upstream {result['load_us']:.0f} us CPU/req",
                        flush=True,
                    )
        print_rss("after the rounds", pids)
    finally:
        for p in reversed(procs):
            p.terminate()
            p.wait(60)
        for g in configs.values():
            g.log.close()
        shutil.rmtree(work)

    average = os.getloadavg()
    print(
        f"\nCPUs {cpus} (load {load_cpus}); load average after the run {average[0]:.1f} {average[1]:.1f} {average[2]:.1f}"
    )
    print(
        "| mode | workers | req/s per round | median req/s | median gateway CPU us/req "
        "| median client+upstream CPU us/req |"
    )
    print("|---|---|---|---|---|---|")
    medians: dict[tuple[str, int], tuple[float, float]] = {}
    for (mode, n), results in rows.items():
        rps = statistics.median(x["rps"] for x in results)
        cpu = statistics.median(x["cpu_us"] for x in results)
        load = statistics.median(x["load_us"] for x in results)
        medians[(mode, n)] = (rps, cpu)
        each = ", ".join(f"{x['rps']:,.0f}" for x in results)
        print(f"| {mode} | {n} | {each} | {rps:,.0f} | {cpu:.0f} | {load:.0f} |")
    for mode in ("plain", "stream50"):
        (r1, c1), (r2, c2) = medians[(mode, 1)], medians[(mode, 2)]
        pairs = [b["rps"] / a["rps"] for a, b in zip(rows[(mode, 1)], rows[(mode, 2)], strict=True)]
        shown = ", ".join(f"{p:.2f}" for p in pairs)
        print(
            f"{mode}: 2 workers / 1: req/s {r2 / r1:.2f} (per round {shown}), CPU per request {c2 / c1:.2f}"
        )
    print(json.dumps({f"{m}/{n}": v for (m, n), v in medians.items()}))


if __name__ == "__main__":
    main()
