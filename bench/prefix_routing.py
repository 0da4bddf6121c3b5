#!/usr/bin/env python3
"""Routing by the engines' own signals against round robin, on two real vLLM replicas of
one model behind one gateway with two workers, same run for every policy.

    .venv/bin/python bench/prefix_routing.py                      # c = 4, 16; all policies
    .venv/bin/python bench/prefix_routing.py --concurrency 4 --policies round_robin,prefix

Engines: two vLLM (the CPU build from scripts/setup, SmolLM2-135M in the Hugging Face
format) on 127.0.0.1, each with a KV cache of ``--kv-blocks`` blocks of 128 tokens
(default 48: 6,144 tokens). The workload's four system prompts are about 6,000 tokens
together, so one replica cannot keep all of them cached while it serves: the regime a
serving fleet is in (more distinct prefixes than one engine's cache), and the one where
routing decides the hit rate. With a cache that holds everything, round robin's hit rate
catches up after one miss per prompt per replica.

Chat workload (``chat``): 16 conversations; conversation j opens with system prompt
j mod 4 (about 1,500 tokens of words drawn from a fixed seed; 4 conversations share
each) and goes on for ``--turns`` user turns of about 40 tokens. Each turn streams a chat
completion of ``--tokens`` tokens (``ignore_eos``) whose reply joins the conversation. At
concurrency c, at most c turns are in flight (a conversation's turns one after another).
Before each policy's run the engines' prefix caches are emptied (vLLM's
``/reset_prefix_cache``, served with ``VLLM_SERVER_DEV_MODE=1``) and the gateway is
started again with that policy in its cluster file. Figures per run:

- TTFT p50/p90: from sending a turn to its first content chunk;
- tokens/s: completion tokens (vLLM's usage counts) per second of the run;
- prefix-cache hit rate: the change of ``vllm:prefix_cache_hits_total`` over that of
  ``vllm:prefix_cache_queries_total`` (prompt tokens), summed over both engines;
- the gateway's route decisions by reason (``llmgw_route_decisions_total``).

Skew test (``skew``): ``--busy`` long generations (``--busy-tokens`` tokens each) are sent
to one engine directly, past the gateway, so the gateway's own in-flight counts are
equal and only the engine's signals show the load; once that engine reports them running
and the gateway has read it (two signal intervals), ``--short`` short requests (under
256 characters: no prefix key) go through the gateway at concurrency 2. The share that
landed on the busy replica comes from each engine's ``vllm:request_success_total``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gateway import Gateway, free_port, wait_port  # noqa: E402
from bench.real_vllm import ENGINE_KEY, MODEL, path_from, wait_health  # noqa: E402
from bench.workers import wait_ready  # noqa: E402

PROMPTS = 4
CONVERSATIONS = 16
WORDS = [
    "river",
    "stone",
    "light",
    "harbor",
    "engine",
    "window",
    "market",
    "garden",
    "signal",
    "winter",
    "copper",
    "forest",
    "ledger",
    "orbit",
    "canvas",
    "thunder",
    "meadow",
    "lantern",
    "archive",
    "valley",
    "cipher",
    "beacon",
    "granite",
    "harvest",
    "compass",
    "quartz",
    "prairie",
    "violet",
    "anchor",
    "summit",
    "glacier",
    "ember",
    "falcon",
    "mosaic",
    "tundra",
    "velvet",
    "saddle",
    "cobalt",
    "island",
    "furnace",
    "willow",
    "pepper",
    "marble",
    "rocket",
]


def system_prompt(i: int, words: int) -> str:
    rng = random.Random(1000 + i)
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"You are assistant number {i} of the bench company. Keep these notes in mind: {body}"


def user_turn(conversation: int, turn: int) -> str:
    rng = random.Random(conversation * 100 + turn)
    words = " ".join(rng.choice(WORDS) for _ in range(30))
    return f"Conversation {conversation}, question {turn}: say something about {words}."


def start_vllm(work: Path, port: int, blocks: int) -> subprocess.Popen[bytes]:
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
        "VLLM_SERVER_DEV_MODE": "1",  # serves /reset_prefix_cache
        "VLLM_CACHE_ROOT": str(work / f"vllm-cache-{port}"),
        "TMPDIR": str(work),
    }
    argv = [f"{venv}/bin/vllm", "serve", model, "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--served-model-name", MODEL, "--enforce-eager", "--dtype", "bfloat16"]
    argv += ["--max-model-len", "2048", "--num-gpu-blocks-override", str(blocks)]
    log = (work / f"vllm-{port}.log").open("wb")
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def scrape(url: str) -> dict[str, float]:
    """Each sample name of a /metrics page, its values summed over labels."""
    sums: dict[str, float] = {}
    text = httpx.get(url, timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


@dataclass
class Turn:
    ttft: float
    tokens: int
    prompt_tokens: int
    reply: str


async def turn(
    client: httpx.AsyncClient, url: str, key: str, messages: list[dict[str, str]], tokens: int
) -> Turn:
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first, done, prompt, text = 0.0, 0, 0, []
    async with client.stream("POST", url, json=body, headers={"Authorization": f"Bearer {key}"}) as answer:
        if answer.status_code != 200:
            raise SystemExit(f"{answer.status_code}: {(await answer.aread())[:500]!r}")
        async for line in answer.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            piece = event["choices"][0].get("delta", {}).get("content") if event.get("choices") else None
            if piece:
                first = first or time.perf_counter() - t0
                text.append(piece)
            if event.get("usage"):
                done, prompt = int(event["usage"]["completion_tokens"]), int(event["usage"]["prompt_tokens"])
    return Turn(first, done, prompt, "".join(text))


async def chat(
    url: str, key: str, concurrency: int, *, turns: int, tokens: int, words: int
) -> dict[str, Any]:
    prompts = [system_prompt(i, words) for i in range(PROMPTS)]
    gate = asyncio.Semaphore(concurrency)
    seen: list[Turn] = []
    firsts: list[int] = []  # the prompt tokens of each conversation's first turn
    order = list(range(CONVERSATIONS))
    random.Random(7).shuffle(order)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def conversation(j: int) -> None:
            messages = [{"role": "system", "content": prompts[j % PROMPTS]}]
            for k in range(turns):
                messages.append({"role": "user", "content": user_turn(j, k)})
                async with gate:
                    got = await turn(client, url, key, messages, tokens)
                seen.append(got)
                if k == 0:
                    firsts.append(got.prompt_tokens)
                messages.append({"role": "assistant", "content": got.reply})

        t0 = time.monotonic()
        await asyncio.gather(*(conversation(j) for j in order))
        elapsed = time.monotonic() - t0
    ttfts = sorted(t.ttft for t in seen)
    return {
        "turns": len(seen),
        "seconds": elapsed,
        "tokens_per_s": sum(t.tokens for t in seen) / elapsed,
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p90_ms": 1000 * ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.9))],
        "first_turn_prompt_tokens": statistics.median(firsts),
    }


class Bench:
    def __init__(self, work: Path, ports: list[int], workers: int) -> None:
        self.work, self.ports, self.workers = work, ports, workers
        self.proc: subprocess.Popen[bytes] | None = None
        self.gw: Gateway | None = None
        self.runs = 0

    def gateway(self, policy: str) -> Gateway:
        self.stop_gateway()
        self.runs += 1
        gw = Gateway(
            self.work,
            f"gw-{self.runs}-{policy}",
            "auto",
            self.ports[0],
            more_upstreams=tuple(self.ports[1:]),
            gateway={"workers": self.workers},
            model={"routing": {"policy": policy}},
        )
        self.proc = subprocess.Popen(gw.command(), stdout=gw.log, stderr=subprocess.STDOUT)
        wait_port(gw.port)
        wait_ready(gw.dir / "gateway.log", self.workers)
        time.sleep(3.0)  # both replicas health-checked and scraped by every worker
        self.gw = gw
        return gw

    def stop_gateway(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(30)
            self.proc = None

    def engines(self) -> list[dict[str, float]]:
        return [scrape(f"http://127.0.0.1:{p}/metrics") for p in self.ports]

    def routes(self) -> dict[str, float]:
        assert self.gw is not None
        text = httpx.get(f"http://127.0.0.1:{self.gw.metrics_port}/metrics", timeout=10).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "llmgw_route_decisions_total":
                    out[s.labels["reason"]] = out.get(s.labels["reason"], 0.0) + s.value
        return out

    def reset_caches(self) -> None:
        for p in self.ports:
            r = httpx.post(
                f"http://127.0.0.1:{p}/reset_prefix_cache",
                headers={"Authorization": f"Bearer {ENGINE_KEY}"},
                timeout=30,
            )
            r.raise_for_status()


def run_chat(bench: Bench, policy: str, c: int, args: argparse.Namespace) -> dict[str, Any]:
    gw = bench.gateway(policy)
    bench.reset_caches()
    before = bench.engines()
    got = asyncio.run(
        chat(
            f"http://127.0.0.1:{gw.port}/v1/chat/completions",
            gw.key,
            c,
            turns=args.turns,
            tokens=args.tokens,
            words=args.words,
        )
    )
    after = bench.engines()
    hits = sum(delta(a, b, "vllm:prefix_cache_hits_total") for a, b in zip(after, before, strict=True))
    queries = sum(delta(a, b, "vllm:prefix_cache_queries_total") for a, b in zip(after, before, strict=True))
    per_engine = [delta(a, b, "vllm:request_success_total") for a, b in zip(after, before, strict=True)]
    got.update(hit_rate=hits / queries if queries else 0.0, per_engine=per_engine, routes=bench.routes())
    return got


async def skew(bench: Bench, policy: str, args: argparse.Namespace) -> dict[str, Any]:
    gw = bench.gateway(policy)
    busy_url = f"http://127.0.0.1:{bench.ports[0]}/v1/chat/completions"
    url = f"http://127.0.0.1:{gw.port}/v1/chat/completions"
    async with httpx.AsyncClient(timeout=600) as client:
        long_ones = [
            asyncio.create_task(
                turn(
                    client,
                    busy_url,
                    ENGINE_KEY,
                    [{"role": "user", "content": f"Story {i}."}],
                    args.busy_tokens,
                )
            )
            for i in range(args.busy)
        ]
        deadline = time.monotonic() + 120
        while (
            scrape(f"http://127.0.0.1:{bench.ports[0]}/metrics").get("vllm:num_requests_running", 0)
            < args.busy
        ):
            if time.monotonic() > deadline:
                raise SystemExit("the busy engine never ran its long generations")
            await asyncio.sleep(0.2)
        await asyncio.sleep(2.5)  # two of the gateway's signal intervals (1 s, jittered)
        before = bench.engines()
        gate = asyncio.Semaphore(2)

        async def short(i: int) -> None:
            async with gate:
                await turn(client, url, gw.key, [{"role": "user", "content": f"Say {i}."}], 4)

        await asyncio.gather(*(short(i) for i in range(args.short)))
        after = bench.engines()
        for task in long_ones:
            task.cancel()
        await asyncio.gather(*long_ones, return_exceptions=True)
    served = [delta(a, b, "vllm:request_success_total") for a, b in zip(after, before, strict=True)]
    return {"on_busy": served[0], "on_other": served[1], "share_on_busy": served[0] / max(1.0, sum(served))}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", default="4,16")
    parser.add_argument("--policies", default="round_robin,least_load,prefix")
    parser.add_argument("--turns", type=int, default=4, help="User turns per conversation.")
    parser.add_argument("--tokens", type=int, default=16, help="Completion tokens per turn.")
    parser.add_argument(
        "--words", type=int, default=1150, help="Words per system prompt (about 1,500 tokens)."
    )
    parser.add_argument(
        "--kv-blocks", type=int, default=48, help="Each engine's KV cache, in 128-token blocks."
    )
    parser.add_argument("--workers", type=int, default=2, help="Gateway workers.")
    parser.add_argument("--busy", type=int, default=4, help="Skew test: long generations on one engine.")
    parser.add_argument("--busy-tokens", type=int, default=1500)
    parser.add_argument(
        "--short", type=int, default=40, help="Skew test: short requests through the gateway."
    )
    parser.add_argument("--skip", default="", help="Comma-separated parts to skip: chat, skew.")
    args = parser.parse_args()
    policies = args.policies.split(",")
    work = Path(tempfile.mkdtemp(prefix="llmgw-bench-routing-"))
    ports = [free_port(), free_port()]
    engines = [start_vllm(work, p, args.kv_blocks) for p in ports]
    bench = Bench(work, ports, args.workers)
    try:
        for p in ports:
            print(f"vLLM on {p} healthy in {wait_health(f'http://127.0.0.1:{p}/health'):.1f}s", flush=True)
        chats: dict[tuple[int, str], dict[str, Any]] = {}
        if "chat" not in args.skip:
            for c in (int(x) for x in args.concurrency.split(",")):
                for policy in policies:
                    got = run_chat(bench, policy, c, args)
                    chats[(c, policy)] = got
                    shown = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in got.items()}
                    print(f"chat c={c} {policy}: {json.dumps(shown)}", flush=True)
        skews: dict[str, dict[str, Any]] = {}
        if "skew" not in args.skip:
            for policy in policies:
                skews[policy] = asyncio.run(skew(bench, policy, args))
                print(f"skew {policy}: {json.dumps(skews[policy])}", flush=True)
        if chats:
            print(
                "\n| c | policy | TTFT p50 ms | TTFT p90 ms | tokens/s | prefix-cache hit rate | turns per engine | route reasons |"
            )
            print("|---|---|---|---|---|---|---|---|")
            for (c, policy), g in chats.items():
                reasons = ", ".join(f"{k} {v:.0f}" for k, v in sorted(g["routes"].items()))
                print(
                    f"| {c} | {policy} | {g['ttft_p50_ms']:.0f} | {g['ttft_p90_ms']:.0f} | {g['tokens_per_s']:.1f} | "
                    f"{100 * g['hit_rate']:.1f} % | {' / '.join(f'{x:.0f}' for x in g['per_engine'])} | {reasons} |"
                )
            for c in sorted({c for c, _ in chats}):
                rr, px = chats.get((c, "round_robin")), chats.get((c, "prefix"))
                if rr and px:
                    print(
                        f"c={c}: prefix / round_robin: hit rate {px['hit_rate'] / max(rr['hit_rate'], 1e-9):.2f}x, "
                        f"TTFT p90 {px['ttft_p90_ms'] / rr['ttft_p90_ms']:.2f}x"
                    )
        if skews:
            print("\n| policy | short requests on the busy replica | on the other |")
            print("|---|---|---|")
            for policy, s in skews.items():
                print(
                    f"| {policy} | {s['on_busy']:.0f} ({100 * s['share_on_busy']:.0f} %) | {s['on_other']:.0f} |"
                )
    finally:
        bench.stop_gateway()
        for e in engines:
            os.killpg(e.pid, signal.SIGTERM)
        for e in engines:
            e.wait(30)


if __name__ == "__main__":
    main()
