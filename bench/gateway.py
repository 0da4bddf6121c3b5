#!/usr/bin/env python3
"""Gateway overhead: one fast fake upstream reached directly, through `llmgw gateway run`
and through minimal proxies, side by side in the same run.

    .venv/bin/python bench/gateway.py                     # llmgw and direct, one round
    .venv/bin/python bench/gateway.py --with-minimal --with-raw --rounds 5
    .venv/bin/python bench/gateway.py --with-minimal --with-raw --rounds 5 --profile /tmp/prof
    .venv/bin/python bench/gateway.py --loops asyncio,uvloop   # both event loops side by side

The targets:
- ``direct``: the fake upstream itself;
- ``llmgw``: one worker, with everything on (key check, admission, routing, usage metering
  and batch writes, metrics, one JSON log line per request to a file);
- ``minimal-aiohttp`` (``--with-minimal``): key check, JSON body read, pass-through on
  aiohttp: the stack's own ceiling;
- ``raw-httptools`` (``--with-raw``, ``bench/raw_proxy.py``): the same on bare asyncio
  protocols and httptools: what the protocol costs;
- ``litellm`` (``--litellm BIN``): LiteLLM proxy, one worker.

Every proxy is pinned to CPU 0 with ``taskset -c 0``; the fake upstream and this load client
share CPU 1. The upstream and the client are raw asyncio protocols (no HTTP library) so
that they cost little next to the proxies; they, and the minimal proxies, run on uvloop
where it is installed, as llmgw does.

Measured per target and mode (non-streaming; a 50-chunk SSE stream, each chunk written
separately):
- concurrency 1: p50/p99 latency, and for streams the time to the first byte (TTFB);
- concurrency 64: requests (or streams) per second over ``--seconds``, and the proxy
  process's CPU time (user + system, ``/proc/PID/stat``) per request;
- the proxy's RSS after the runs.

``--rounds N`` interleaves: each round measures every target once, in turn (and starts one
target later than the round before), so that a machine that gets busier or quieter hits
them all alike; the tables give medians over the rounds, and the ratios llmgw / each
other proxy. ``--profile DIR`` then records llmgw with py-spy (``bench/profile_parts.py``
sorts the samples into parts: HTTP parsing, aiohttp, JSON, auth, ...).

``--loops asyncio,uvloop`` runs one gateway per event loop (both pinned to the same CPU,
measured one after the other in the same run) and prints the ratio of their c=64 rates.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

# the repository, for the tests' port picker (a port is never handed out twice)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.ports import free_port

try:
    import uvloop
except ImportError:  # the bench then runs on asyncio's own loop
    uvloop = None  # type: ignore[assignment]

ROOT = Path(__file__).resolve().parent.parent
ENGINE_KEY = "bench-engine-key"
LLMGW = [sys.executable, "-m", "llmgw_cli"]
CHUNKS = 50
LOOP = "uvloop" if uvloop else "asyncio"  # of the upstream, the load client and the minimal proxies
T = TypeVar("T")


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on uvloop where it is installed, as ``llmgw gateway run`` does by default."""
    return uvloop.run(main) if uvloop else asyncio.run(main)


# --- the fake upstream ----------------------------------------------------------------

_COMPLETION = json.dumps(
    {
        "id": "cmpl-1",
        "object": "chat.completion",
        "created": 0,
        "model": "bench",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok " * 16}, "finish_reason": "length"}
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 16, "total_tokens": 21},
    }
).encode()
_PLAIN = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(_COMPLETION)
    + _COMPLETION
)
_HEALTH = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _event(payload: dict[str, object]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


_TOKEN = _chunk(
    _event(
        {
            "id": "c",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "bench",
            "choices": [{"index": 0, "delta": {"content": "tok "}, "finish_reason": None}],
        }
    )
)
_STREAM_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
_STREAM_TAIL = (
    _chunk(
        _event(
            {
                "id": "c",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": "bench",
                "choices": [],
                "usage": {"prompt_tokens": 5, "completion_tokens": CHUNKS, "total_tokens": CHUNKS + 5},
            }
        )
    )
    + _chunk(b"data: [DONE]\n\n")
    + b"0\r\n\r\n"
)


class Upstream(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].lower()
            length = 0
            at = head.find(b"content-length:")
            if at >= 0:
                length = int(head[at + 15 : head.find(b"\r\n", at) if head.find(b"\r\n", at) > 0 else None])
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4 : end + 4 + length]
            self.buf = self.buf[end + 4 + length :]
            if head.startswith(b"get"):
                self.transport.write(_HEALTH)
            elif b'"stream":true' in body.replace(b" ", b""):
                self.transport.write(_STREAM_HEAD)
                for _ in range(CHUNKS):
                    self.transport.write(_TOKEN)
                self.transport.write(_STREAM_TAIL)
            else:
                self.transport.write(_PLAIN)


