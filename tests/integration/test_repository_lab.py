"""Whole Hugging Face repositories on the lab: `llmgw apply` resolves a model's revision
through the Hub's API (a stand-in written from that API, behind Debian's nginx on the lab
bridge, which also serves its CDN and logs every byte it sends), fetches the snapshot onto
four nodes of one fabric, and starts the simulated vLLM from the local folder with the Hub
switched off. The stand-in and nginx count what left the origin: one copy of each shard.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.hub_standin import HubStandin, Repo
from tests.integration.weights_origin import Origin
from tests.waiting import wait_until

from .conftest import Lab
from .lab_helpers import llmgw_units, origin_on_the_bridge, reset

pytestmark = pytest.mark.integration

SHARDS = 4
SHARD_BYTES = 3 << 20
UNIT = "llmgw-shards-{}.service"


def repo_files(seed: int) -> dict[str, bytes]:
    rng = random.Random(seed)
    shards = {
        f"model-{i:05d}-of-{SHARDS:05d}.safetensors": rng.randbytes(SHARD_BYTES) for i in range(1, SHARDS + 1)
    }
    index = {"metadata": {}, "weight_map": {f"layer.{i}": name for i, name in enumerate(shards)}}
    return {
        "config.json": b'{"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096}',
        "model.safetensors.index.json": json.dumps(index).encode(),
        "tokenizer.json": b'{"version": "1.0"}',
        "README.md": b"# not fetched by default\n",
        "original/consolidated.pth": rng.randbytes(1 << 20),  # left out by the default selection
        **shards,
    }


@dataclass
class Hub:
    standin: HubStandin
    origin: Origin
    repo: Repo
    endpoint: str


@pytest.fixture
def hub(lab: Lab, tmp_path: Path) -> Iterator[Hub]:
    reset(lab)
    with HubStandin() as standin:
        repo = standin.repo("lab/shards")
        repo.push(repo_files(1))
        port = int(standin.url.rsplit(":", 1)[1])
        with origin_on_the_bridge(lab, tmp_path / "origin", hub_port=port) as origin:
            standin.cdn_url = origin.url("/cdn").rstrip("/")
            standin.write_blobs(origin.www)
            try:
                yield Hub(standin, origin, repo, origin.url("/").rstrip("/"))
            finally:
                reset(lab)
                for node in lab.nodes:
                    lab.ssh(node.name, "rm -rf /data/models/hf")


def cluster(lab: Lab, folder: Path, source: str) -> Path:
    data = yaml.safe_load(lab.cluster_file.read_text())
    data["models"] = [
        {
            "name": "shards",
            "source": source,
            "profile": "vllm",
            "tensor_parallel": 8,  # every card of a node: one replica on each of the four
            "fetch": {},
            "scaling": {"min": len(lab.nodes), "max": len(lab.nodes)},
        }
    ]
    path = folder / "cluster.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def llmgw(hub: Hub, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "SSL_CERT_FILE": str(hub.origin.cert)}
    env.pop("HF_TOKEN", None)
    return subprocess.run(
        [sys.executable, "-m", "llmgw_cli", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )


def unit_text(lab: Lab, node: str, unit: str) -> str:
    return lab.ssh(node, f"cat /etc/systemd/system/{unit}").stdout


def test_a_repository_is_fetched_once_per_fabric_and_the_engine_runs_from_disk(
    lab: Lab, hub: Hub, tmp_path: Path
) -> None:
    commit = hub.repo.refs["main"]
    file = cluster(lab, tmp_path, "lab/shards@main")
    done = llmgw(hub, "apply", "-f", str(file), "--yes")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"repository lab/shards@main: commit {commit[:12]}" in done.stderr

    # every node holds the snapshot, complete, with only the default files
    folder = f"/data/models/hf/lab--shards/{commit}"
    shard_names = sorted(n for n in repo_files(1) if n.endswith(".safetensors"))
    wanted = sorted(["config.json", "model.safetensors.index.json", "tokenizer.json", *shard_names])
    files = hub.repo.commits[commit]
    for node in lab.nodes:
        listed = lab.ssh(node.name, f"cd {folder} && find . -type f | sed 's|^./||' | sort").stdout.split()
        assert listed == wanted, (node.name, listed)
        sums = lab.ssh(node.name, f"cd {folder} && sha256sum {' '.join(shard_names)}").stdout.split()
        assert sums[0::2] == [hashlib.sha256(files[n]).hexdigest() for n in shard_names]
        assert (
            lab.ssh(node.name, f"test -s /data/models/hf/lab--shards/{commit}.manifest.json").returncode == 0
        )

    # one copy of each shard left the origin; the other three nodes copied from a peer
    for name in shard_names:
        sha = hashlib.sha256(files[name]).hexdigest()
        sent = sum(int(e["sent"]) for e in hub.origin.log() if e["uri"] == f"/cdn/blobs/{sha}")
        assert sent == SHARD_BYTES, (name, sent)

    # each node runs a replica of the simulated vLLM from the local folder, offline
    units = llmgw_units(lab)
    running = sorted(u for us in units.values() for u in us if u.startswith("llmgw-shards-"))
    assert running == [UNIT.format(i) for i in range(len(lab.nodes))]
    for node, names in units.items():
        for unit in (u for u in names if u.startswith("llmgw-shards-")):
            text = unit_text(lab, node, unit)
            assert f" serve {folder} " in text, text
            assert "HF_HUB_OFFLINE=1" in text, text
            active = lab.ssh(node, f"systemctl is-active {unit}").stdout.strip()
            assert active == "active", lab.ssh(node, f"journalctl -u {unit} -n 20 --no-pager").stdout

    # main moves on the Hub: what runs stays at the commit the plan chose
    newer = hub.repo.push(repo_files(2) | {"config.json": files["config.json"]})
    hub.standin.write_blobs(hub.origin.www)
    for node, names in units.items():
        for unit in (u for u in names if u.startswith("llmgw-shards-")):
            assert f" serve {folder} " in unit_text(lab, node, unit)
    planned = llmgw(hub, "plan", "-f", str(file))
    assert planned.returncode == 0, planned.stdout + planned.stderr
    assert f"repository lab/shards@main: commit {newer[:12]}" in planned.stderr  # the next apply moves it


def test_fetch_brings_a_repository_and_a_shard_changed_on_a_node_is_fetched_again(
    lab: Lab, hub: Hub, tmp_path: Path
) -> None:
    commit = hub.repo.refs["main"]
    file = cluster(lab, tmp_path, "lab/shards")
    first = llmgw(hub, "fetch", "--yes", "-f", str(file))
    assert first.returncode == 0, first.stdout + first.stderr
    assert "4 repository snapshot(s)" in first.stdout
    files = hub.repo.commits[commit]
    shard = sorted(n for n in files if n.endswith(".safetensors"))[1]
    sha = hashlib.sha256(files[shard]).hexdigest()
    sent = sum(int(e["sent"]) for e in hub.origin.log() if e["uri"] == f"/cdn/blobs/{sha}")
    assert sent == SHARD_BYTES

    # the same size, other bytes: the node's quick check sees the file changed since it was
    # checked, hashes it, and replaces it by a verified copy (from a peer that holds it)
    victim = lab.nodes[2].name
    path = f"/data/models/hf/lab--shards/{commit}/{shard}"
    lab.ssh(victim, f"printf 'XXXX' | dd of={path} bs=1 seek=1000 conv=notrunc status=none")
    assert lab.ssh(victim, f"sha256sum {path}").stdout.split()[0] != sha
    again = llmgw(hub, "fetch", "--yes", "-f", str(file), "--json")
    assert again.returncode == 0, again.stdout + again.stderr
    results = {r["node"]: r for r in json.loads(again.stdout)["results"]}
    assert results[victim]["state"] == "done" and results[victim]["source"] != "origin", results[victim]
    assert {n: r["state"] for n, r in results.items() if n != victim} == {
        n.name: "present" for n in lab.nodes if n.name != victim
    }
    assert lab.ssh(victim, f"sha256sum {path}").stdout.split()[0] == sha
    sent = sum(int(e["sent"]) for e in hub.origin.log() if e["uri"] == f"/cdn/blobs/{sha}")
    assert sent == SHARD_BYTES  # the copy came from a peer: still one from the origin


BIG_SHARD = 64 << 20  # through nginx's /slow/ (24 MiB/s): near 3 s each, time to cut one


def held(hub: Hub, file: Path, node: str) -> list[str]:
    """What ``llmgw status`` says ``node`` holds, complete."""
    shown = llmgw(hub, "status", "-f", str(file), "--json")
    assert shown.returncode in (0, 1), shown.stdout + shown.stderr
    (row,) = [n for n in json.loads(shown.stdout)["nodes"] if n["name"] == node]
    return list(row["models"])


def kill_fetch_midway(lab: Lab, hub: Hub, file: Path, repo: str, commit: str, *, past: int) -> None:
    """Start ``llmgw fetch`` onto node01, and kill it and the node's job once a shard is in
    place and a file being downloaded (a ``.part`` in the job's work folder) holds
    ``past`` bytes: the job's status is rewritten at most twice a second (and at each
    file's end), too seldom to catch a shard that takes about that long half in."""
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "SSL_CERT_FILE": str(hub.origin.cert)}
    env.pop("HF_TOKEN", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmgw_cli", "fetch", "--yes", "-f", str(file), "--nodes", "node01"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    # after a first shard is in place, so that the resume shows finished shards are kept
    half = (
        f"ls {repo}/{commit}/*.safetensors >/dev/null 2>&1 && "
        f"find {repo}/.{commit}.snapshot-work -name '*.part' -size +{past}c 2>/dev/null"
    )
    status = f"{repo}/.{commit}.snapshot-status"
    try:
        # one command finds the half file and kills the job that writes it (its pid from
        # the job's status), so the file cannot finish in between
        wait_until(
            lambda: (
                lab.ssh(
                    "node01",
                    f"{half} | grep -q . && kill -9 $(grep -o '\"pid\": [0-9]*' {status} | cut -d' ' -f2)",
                ).returncode
                == 0
            ),
            timeout=120,
            interval=0.1,
            what=f"a file of node01's snapshot job to have {past} bytes",
        )
    finally:
        proc.kill()
        proc.wait()


def test_a_killed_snapshot_download_resumes_and_a_partial_snapshot_is_not_placed(
    lab: Lab, hub: Hub, tmp_path: Path
) -> None:
    rng = random.Random(3)
    names = [f"model-{i:05d}-of-00004.safetensors" for i in range(1, 5)]
    files = {
        "config.json": b'{"architectures": ["LlamaForCausalLM"]}',
        **{n: rng.randbytes(BIG_SHARD) for n in names},
    }
    commit = hub.standin.repo("lab/big").push(files)
    hub.standin.write_blobs(hub.origin.www)
    hub.standin.cdn_url = hub.origin.url("/slow").rstrip("/")
    file = cluster(lab, tmp_path, "lab/big")
    data = yaml.safe_load(file.read_text())
    data["models"][0]["scaling"] = {"min": 1, "max": 1}
    file.write_text(yaml.safe_dump(data, sort_keys=False))
    repo = "/data/models/hf/lab--big"
    name = f"hf/lab--big/{commit}"

    # killed (the CLI and the node's job) in the middle of a shard
    kill_fetch_midway(lab, hub, file, repo, commit, past=8 << 20)
    kept = lab.ssh("node01", f"cd {repo}/{commit} && ls *.safetensors").stdout.split()
    assert lab.ssh("node01", f"test -e {repo}/{commit}.manifest.json").returncode != 0
    assert name not in held(hub, file, "node01")  # no manifest: partial, not held

    hub.origin.clear_log()
    done = llmgw(hub, "fetch", "--yes", "-f", str(file), "--nodes", "node01")
    assert done.returncode == 0, done.stdout + done.stderr
    sums = lab.ssh("node01", f"cd {repo}/{commit} && sha256sum {' '.join(names)}").stdout.split()
    assert sums[0::2] == [hashlib.sha256(files[n]).hexdigest() for n in names]
    gets = [e for e in hub.origin.log() if str(e["uri"]).startswith("/slow/blobs/")]
    resumed = [e for e in gets if e["status"] == 206]
    assert resumed, gets  # the shard cut off is asked for from where it stopped
    start = int(str(resumed[0]["range"]).removeprefix("bytes=").rstrip("-"))
    assert 0 < start < BIG_SHARD and resumed[0]["sent"] == BIG_SHARD - start
    # the rest of the cut shard, and whole only the shards not finished before the kill
    assert sum(int(str(e["sent"])) for e in gets) == (len(names) - len(kept)) * BIG_SHARD - start
    assert name in held(hub, file, "node01")

    # node02 gets a whole copy; node01 loses a shard (its manifest stays): only node02 holds
    # the snapshot, and the replica goes there (by name alone node01 would come first)
    fetched = llmgw(hub, "fetch", "--yes", "-f", str(file), "--nodes", "node02")
    assert fetched.returncode == 0, fetched.stdout + fetched.stderr
    lab.ssh("node01", f"rm {repo}/{commit}/{names[2]}")
    assert name not in held(hub, file, "node01") and name in held(hub, file, "node02")
    planned = llmgw(hub, "plan", "-f", str(file), "--json")
    assert planned.returncode == 0, planned.stdout + planned.stderr
    starts = [a for a in json.loads(planned.stdout)["actions"] if a["model"] == "shards" and a["op"] != "="]
    assert [c["nodes"] for c in starts] == [["node02"]], starts
