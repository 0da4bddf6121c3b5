"""Weights on the lab: the real `llmgw fetch` over SSH onto lab nodes, from Debian's nginx
on the lab bridge (TLS, its certificate added to each node's CA bundle). The origin's
access log counts what it really sent: a killed download resumes with the rest only; four
nodes of one fabric cost the origin one download (the others copy from peers over the
lab network); a wrong checksum, a 404 and a gated file fail with a clear error."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from llmgw_cli.node.fetch_disk import side_files
from tests.integration.weights_origin import Origin
from tests.waiting import wait_until

from .conftest import Lab
from .lab_helpers import origin_on_the_bridge, reset

pytestmark = pytest.mark.integration

MiB = 1 << 20
FILES = ("slow.bin", "fast.bin", "bad.bin", "gated.bin")


@pytest.fixture
def origin(lab: Lab, tmp_path: Path) -> Iterator[Origin]:
    reset(lab)
    try:
        with origin_on_the_bridge(lab, tmp_path / "origin") as o:
            yield o
    finally:
        names = " ".join(f"/data/models/{f} /data/models/{f}.part /data/models/.{f}.*" for f in FILES)
        for node in lab.nodes:
            lab.ssh(node.name, f"rm -f {names}")


def _cluster(lab: Lab, folder: Path, models: list[dict[str, object]]) -> Path:
    data = yaml.safe_load(lab.cluster_file.read_text())
    data["models"] = models
    path = folder / "cluster.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _model(name: str, url: str, sha256: str) -> dict[str, object]:
    return {
        "name": name,
        "source": url,
        "sha256": sha256,
        "profile": "llama-cpp",
        "scaling": {"min": 0, "max": 1},
    }


def fetch(cluster: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmgw_cli", "fetch", "--yes", "-f", str(cluster), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def node_sha(lab: Lab, node: str, path: str) -> str:
    return lab.ssh(node, f"sha256sum {path} 2>/dev/null").stdout.split(" ")[0]


def node_status(lab: Lab, node: str, target: str) -> dict[str, object]:
    text = lab.ssh(node, f"cat {side_files(target)['status']} 2>/dev/null").stdout
    try:
        data = json.loads(text)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def test_fetch_on_the_lab(lab: Lab, origin: Origin, tmp_path: Path) -> None:
    slow = origin.add("slow.bin", 160 * MiB, seed=1)
    fast = origin.add("fast.bin", 64 * MiB, seed=2)
    origin.add("bad.bin", 2 * MiB, seed=3)
    gated_sha = origin.add("gated.bin", 2 * MiB, seed=4)
    cluster = _cluster(
        lab,
        tmp_path,
        [
            _model("slow", origin.url("slow/slow.bin"), slow),  # nginx sends it at 24 MiB/s
            _model("fast", origin.url("fast.bin"), fast),
            _model("bad", origin.url("bad.bin"), "0" * 64),
            _model("gone", origin.url("gone.bin"), "1" * 64),
            _model("gated", origin.url("gated/gated.bin"), gated_sha),
        ],
    )

    # Kill mid-download (the CLI and the node's download), then resume.
    target = "/data/models/slow.bin"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llmgw_cli",
            "fetch",
            "--yes",
            "-f",
            str(cluster),
            "slow",
            "--nodes",
            "node01",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    st = wait_until(
        lambda: node_status(lab, "node01", target),
        until=lambda st: int(str(st.get("bytes") or 0)) >= 40 * MiB and st.get("pid"),
        timeout=60,
        interval=0.2,
        what="node01's download to reach 40 MiB",
    )
    proc.kill()
    proc.wait()
    lab.ssh("node01", f"kill -9 {st['pid']}")
    time.sleep(0.5)
    assert lab.ssh("node01", f"test -e {target}").returncode != 0  # never visible half-done
    have = int(lab.ssh("node01", f"stat -c %s {target}.part").stdout)
    assert 0 < have < 160 * MiB
    done = fetch(cluster, "slow", "--nodes", "node01")
    assert done.returncode == 0, done.stdout + done.stderr
    assert node_sha(lab, "node01", target) == slow
    gets = origin.gets("slow.bin")
    assert gets[-1]["status"] == 206 and gets[-1]["range"] == f"bytes={have}-"
    assert gets[-1]["sent"] == 160 * MiB - have  # the rest, not the whole again
    assert sum(int(str(g["sent"])) for g in gets) < 160 * MiB + 32 * MiB

    # Four nodes of one fabric: one download from the origin, peers for the rest.
    done = fetch(cluster, "fast")
    assert done.returncode == 0, done.stdout + done.stderr
    for node in lab.nodes:
        assert node_sha(lab, node.name, "/data/models/fast.bin") == fast, node.name
    served = origin.gets("fast.bin")
    assert [g["status"] for g in served] == [200] and served[0]["sent"] == 64 * MiB

    # Wrong checksum: refused, nothing left under either name.
    bad = fetch(cluster, "bad", "--nodes", "node02")
    assert bad.returncode == 1 and "sha256" in (bad.stdout + bad.stderr).lower()
    assert lab.ssh("node02", "ls /data/models/bad.bin /data/models/bad.bin.part").returncode != 0

    # 404 and a gated file: clear errors naming the model's URL.
    gone = fetch(cluster, "gone", "--nodes", "node02")
    assert gone.returncode == 1 and "404" in gone.stdout and origin.url("gone.bin") in gone.stdout
    gated = fetch(cluster, "gated", "--nodes", "node02")
    assert gated.returncode == 1 and "401" in gated.stdout and "token" in gated.stdout.lower()
