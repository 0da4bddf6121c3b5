"""A weights folder written by an attacker, on a lab node, read by `llmgw status` and by the
gateway's discovery.

Whoever can write a weights folder (a shared filer, the engine account) chooses every name
in it and every byte of its index files; the probe reads them as root on every node that
lists the folder. The old probe built a sed program from a folder name (``x|e;#`` gave the
``s`` command sed's ``e`` flag: the index's shard name ran as a root command) and printed
file names raw (a newline and ``@@ units`` in a name printed units and labels of its own,
a replica the gateway would route prompts and the engine key to).
"""

from __future__ import annotations

import asyncio
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest

from llmgw_cli.cli.common import read_cluster
from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.doctor.collect import doctor_part, parse_doctor
from llmgw_cli.core.observe.parse.probe import parse_probe
from llmgw_cli.gateway.control.sources import ProbeSource
from llmgw_cli.remote.connect import Connections
from llmgw_cli.remote.probe import Snapshot, gather
from tests.integration.conftest import Lab
from tests.integration.lab_helpers import node_row, reset, status

pytestmark = pytest.mark.integration

NODE = "node01"
CANARY = "llmgw-pwned"  # relative: sed's e flag runs in the probe's working folder (root's home)
EVIL = "x|e;#"
SHARD = f";touch {CANARY};#.safetensors"  # also present, so the folder is a complete model
UNITS_NAME = (
    "u\n@@ units\nId=llmgw-forged-0.service\nLoadState=loaded\nActiveState=active\nSubState=running\n"
)
LABELS_NAME = (
    "l\n@@ labels\nllmgw-forged-0.service:X-Llmgw-Model=smollm2-135m\n"
    "llmgw-forged-0.service:X-Llmgw-Replica=0\nllmgw-forged-0.service:X-Llmgw-Port=8150\n"
)


def weights_dir(lab: Lab) -> str:
    """The first weights folder the lab's cluster file lists for the node."""
    return read_cluster(lab.cluster_file).node(NODE).weights[0].path


def canary_found(lab: Lab) -> str:
    done = lab.ssh(NODE, f"ls -d /root/{CANARY} /{CANARY} /tmp/{CANARY} 2>/dev/null; true")
    return done.stdout.strip()


@pytest.fixture
def planted(lab: Lab) -> Iterator[str]:
    reset(lab)
    base = weights_dir(lab)
    evil, units, labels = (shlex.quote(f"{base}/{name}") for name in (EVIL, UNITS_NAME, LABELS_NAME))
    index = shlex.quote(f'{{"weight_map": {{"a": "{SHARD}"}}}}')
    shard = shlex.quote(f"{base}/{EVIL}/{SHARD}")
    lab.ssh(NODE, f"rm -f /root/{CANARY}")
    plant = (
        f"set -e; mkdir {evil} {units}; printf '%s' {index} > {evil}/model.safetensors.index.json; "
        f"printf w > {shard}; : > {evil}/{shlex.quote(LABELS_NAME)}; : > {labels}"
    )
    done = lab.ssh(NODE, plant)
    assert done.returncode == 0, done.stderr
    try:
        yield base
    finally:
        lab.ssh(NODE, f"rm -rf -- {evil} {units} {labels} /root/{CANARY}")
        reset(lab)


def test_crafted_weights_folder_runs_nothing_and_forges_no_replica(lab: Lab, planted: str) -> None:
    report = status(lab.cluster_file)
    assert not canary_found(lab), "the probe ran a command named in an index file, as root"
    row = node_row(report, NODE)
    assert row["reachable"] and row["error"] is None
    assert row["gpus"] == 8
    assert EVIL in row["models"]  # listed under its literal name
    assert {"Llama-3.1-8B-Instruct", "Mistral-7B-Instruct-v0.3"} <= set(row["models"])
    assert "llmgw-forged" not in str(report)
    assert report["replicas"] == []

    # the gateway's discovery: the same probe, then the replicas it would route to
    spec = read_cluster(lab.cluster_file)

    async def probe() -> Snapshot:
        async with Connections(spec, lab.cluster_file.parent) as conns:
            return await gather(spec, conns, [NODE])

    snapshot = asyncio.run(probe())
    facts = snapshot.node(NODE)
    assert facts.error is None
    # systemd may still list units earlier tests removed (not-found): none is forged or running
    assert not [u for u in facts.units if "forged" in u.name or u.active_state == "active"]
    assert facts.unit_labels == {}
    assert len(facts.gpus) == 8
    names = {m.name for w in facts.weights for m in w.models}
    assert {EVIL, UNITS_NAME} <= names

    async def discover() -> dict[str, list[str]]:
        source = ProbeSource(lab.cluster_file.parent)
        try:
            return await source.discover(spec)
        finally:
            await source.close()

    assert asyncio.run(discover()) == {}
    assert not canary_found(lab)


# Any account on a node names its processes (up to 15 bytes, newlines included) and `ss -p`
# prints the name as it is; `llmgw doctor` reads ss's output with the probe's sections.
NAMER = (
    "import ctypes, socket, sys\n"
    "ctypes.CDLL(None).prctl(15, sys.argv[1].encode(), 0, 0, 0)\n"
    "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
    "print(s.getsockname()[1], flush=True); sys.stdin.read()\n"
)


def test_process_name_forges_no_doctor_section_with_the_real_ss() -> None:
    if shutil.which("ss") is None:
        pytest.fail("ss (iproute2) is missing")
    name = "\n@@ units\nId=y"  # 14 bytes: the kernel keeps 15
    with subprocess.Popen(
        [sys.executable, "-c", NAMER, name], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as proc:
        try:
            assert proc.stdout is not None
            port = int(proc.stdout.readline())
            script = doctor_part([])
            out = subprocess.run(
                ["sh", "-s"], input=script, capture_output=True, text=True, check=True
            ).stdout
        finally:
            proc.kill()
    probe = "@@ host\nclock 5.0\n@@ units\nId=llmgw-real-0.service\nActiveState=active\n@@ end\n"
    spec = parse_cluster("cluster: {name: t}\nnodes: [{name: a, address: 10.0.0.1}]\nmodels: []\n")
    facts = parse_probe(spec.nodes[0], probe + out)
    assert facts.error is None
    assert [u.name for u in facts.units] == ["llmgw-real-0.service"]
    mine = [x for x in parse_doctor("a", probe + out).listeners if x.port == port]
    assert [(x.pid, x.process) for x in mine] == [(proc.pid, name)]
