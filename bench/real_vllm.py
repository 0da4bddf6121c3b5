#!/usr/bin/env python3
"""The gateway's cost in front of real vLLM: the same replica reached directly and through
`llmgw gateway run`, side by side in one run.

    .venv/bin/python bench/real_vllm.py                       # c = 1, 8, 32; 20 s each
    .venv/bin/python bench/real_vllm.py --seconds 30 --rounds 3

One vLLM (its CPU build from scripts/setup, serving SmolLM2-135M in the Hugging Face format
on 127.0.0.1 with its key in ``VLLM_API_KEY``) and one gateway with everything on (key
check, usage metering, metrics, the access log) routing to it through ``--replicas``.
Every request streams a chat completion of exactly ``--tokens`` tokens (``ignore_eos``)
with ``stream_options.include_usage``. For each concurrency, the direct and the gateway
runs alternate ``--rounds`` times (the machine's noise falls on both), and the figures
are medians over rounds:

- tokens/s: completion tokens (vLLM's own usage counts) per second of the run;
- TTFT p50/p90: from sending the request to the first content chunk;
- the gateway's overhead: throughput lost (%) and TTFT added (ms), gateway - direct.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gateway import Gateway, free_port, wait_port  # noqa: E402

ENGINE_KEY = "bench-engine-key"  # bench.gateway.Gateway gives its gateway this engine key
MODEL = "bench"  # the name bench.gateway.Gateway's cluster file serves


def path_from(*cmd: str) -> list[str]:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split()


def start_vllm(work: Path, port: int) -> subprocess.Popen[bytes]:
    gguf = path_from(sys.executable, str(ROOT / "scripts/fetch-smollm2"), "--no-install")[0]
    venv, model = path_from(
        str(ROOT / "scripts/build-vllm-cpu"), "--print-path", "--no-build", "--model", gguf
    )
    env = {
        **os.environ,
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        # unpinned, one thread: vLLM's default binds every instance to core 0 (docs/lab-engines.md)
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        "VLLM_API_KEY": ENGINE_KEY,
        "VLLM_CACHE_ROOT": str(work / "vllm-cache"),
        "TMPDIR": str(work),
    }
    argv = [f"{venv}/bin/vllm", "serve", model, "--host", "127.0.0.1", "--port", str(port)]
    argv += [
        "--served-model-name",
        MODEL,
        "--enforce-eager",
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "2048",
    ]
    log = (work / "vllm.log").open("wb")
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_health(url: str, seconds: float = 300) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} not healthy after {seconds}s")


async def one(client: httpx.AsyncClient, url: str, key: str, tokens: int) -> tuple[float, int]:
    """(seconds to the first content chunk, completion tokens) of one streamed chat."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first, done = 0.0, 0
    async with client.stream("POST", url, json=body, headers={"Authorization": f"Bearer {key}"}) as answer:
        answer.raise_for_status()
        async for line in answer.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if not first and event.get("choices") and event["choices"][0].get("delta", {}).get("content"):
                first = time.perf_counter() - t0
            if event.get("usage"):
                done = int(event["usage"]["completion_tokens"])
    return first, done


async def run(url: str, key: str, concurrency: int, seconds: float, tokens: int) -> dict[str, float]:
    ttfts: list[float] = []
    total = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        until = time.monotonic() + seconds
        t0 = time.monotonic()

        async def worker() -> None:
            nonlocal total
            while time.monotonic() < until:
                first, done = await one(client, url, key, tokens)
                ttfts.append(first)
                total += done

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.monotonic() - t0
    ttfts.sort()
    return {
        "tokens_per_s": total / elapsed,
        "ttft_p50_ms": 1000 * ttfts[len(ttfts) // 2],
        "ttft_p90_ms": 1000 * ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.9))],
        "requests": len(ttfts),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--seconds", type=float, default=20.0, help="Length of each run.")
    parser.add_argument("--rounds", type=int, default=2, help="Direct/gateway pairs per concurrency.")
    parser.add_argument("--tokens", type=int, default=64, help="Completion tokens per request.")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="llmgw-bench-vllm-"))
    port = free_port()
    vllm = start_vllm(work, port)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        print(f"vLLM healthy in {wait_health(f'http://127.0.0.1:{port}/health'):.1f}s", flush=True)
        gw = Gateway(work, "llmgw", "auto", port)
        procs.append(subprocess.Popen(gw.command(), stdout=gw.log, stderr=subprocess.STDOUT))
        wait_port(gw.port)
        time.sleep(1.0)  # the gateway's first health check of the replica
        targets = {
            "direct": (f"http://127.0.0.1:{port}/v1/chat/completions", ENGINE_KEY),
            "gateway": (f"http://127.0.0.1:{gw.port}/v1/chat/completions", gw.key),
        }
        asyncio.run(run(*targets["direct"], 4, 5, args.tokens))  # warm-up
        rows = []
        for c in (int(x) for x in args.concurrency.split(",")):
            seen: dict[str, list[dict[str, float]]] = {"direct": [], "gateway": []}
            for r in range(args.rounds):
                order = ("direct", "gateway") if r % 2 == 0 else ("gateway", "direct")
                for name in order:
                    got = asyncio.run(run(*targets[name], c, args.seconds, args.tokens))
                    seen[name].append(got)
                    print(
                        f"c={c} round {r + 1} {name}: {json.dumps({k: round(v, 1) for k, v in got.items()})}",
                        flush=True,
                    )
            med = {n: {k: statistics.median(x[k] for x in v) for k in v[0]} for n, v in seen.items()}
            lost = 100 * (1 - med["gateway"]["tokens_per_s"] / med["direct"]["tokens_per_s"])
            added = med["gateway"]["ttft_p50_ms"] - med["direct"]["ttft_p50_ms"]
            rows.append((c, med, lost, added))
        print(
            "\n| c | direct tok/s | gateway tok/s | lost | direct TTFT p50/p90 ms | gateway TTFT p50/p90 ms | TTFT p50 added |"
        )
        print("|---|---|---|---|---|---|---|")
        for c, med, lost, added in rows:
            d, g = med["direct"], med["gateway"]
            print(
                f"| {c} | {d['tokens_per_s']:.1f} | {g['tokens_per_s']:.1f} | {lost:+.1f} % | "
                f"{d['ttft_p50_ms']:.1f} / {d['ttft_p90_ms']:.1f} | {g['ttft_p50_ms']:.1f} / {g['ttft_p90_ms']:.1f} | "
                f"{added:+.1f} ms |"
            )
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(15)
        os.killpg(vllm.pid, signal.SIGTERM)
        vllm.wait(30)


if __name__ == "__main__":
    main()