def run_upstream(port: int) -> None:
    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Upstream, "127.0.0.1", port, backlog=1024)
        await server.serve_forever()

    run_loop(main())


# --- a minimal aiohttp proxy: the stack's own ceiling on this machine ------------------


def run_minimal(port: int, upstream: int) -> None:
    """Key check, JSON body read, pass-through: what a minimal proxy does, no more."""
    import aiohttp  # noqa: PLC0415 (child mode only)
    from aiohttp import web  # noqa: PLC0415

    async def main() -> None:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)
        target = f"http://127.0.0.1:{upstream}/v1/chat/completions"

        async def handle(request: web.Request) -> web.StreamResponse:
            if request.headers.get("Authorization") is None:
                return web.Response(status=401)
            body = await request.read()
            json.loads(body)
            async with session.post(
                target, data=body, headers={"Content-Type": "application/json", "Accept-Encoding": "identity"}
            ) as up:
                if not up.headers.get("Content-Type", "").startswith("text/event-stream"):
                    return web.Response(
                        status=up.status, body=await up.read(), content_type="application/json"
                    )
                out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await out.prepare(request)
                async for chunk in up.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out

        app = web.Application()
        app.router.add_post("/v1/chat/completions", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, backlog=2048).start()
        await asyncio.Event().wait()

    run_loop(main())


# --- the load client ------------------------------------------------------------------


class Client(asyncio.Protocol):
    """One keep-alive connection sending one request at a time."""

    def __init__(self, request: bytes) -> None:
        self.request = request
        self.done: asyncio.Future[tuple[float, float]] | None = None
        self.buf = b""
        self.length = -1
        self.chunked = False
        self.sent = 0.0
        self.first = 0.0
        self.status = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]

    def send(self) -> asyncio.Future[tuple[float, float]]:
        self.done = asyncio.get_running_loop().create_future()
        self.buf, self.length, self.chunked, self.first = b"", -1, False, 0.0
        self.sent = time.perf_counter()
        self.transport.write(self.request)
        return self.done

    def data_received(self, data: bytes) -> None:
        if not self.first:
            self.first = time.perf_counter()
        self.buf += data
        if self.length < 0 and not self.chunked:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].lower()
            self.status = int(head[9:12])
            at = head.find(b"content-length:")
            if at >= 0:
                stop = head.find(b"\r\n", at)
                self.length = int(head[at + 15 : stop if stop > 0 else None])
            else:
                self.chunked = b"transfer-encoding: chunked" in head
            self.buf = self.buf[end + 4 :]
        complete = self.buf.endswith(b"0\r\n\r\n") if self.chunked else len(self.buf) >= self.length
        if complete and self.done is not None and not self.done.done():
            if self.status != 200:
                self.done.set_exception(RuntimeError(f"HTTP {self.status}: {self.buf[:300]!r}"))
            else:
                now = time.perf_counter()
                self.done.set_result((now - self.sent, self.first - self.sent))

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError(f"connection lost: {exc}"))


def _request(port: int, stream: bool, key: str) -> bytes:
    body = json.dumps(
        {
            "model": "bench",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 16,
            "stream": stream,
        },
        separators=(",", ":"),
    ).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nAuthorization: Bearer %s\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
        % (port, key.encode(), len(body), body)
    )


async def _connect(port: int, request: bytes) -> Client:
    _, protocol = await asyncio.get_running_loop().create_connection(
        lambda: Client(request), "127.0.0.1", port
    )
    return protocol


