"""The copy of an unpinned file between lab nodes, attacked: the engines' account (`llmgw`,
uid 4242) rewrites the seed's file in place (same size, other bytes) after the seed
downloaded it from the origin. Nothing pins the file's sha256, so the only witness of
what the origin sent is the seed's record of its own download; the other nodes must never
end up with the engines' bytes. Over SSH, as `llmgw fetch` runs: the file changed between
two fetches (the seed is checked, found changed and downloaded again before it seeds), and
changed after that check, the moment before the seed serves it (every peer refuses its
copy and keeps nothing)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.lab.nodefs import LAB_UID
from tests.integration.conftest import Lab
from tests.integration.test_fetch_lab import _cluster, fetch, node_sha, origin
from tests.integration.weights_origin import Origin
from tests.security.test_fetch_seed_hostile import fetch_tampering

pytestmark = pytest.mark.integration

__all__ = ["origin"]  # the lab origin fixture (nginx on the lab bridge, trusted by the nodes)

MiB = 1 << 20
NAME = "seeded.bin"
TARGET = f"/data/models/{NAME}"
SEED = "node01"
PEERS = ["node02", "node03", "node04"]


@pytest.fixture
def cleanup(lab: Lab) -> Iterator[None]:
    yield
    for node in lab.nodes:
        lab.ssh(node.name, f"rm -f {TARGET} {TARGET}.part /data/models/.{NAME}.*")


def engine_account_rewrites(lab: Lab, node: str) -> None:
    """The seed's file given to the engines' account (an operator's chown, or a filer that
    maps it so), which writes zeros over it without changing its size."""
    size = lab.ssh(node, f"stat -c %s {TARGET}").stdout.strip()
    done = lab.ssh(
        node,
        f"chown {LAB_UID} {TARGET} && setpriv --reuid={LAB_UID} --regid={LAB_UID} --clear-groups "
        f"dd if=/dev/zero of={TARGET} bs={size} count=1 conv=notrunc status=none && stat -c %s {TARGET}",
    )
    assert done.returncode == 0 and done.stdout.strip() == size, done.stdout + done.stderr


def fetched_on_the_seed(lab: Lab, origin: Origin, tmp_path: Path) -> tuple[Path, str]:
    """The cluster file of one unpinned model, its file fetched onto the seed only."""
    digest = origin.add(NAME, 8 * MiB, seed=11)
    model = {
        "name": "seeded",
        "source": origin.url(NAME),
        "profile": "llama-cpp",
        "scaling": {"min": 0, "max": 1},
    }
    cluster = _cluster(lab, tmp_path, [model])
    done = fetch(cluster, "seeded", "--nodes", SEED)
    assert done.returncode == 0, done.stdout + done.stderr
    return cluster, digest


def test_a_seed_changed_between_two_fetches_is_downloaded_again_before_it_seeds(
    lab: Lab, origin: Origin, tmp_path: Path, cleanup: None
) -> None:
    cluster, digest = fetched_on_the_seed(lab, origin, tmp_path)
    engine_account_rewrites(lab, SEED)
    done = fetch(cluster, "seeded")
    assert done.returncode == 0, done.stdout + done.stderr
    for node in [*PEERS, SEED]:
        assert node_sha(lab, node, TARGET) == digest, node
    assert len(origin.gets(NAME)) == 2  # the seed downloaded it again, once


def test_a_seed_changed_as_it_starts_serving_is_refused_by_every_peer(
    lab: Lab, origin: Origin, tmp_path: Path, cleanup: None
) -> None:
    cluster, digest = fetched_on_the_seed(lab, origin, tmp_path)
    spec = parse_cluster(cluster.read_text())
    results = fetch_tampering(
        spec, cluster.parent, {"seeded": PEERS}, lambda node, _path: engine_account_rewrites(lab, node)
    )
    assert sorted(r.node for r in results) == PEERS, results
    for r in results:
        assert not r.ok and r.kind == "seed-changed", r
        assert TARGET in r.message and SEED in r.message and digest in r.message, r.message
        there = lab.ssh(r.node, f"ls -a /data/models | grep -F {NAME}").stdout.split()
        assert NAME not in there and f"{NAME}.part" not in there, (r.node, there)
    assert len(origin.gets(NAME)) == 1  # refused, not made up for from the origin
