"""Weight fetch throughput against plain curl from the same origin, and origin bytes for
N nodes with peers on and off.

Needs root and nginx (scripts/weights-packages.txt). Everything runs on loopback: a real
nginx over TLS serves the file, the nodes are ``connection: local`` with temporary
weights folders. Usage: ``.venv/bin/python bench/fetch.py [--mib 256] [--nodes 4]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.weights.fetch import Peers, plan_fetch
from llmgw_cli.remote.fetch import Fetcher
from tests.integration.weights_origin import Origin, start_origin


def run_fetch(o: Origin, root: Path, nodes: int, peers: Peers, tag: str) -> tuple[float, int]:
    node_lines = "".join(
        f"  - {{name: n{i}, address: 127.0.0.{i}, connection: local, fabric: ib0, "
        f"weights: [{root}/{tag}/n{i}]}}\n"
        for i in range(1, nodes + 1)
    )
    spec = parse_cluster(
        "cluster: {name: b}\nfabrics: {ib0: {kind: infiniband}}\nnodes:\n" + node_lines
        + f"profiles: {{p: {{engine: llama-server}}}}\nmodels:\n"
        f"  - {{name: m, source: '{o.url('bench.gguf')}', profile: p}}\n"
    )  # fmt: skip
    o.clear_log()

    async def go() -> float:
        f = Fetcher(spec, root, lambda _e: None)
        started = time.monotonic()
        results = await f.run(
            plan_fetch(spec, {"m": [f"n{i}" for i in range(1, nodes + 1)]}, set(), set(), peers)
        )
        await f.close()
        assert all(r.ok for r in results), results
        return time.monotonic() - started

    seconds = asyncio.run(go())
    sent = sum(int(str(e["sent"])) for e in o.gets("bench.gguf"))
    return seconds, sent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--nodes", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        o = start_origin(root / "origin")
        os.environ["SSL_CERT_FILE"] = str(o.cert)
        try:
            size = args.mib << 20
            o.add("bench.gguf", size)
            started = time.monotonic()
            subprocess.run(
                ["curl", "-sS", "--cacert", str(o.cert), "-o", str(root / "curl.out"), o.url("bench.gguf")],
                check=True,
            )
            curl = time.monotonic() - started
            print(f"curl            1 node   {args.mib} MiB  {curl:6.2f}s  {args.mib / curl:6.0f} MiB/s")
            one, sent = run_fetch(o, root, 1, Peers.fabric, "one")
            print(
                f"llmgw fetch     1 node   {args.mib} MiB  {one:6.2f}s  {args.mib / one:6.0f} MiB/s  origin sent {sent >> 20} MiB"
            )
            for peers in (Peers.fabric, Peers.off):
                seconds, sent = run_fetch(o, root, args.nodes, peers, f"n-{peers}")
                print(
                    f"peers={peers:<7} {args.nodes} nodes  {args.mib} MiB  {seconds:6.2f}s  origin sent {sent >> 20} MiB"
                )
        finally:
            o.stop()


if __name__ == "__main__":
    main()