async def latency(port: int, stream: bool, key: str, count: int) -> tuple[list[float], list[float]]:
    client = await _connect(port, _request(port, stream, key))
    totals, firsts = [], []
    for _ in range(count // 10):  # warm-up
        await client.send()
    for _ in range(count):
        total, first = await client.send()
        totals.append(total)
        firsts.append(first)
    client.transport.close()
    return totals, firsts


async def throughput(
    port: int,
    stream: bool,
    key: str,
    concurrency: int,
    seconds: float,
    *,
    pid: int | None = None,
    cpu_time: Callable[[], float] | None = None,
) -> tuple[float, float]:
    """Requests per second over ``seconds`` (after a warm-up second), and the CPU time the
    process ``pid`` (or ``cpu_time()``, CPU seconds so far of whatever it sums) used per
    request meanwhile, in microseconds (0 without either): less sensitive than the rate to
    other work on a shared machine."""
    if cpu_time is None and pid:
        cpu_time = lambda: cpu_seconds(pid)  # noqa: E731
    clients = [await _connect(port, _request(port, stream, key)) for _ in range(concurrency)]
    counts = [0] * concurrency
    stop_at = 0.0

    async def loop(i: int) -> None:
        while time.perf_counter() < stop_at:
            await clients[i].send()
            counts[i] += 1

    stop_at = time.perf_counter() + 1.0  # warm-up second, not counted
    await asyncio.gather(*(loop(i) for i in range(concurrency)))
    counts = [0] * concurrency
    cpu = cpu_time() if cpu_time else 0.0
    started = time.perf_counter()
    stop_at = started + seconds
    await asyncio.gather(*(loop(i) for i in range(concurrency)))
    elapsed = time.perf_counter() - started
    cpu = cpu_time() - cpu if cpu_time else 0.0
    for c in clients:
        c.transport.close()
    return sum(counts) / elapsed, cpu / max(1, sum(counts)) * 1e6


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --- orchestration --------------------------------------------------------------------


def wait_port(port: int, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"nothing listens on {port}")


LITELLM_KEY = "sk-bench-master"


def start_litellm(
    binary: str, cpu: str, work: Path, upstream: int, procs: list[subprocess.Popen[bytes]]
) -> int:
    """LiteLLM proxy, one worker, pinned like llmgw, routing ``bench`` to the same upstream."""
    port = free_port()
    config = {
        "model_list": [
            {
                "model_name": "bench",
                "litellm_params": {
                    "model": "openai/bench",
                    "api_base": f"http://127.0.0.1:{upstream}/v1",
                    "api_key": ENGINE_KEY,
                },
            }
        ],
        "general_settings": {"master_key": LITELLM_KEY},
    }
    (work / "litellm.yaml").write_text(json.dumps(config))
    log = (work / "litellm.log").open("wb")
    cmd = ["taskset", "-c", cpu, binary, "--config", str(work / "litellm.yaml"), "--host", "127.0.0.1"]
    procs.append(subprocess.Popen([*cmd, "--port", str(port), "--num_workers", "1"], stdout=log, stderr=log))
    wait_port(port, seconds=120)
    return port


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def ms(values: list[float], q: float) -> float:
    return (
        statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] * 1000
        if q < 100
        else max(values) * 1000
    )


MODES = {"plain": False, "stream50": True}
PROXIES = ("llmgw", "minimal-aiohttp", "raw-httptools", "litellm")  # as the summary shows them


@dataclass
class Target:
    """What the load client measures. ``pid``: the proxy's process, whose CPU time and RSS
    are reported (None for ``direct``, the fake upstream itself)."""

    name: str
    port: int
    key: str
    pid: int | None = None


def start_targets(
    args: argparse.Namespace, work: Path, up_port: int, procs: list[subprocess.Popen[bytes]]
) -> tuple[list[Target], list[Gateway]]:
    """Every proxy asked for, each pinned to ``--gateway-cpu``, ready to serve."""
    pin = ["taskset", "-c", args.gateway_cpu]
    loops = args.loops.split(",")
    gateways = [
        Gateway(work, "llmgw" if loops == ["auto"] else f"llmgw-{loop}", loop, up_port) for loop in loops
    ]
    if args.http_servers:  # one gateway per public HTTP server, on the first loop
        gateways = [
            Gateway(work, f"llmgw-{server}", loops[0], up_port, gateway={"http_server": server})
            for server in args.http_servers.split(",")
        ]
    targets = [Target("direct", up_port, gateways[0].key)]
    for g in gateways:
        cmd = [*pin, *g.command(), "--workers", "1"]
        if args.no_access_log:
            cmd.append("--no-access-log")
        procs.append(subprocess.Popen(cmd, stdout=g.log, stderr=subprocess.STDOUT))
        wait_port(g.port)
        targets.append(Target(g.name, g.port, g.key, procs[-1].pid))
    children = []
    if args.with_minimal:
        children.append(("minimal-aiohttp", [sys.executable, __file__, "--minimal"]))
    if args.with_raw:
        children.append(("raw-httptools", [sys.executable, str(Path(__file__).with_name("raw_proxy.py"))]))
    for name, command in children:
        port = free_port()
        procs.append(subprocess.Popen([*pin, *command, str(port), str(up_port)]))
        wait_port(port)
        targets.append(Target(name, port, gateways[0].key, procs[-1].pid))
    if args.litellm:
        port = start_litellm(args.litellm, args.gateway_cpu, work, up_port, procs)
        targets.append(Target("litellm", port, LITELLM_KEY, procs[-1].pid))
    return targets, gateways


