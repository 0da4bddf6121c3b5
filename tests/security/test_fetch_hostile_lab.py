"""The weights fetcher attacked on a lab node, as `llmgw fetch` runs it there (over SSH, as
root): the engines' account (`llmgw`, uid 4242) has planted links beside a model's target
in /data/models, pointing at a root-only file of the node. The file must stay intact and
the command must say what it found."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw_cli.lab.nodefs import LAB_UID
from tests.integration.conftest import Lab
from tests.integration.test_fetch_lab import _cluster, _model, fetch, origin
from tests.integration.weights_origin import Origin

pytestmark = pytest.mark.integration

__all__ = ["origin"]  # the lab origin fixture (nginx on the lab bridge, trusted by the nodes)

MiB = 1 << 20
NODE = "node02"
CANARY = "/etc/llmgw-test-canary"  # stands for /etc/shadow, which the lab's logins need
TARGET = "/data/models/bad.bin"  # a name the origin fixture cleans up after the test


@pytest.fixture
def canary(lab: Lab) -> Iterator[str]:
    done = lab.ssh(NODE, f"umask 077 && echo 'root:$6$canary:19000::::::' > {CANARY} && sha256sum {CANARY}")
    assert done.returncode == 0, done.stderr
    yield done.stdout.split()[0]
    lab.ssh(NODE, f"rm -f {CANARY}")


def plant(lab: Lab, link: str) -> None:
    done = lab.ssh(NODE, f"ln -s {CANARY} {link} && chown -h {LAB_UID}:{LAB_UID} {link}")
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("planted", [".bad.bin.fetch-status", "bad.bin.part", "bad.bin"])
def test_links_planted_by_the_engine_account_leave_the_root_file_intact(
    lab: Lab, origin: Origin, canary: str, tmp_path: Path, planted: str
) -> None:
    digest = origin.add("bad.bin", 2 * MiB, seed=7)
    if planted == "bad.bin.part":  # a meta file naming the URL makes the fetcher resume it
        meta = json.dumps({"url": origin.url("bad.bin")})
        lab.ssh(
            NODE,
            f"echo '{meta}' > /data/models/.bad.bin.fetch-meta && chown {LAB_UID} /data/models/.bad.bin.fetch-meta",
        )
    plant(lab, f"/data/models/{planted}")
    cluster = _cluster(lab, tmp_path, [_model("bad", origin.url("bad.bin"), digest)])
    done = fetch(cluster, "bad", "--nodes", NODE)
    after = lab.ssh(NODE, f"sha256sum {CANARY}").stdout.split()[0]
    assert after == canary, "the root file was written through the planted link"
    assert done.returncode == 1, done.stdout + done.stderr
    assert "is a symbolic link" in " ".join(done.stdout.split()), done.stdout  # the table wraps
    assert lab.ssh(NODE, f"test -L /data/models/{planted}").returncode == 0  # left for the operator
