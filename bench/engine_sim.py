#!/usr/bin/env python3
"""Measure the simulated engine: memory of N idle engines, and requests/s of one.

    .venv/bin/python bench/engine_sim.py --engines 32
    .venv/bin/python bench/engine_sim.py --requests 2000 --concurrency 16

Engines start with LLMGW_LAB_LOAD_SECONDS=0 and LLMGW_LAB_TOKENS_PER_SECOND=0 (no
pacing), so the throughput figures are the simulator's own overhead, client included
(the client runs on the same machine).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_ports(count: int) -> list[int]:
    """Distinct free ports: all sockets stay open until every port is known."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def start(port: int, tokens_per_s: str) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "LLMGW_LAB_LOAD_SECONDS": "0",
        "LLMGW_LAB_TOKENS_PER_SECOND": tokens_per_s,
        "LLMGW_LAB_GPUS": "/nonexistent",
    }
    args = [
        "vllm",
        "serve",
        "org/model",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        "m",
    ]
    return subprocess.Popen(
        [sys.executable, "-m", "llmgw_cli.lab.engine_sim", *args], env=env, stdout=subprocess.DEVNULL
    )


def wait_listening(port: int) -> None:
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except ConnectionRefusedError:
            time.sleep(0.01)


def memory_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) in KiB from smaps_rollup."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value = line.split(":", 1)
        fields[name] = int(value.split()[0])
    return fields["Rss"], fields["Pss"]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        p.wait(10)


def bench_memory(count: int) -> None:
    ports = free_ports(count)
    t0 = time.monotonic()
    procs = [start(port, "200") for port in ports]
    try:
        for port in ports:
            wait_listening(port)
        up = time.monotonic() - t0
        if any(p.poll() is not None for p in procs):
            raise SystemExit("an engine exited during the measurement")
        mem = [memory_kib(p.pid) for p in procs]
        before = sum(cpu_seconds(p.pid) for p in procs)
        time.sleep(10)
        idle_cpu = sum(cpu_seconds(p.pid) for p in procs) - before
    finally:
        stop(procs)
    rss = sum(m[0] for m in mem) / 1024
    pss = sum(m[1] for m in mem) / 1024
    print(
        f"{count} engines listening after {up:.2f} s; RSS total {rss:.0f} MiB "
        f"({rss / count:.1f} MiB each), PSS total {pss:.0f} MiB ({pss / count:.1f} MiB each)"
    )
    print(f"CPU used by all {count} idle engines over 10 s: {idle_cpu:.2f} s")


async def load(port: int, requests: int, concurrency: int, stream: bool) -> float:
    body = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 16}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    queue = iter(range(requests))

    async def worker(client: httpx.AsyncClient) -> None:
        for _ in queue:
            if stream:
                async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                    async for _chunk in r.aiter_bytes():
                        pass
                    assert r.status_code == 200
            else:
                r = await client.post("/v1/chat/completions", json=body)
                assert r.status_code == 200

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=30) as client:
        t0 = time.monotonic()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return requests / (time.monotonic() - t0)


def bench_throughput(requests: int, concurrency: int) -> None:
    [port] = free_ports(1)
    proc = start(port, "0")
    try:
        wait_listening(port)
        for stream in (False, True):
            rate = asyncio.run(load(port, requests, concurrency, stream))
            kind = "stream (16 tokens, usage chunk)" if stream else "non-stream (16 tokens)"
            print(f"{kind}: {requests} requests, concurrency {concurrency}: {rate:.0f} req/s")
        rss, _ = memory_kib(proc.pid)
        print(f"engine RSS after the load: {rss / 1024:.1f} MiB")
    finally:
        stop([proc])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engines", type=int, default=0)
    parser.add_argument("--requests", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    if args.engines:
        bench_memory(args.engines)
    if args.requests:
        bench_throughput(args.requests, args.concurrency)


if __name__ == "__main__":
    main()
