#!/usr/bin/env python3
"""A whole repository onto the lab's four nodes: `llmgw fetch` against huggingface_hub's own
`hf download` run on every node at once, from the same origin, side by side.

    flock /tmp/llmgw-lab.lock .venv/bin/python bench/snapshot.py --runs 3

Boots the 4-node lab (`llmgw lab up`, root) and takes it down at the end. The origin is
the tests' Hub stand-in (tests/hub_standin.py: the Hub's API and resolve URLs) behind
Debian's nginx over TLS on the lab bridge, nginx also serving the CDN the LFS files
redirect to; nginx's access log counts the bytes that left the origin. The repository:
``--shards`` safetensors shards of ``--shard-mib`` each (random bytes), a config, an index
and a tokenizer file. Per run, in this order:

- `hf download` on one node: the baseline the target is stated against;
- `hf download` on every node at once (what each node's engine would do by itself);
- `llmgw fetch` of the model (``fetch: {}``) onto every node: one Hub download per fabric,
  the other nodes copying each file from a peer as it lands.

Reports wall time and origin bytes per run, and medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.soak import boot
from tests.hub_standin import HubStandin
from tests.integration.conftest import STATE, Lab, llmgw
from tests.integration.lab_helpers import origin_on_the_bridge
from tests.integration.weights_origin import Origin

HF = Path(sys.executable).with_name("hf")
INCLUDE = ["*.json", "*.safetensors"]  # what llmgw's default selection keeps of this repo


def repo_files(shards: int, shard_bytes: int) -> dict[str, bytes]:
    names = [f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)]
    index = {"metadata": {}, "weight_map": {f"layer.{i}": n for i, n in enumerate(names)}}
    return {
        "config.json": b'{"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096}',
        "model.safetensors.index.json": json.dumps(index).encode(),
        "tokenizer.json": b'{"version": "1.0"}',
        **{n: os.urandom(shard_bytes) for n in names},
    }


def origin_bytes(origin: Origin) -> int:
    return sum(int(str(e["sent"])) for e in origin.log() if str(e["uri"]).startswith(("/blobs/", "/lab/")))


def clean(lab: Lab) -> None:
    with ThreadPoolExecutor(len(lab.nodes)) as pool:
        list(pool.map(lambda n: lab.ssh(n.name, "rm -rf /data/models/hf /data/bench-hf"), lab.nodes))


def hf_download(lab: Lab, node: str, endpoint: str) -> None:
    include = " ".join(f"--include '{p}'" for p in INCLUDE)
    done = lab.ssh(
        node,
        f"HF_ENDPOINT={endpoint} HF_HOME=/data/bench-hf/home HF_HUB_DISABLE_TELEMETRY=1 "
        f"{HF} download lab/shards {include} --local-dir /data/bench-hf/shards >/dev/null",
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr


def timed_hf(lab: Lab, origin: Origin, endpoint: str, nodes: list[str]) -> tuple[float, int]:
    clean(lab)
    origin.clear_log()
    started = time.monotonic()
    with ThreadPoolExecutor(len(nodes)) as pool:
        list(pool.map(lambda n: hf_download(lab, n, endpoint), nodes))
    return time.monotonic() - started, origin_bytes(origin)


def timed_llmgw(lab: Lab, origin: Origin, endpoint: str, cluster: Path) -> tuple[float, int]:
    clean(lab)
    origin.clear_log()
    env = {**os.environ, "HF_ENDPOINT": endpoint, "SSL_CERT_FILE": str(origin.cert)}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "llmgw_cli", "fetch", "--yes", "-f", str(cluster)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    seconds = time.monotonic() - started
    assert done.returncode == 0, done.stdout + done.stderr
    return seconds, origin_bytes(origin)


def cluster_file(lab: Lab, folder: Path) -> Path:
    data = yaml.safe_load(lab.cluster_file.read_text())
    data["models"] = [
        {
            "name": "shards",
            "source": "lab/shards",
            "profile": "vllm",
            "fetch": {},
            "scaling": {"min": 0, "max": 1},
        }
    ]
    path = folder / "cluster.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--shard-mib", type=int, default=256)
    args = parser.parse_args()
    lab = boot()
    rows: dict[str, list[tuple[float, int]]] = {"hf 1 node": [], "hf 4 nodes": [], "llmgw 4 nodes": []}
    try:
        with tempfile.TemporaryDirectory() as tmp, HubStandin() as standin:
            files = repo_files(args.shards, args.shard_mib << 20)
            standin.repo("lab/shards").push(files)
            size = sum(len(v) for v in files.values())
            port = int(standin.url.rsplit(":", 1)[1])
            with origin_on_the_bridge(lab, Path(tmp) / "origin", hub_port=port) as origin:
                # the CDN on another origin (nginx's other port), as the Hub's is: huggingface_hub
                # follows a resolve redirect on its HEAD only within the same origin
                standin.cdn_url = f"https://{origin.host}:{origin.other_port}"
                standin.write_blobs(origin.www)
                endpoint = origin.url("/").rstrip("/")
                cluster = cluster_file(lab, Path(tmp))
                nodes = [n.name for n in lab.nodes]
                print(f"repository: {len(files)} files, {size / 2**30:.2f} GiB; {len(nodes)} nodes")
                for run in range(1, args.runs + 1):
                    for name, measure in (
                        ("hf 1 node", lambda: timed_hf(lab, origin, endpoint, nodes[:1])),
                        ("hf 4 nodes", lambda: timed_hf(lab, origin, endpoint, nodes)),
                        ("llmgw 4 nodes", lambda: timed_llmgw(lab, origin, endpoint, cluster)),
                    ):
                        seconds, sent = measure()
                        rows[name].append((seconds, sent))
                        print(
                            f"run {run}  {name:14s} {seconds:7.2f} s  origin sent {sent / 2**30:6.2f} GiB",
                            flush=True,
                        )
                clean(lab)
    finally:
        llmgw("lab", "down", "--state", str(STATE), check=False)
    print("\nmedians:")
    base = statistics.median(s for s, _ in rows["hf 1 node"])
    for name, values in rows.items():
        seconds = statistics.median(s for s, _ in values)
        sent = statistics.median(b for _, b in values)
        print(
            f"  {name:14s} {seconds:7.2f} s  ({seconds / base:4.2f}x one hf download)  origin {sent / 2**30:6.2f} GiB"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