def measure(target: Target, stream: bool, args: argparse.Namespace) -> dict[str, float]:
    """One target in one mode: latency at concurrency 1, then the rate at ``--concurrency``."""
    count = min(args.latency_requests, 300) if target.name == "litellm" else args.latency_requests
    totals, firsts = run_loop(latency(target.port, stream, target.key, count))
    rps, cpu_us = run_loop(
        throughput(target.port, stream, target.key, args.concurrency, args.seconds, pid=target.pid)
    )
    return {
        "p50_ms": ms(totals, 50),
        "p99_ms": ms(totals, 99),
        "ttfb_p50_ms": ms(firsts, 50),
        "ttfb_p99_ms": ms(firsts, 99),
        "rps": rps,
        "cpu_us": cpu_us,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--upstream", type=int, help=argparse.SUPPRESS)  # child mode
    parser.add_argument("--minimal", type=int, nargs=2, help=argparse.SUPPRESS)  # child mode
    parser.add_argument(
        "--with-minimal",
        action="store_true",
        help="Also measure a minimal aiohttp proxy (the stack's ceiling).",
    )
    parser.add_argument(
        "--with-raw",
        action="store_true",
        help="Also measure a minimal proxy on httptools (bench/raw_proxy.py: the protocol's ceiling).",
    )
    parser.add_argument(
        "--litellm",
        metavar="BIN",
        help="Also measure LiteLLM proxy: the `litellm` executable of a venv with litellm[proxy].",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="Interleaved rounds: each measures every target once, in turn (each round starts "
        "one target later); the summary gives medians over the rounds.",
    )
    parser.add_argument(
        "--profile",
        metavar="DIR",
        type=Path,
        help="After the rounds, record the (first) llmgw gateway and the raw proxy with py-spy during "
        "one more c=64 run per mode each: raw collapsed stacks into DIR, and tables of where their "
        "CPU time goes.",
    )
    parser.add_argument("--seconds", type=float, default=5.0, help="Duration of each throughput run.")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--latency-requests", type=int, default=2000)
    parser.add_argument("--gateway-cpu", default="0")
    parser.add_argument("--client-cpu", default="1")
    parser.add_argument(
        "--no-access-log", action="store_true", help="Gateway without its per-request log line."
    )
    parser.add_argument(
        "--loops",
        default="auto",
        help="Event loops of llmgw, comma-separated (auto, asyncio, uvloop): one gateway each, "
        "measured side by side in the same run; e.g. asyncio,uvloop.",
    )
    parser.add_argument(
        "--http-servers",
        default="",
        help="HTTP servers of llmgw's public listener, comma-separated (httptools, aiohttp: "
        "gateway.http_server): one gateway each, measured side by side; e.g. httptools,aiohttp.",
    )
    args = parser.parse_args()
    if args.upstream:
        run_upstream(args.upstream)
        return
    if args.minimal:
        run_minimal(*args.minimal)
        return
    if args.rounds < 1:
        parser.error("--rounds: at least 1")

    os.sched_setaffinity(0, {int(args.client_cpu)})
    print(f"event loop of the bench's own processes: {LOOP}; load average {os.getloadavg()}")
    work = Path(tempfile.mkdtemp(prefix="llmgw-bench-"))
    up_port = free_port()
    procs = [
        subprocess.Popen(
            ["taskset", "-c", args.client_cpu, sys.executable, __file__, "--upstream", str(up_port)]
        )
    ]
    runs: dict[tuple[str, str], list[dict[str, float]]] = {}  # (mode, target): one per round
    gateways: list[Gateway] = []
    try:
        wait_port(up_port)
        targets, gateways = start_targets(args, work, up_port, procs)
        time.sleep(1.0)  # first health check done
        for r in range(args.rounds):
            order = targets[r % len(targets) :] + targets[: r % len(targets)]
            for mode, stream in MODES.items():
                for t in order:
                    runs.setdefault((mode, t.name), []).append(measure(t, stream, args))
            print(f"round {r + 1} of {args.rounds} done; load average {os.getloadavg()}", file=sys.stderr)
        if args.profile:
            for t in targets:  # the gateway, and the raw proxy for the protocol's own cost
                if t.name == targets[1].name or t.name == "raw-httptools":
                    profile(t, args, runs)
        rss = {t.name: rss_mib(t.pid) for t in targets if t.pid}
    finally:
        for p in reversed(procs):
            p.terminate()
            p.wait(30)
        for g in gateways:
            g.log.close()

    lines = {g.name: (g.dir / "gateway.log").read_bytes().count(b"\n") for g in gateways}
    shutil.rmtree(work)
    for g in gateways:
        print(f"{g.name}: log lines: {lines[g.name]}")
    report(runs, targets, rss, gateways, args.rounds)


def median(runs: list[dict[str, float]], field: str) -> float:
    return statistics.median(r[field] for r in runs)


def report(
    runs: dict[tuple[str, str], list[dict[str, float]]],
    targets: list[Target],
    rss: dict[str, float],
    gateways: list[Gateway],
    rounds: int,
) -> None:
    """Markdown tables: every figure (medians over the rounds), then the summary per proxy."""
    print(f"\nMedians over {rounds} round(s):\n")
    print(
        "| mode | target | c=1 p50 ms | c=1 p99 ms | c=1 TTFB p50 ms | c=1 TTFB p99 ms | c=64 req/s "
        "| c=64 proxy CPU us/req |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for (mode, target), r in runs.items():
        cpu_text = f"{median(r, 'cpu_us'):.0f}" if median(r, "cpu_us") else ""
        print(
            f"| {mode} | {target} | {median(r, 'p50_ms'):.3f} | {median(r, 'p99_ms'):.3f} | "
            f"{median(r, 'ttfb_p50_ms'):.3f} | {median(r, 'ttfb_p99_ms'):.3f} | {median(r, 'rps'):,.0f} | {cpu_text} |"
        )
    if rounds > 1:
        print("\nc=64 rate (and the proxy's CPU us per request) in each round:\n")
        for (mode, target), r in runs.items():
            each = (f"{x['rps']:,.0f}" + (f" ({x['cpu_us']:.0f})" if x["cpu_us"] else "") for x in r)
            print(f"- {mode} {target}: " + " / ".join(each))

    print("\nPer proxy (medians over the rounds; CPU: the proxy process's user+system time):\n")
    print(
        "| target | req/s c=64 | streams/s c=64 | p50 c=1 ms | added p50 ms | stream TTFB p50 ms "
        "| CPU-s / 1k req | CPU-s / 1k streams | RSS MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    direct = median(runs["plain", "direct"], "p50_ms")
    for t in targets:
        plain, stream = runs["plain", t.name], runs["stream50", t.name]
        cpu_plain, cpu_stream = median(plain, "cpu_us") / 1000, median(stream, "cpu_us") / 1000
        print(
            f"| {t.name} | {median(plain, 'rps'):,.0f} | {median(stream, 'rps'):,.0f} | "
            f"{median(plain, 'p50_ms'):.3f} | {median(plain, 'p50_ms') - direct:+.3f} | "
            f"{median(stream, 'ttfb_p50_ms'):.3f} | "
            + (f"{cpu_plain:.3f} | {cpu_stream:.3f} | {rss[t.name]:.1f} |" if t.pid else "| | |")
        )

    names = {t.name for t in targets}
    print()
    for g in gateways:
        for other in PROXIES[1:]:
            if other not in names:
                continue
            for mode in MODES:
                mine, theirs = runs[mode, g.name], runs[mode, other]
                per_round = " / ".join(
                    f"{a['rps'] / b['rps']:.2f}" for a, b in zip(mine, theirs, strict=True)
                )
                cpu = median(theirs, "cpu_us") / median(mine, "cpu_us") if median(mine, "cpu_us") else 0.0
                print(
                    f"{mode}: {g.name} / {other}: {median(mine, 'rps') / median(theirs, 'rps'):.3f} "
                    f"(ratio of the medians; per round {per_round}); by CPU per request "
                    f"({other}'s / {g.name}'s, steadier on a busy machine): {cpu:.3f}"
                )
    if len(gateways) == 2:
        a, b = gateways
        for mode in MODES:
            ratio = median(runs[mode, b.name], "rps") / median(runs[mode, a.name], "rps")
            cpu_ratio = median(runs[mode, b.name], "cpu_us") / median(runs[mode, a.name], "cpu_us")
            print(f"{mode}: c=64 {b.name} / {a.name}: req/s {ratio:.3f}, CPU per request {cpu_ratio:.3f}")


# --- the profile ----------------------------------------------------------------------


def profile(
    target: Target, args: argparse.Namespace, runs: dict[tuple[str, str], list[dict[str, float]]]
) -> None:
    """py-spy on ``target`` during one more c=64 run per mode (its rate then is lower: py-spy
    stops the process for each sample). The µs per part are its share of the samples times
    the CPU time per request measured in the rounds, without py-spy."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        raise SystemExit("--profile needs py-spy: .venv/bin/pip install py-spy")
    sys.path.insert(0, str(Path(__file__).parent))
    import profile_parts  # noqa: PLC0415 (bench/profile_parts.py, only with --profile)

    assert target.pid is not None
    args.profile.mkdir(parents=True, exist_ok=True)
    for mode, stream in MODES.items():
        out = args.profile / f"{target.name}-{mode}.txt"
        seconds = 2 * args.seconds  # twice a round's run: more samples
        record = [spy, "record", "--pid", str(target.pid), "--rate", "250", "--format", "raw"]
        record += ["--duration", str(round(seconds + 1)), "--output", str(out)]  # +1: the warm-up
        recorder = subprocess.Popen(record, stdout=subprocess.DEVNULL)
        run_loop(throughput(target.port, stream, target.key, args.concurrency, seconds))
        recorder.wait(60)
        cpu_us = median(runs[mode, target.name], "cpu_us")
        print(
            f"\nWhere {target.name}'s CPU goes, {mode}, c={args.concurrency} ({out.name}, {cpu_us:.0f} us "
            f"per request in the rounds; py-spy {' '.join(record[1:])}):\n"
        )
        print(profile_parts.table(profile_parts.parts(out.read_text()), cpu_us))


class Gateway:
    """One `llmgw gateway run` in its own folder: cluster file, replica file, key, log."""

    def __init__(
        self,
        work: Path,
        name: str,
        loop: str,
        upstream: int,
        *,
        store: str | None = None,
        env: dict[str, str] | None = None,
        more_upstreams: tuple[int, ...] = (),
        gateway: dict[str, Any] | None = None,
        model: dict[str, Any] | None = None,
    ) -> None:
        """``store``: a PostgreSQL URL for ``gateway.store`` (its password in ``env``'s
        ``LLMGW_STORE_PASSWORD``); SQLite in the gateway's folder without it.
        ``more_upstreams``: ports of the model's other replicas; ``gateway`` and ``model``:
        more settings of the cluster file's gateway and of its one model."""
        self.name, self.loop = name, loop
        self.dir = work / name
        self.dir.mkdir()
        self.port, admin_port, metrics_port = free_port(), free_port(), free_port()
        self.metrics_port = metrics_port
        self.cluster = self.dir / "cluster.yaml"
        self.cluster.write_text(
            json.dumps(
                {
                    "cluster": {"name": "bench"},
                    "gateway": {
                        "listen": f"127.0.0.1:{self.port}",
                        "admin_listen": f"127.0.0.1:{admin_port}",
                        "metrics_listen": f"127.0.0.1:{metrics_port}",
                        "state_dir": str(self.dir / "state"),
                        **({"store": store} if store else {}),
                        **(gateway or {}),
                    },
                    "nodes": [{"name": "n1", "address": "127.0.0.1", "connection": "local"}],
                    "profiles": {"p": {"engine": "vllm"}},
                    "models": [
                        {
                            "name": "bench",
                            "source": "org/bench",
                            "profile": "p",
                            "scaling": {"min": 1, "max": 1},
                            **(model or {}),
                        }
                    ],
                }
            )
        )
        (self.dir / "replicas.yaml").write_text(
            json.dumps({"bench": [f"127.0.0.1:{port}" for port in (upstream, *more_upstreams)]})
        )
        (self.dir / "engine.env").write_text(f"LLMGW_ENGINE_KEY={ENGINE_KEY}\n")
        self.key = subprocess.run(
            [*LLMGW, "keys", "create", "-f", str(self.cluster), "--name", "bench"],
            check=True,
            capture_output=True,
            text=True,
            env=env,
        ).stdout.strip()
        self.log = (self.dir / "gateway.log").open("wb")

    def command(self) -> list[str]:
        return [
            *LLMGW,
            "gateway",
            "run",
            "-f",
            str(self.cluster),
            "--replicas",
            str(self.dir / "replicas.yaml"),
            "--engine-key-file",
            str(self.dir / "engine.env"),
            "--event-loop",
            self.loop,
        ]


if __name__ == "__main__":
    main()
