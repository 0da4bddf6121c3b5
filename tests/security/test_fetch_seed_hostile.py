"""Attacks on an unpinned file's copies between nodes: the seed's file is changed in its
weights folder (same size, other bytes) by an account that can write there, after the
seed downloaded it from the origin. Without a pinned sha256, what the origin sent is known
only from the seed's own record of its download; every copy must match that record, and
the seed's file must match it before it counts as held.

Real node program as root on ``connection: local`` nodes, a real nginx origin on loopback
(``tests/integration/test_fetch.py``). The lab runs the same attack over SSH
(``test_fetch_seed_lab.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.weights.fetch import Peers, plan_fetch
from llmgw_cli.node.fetch_disk import side_files
from llmgw_cli.remote.fetch import Fetcher, FetchResult, held_on_nodes
from tests.integration.test_fetch import cluster, fetch, model, sha
from tests.integration.weights_origin import Origin, trusted_origin

pytestmark = pytest.mark.integration

MiB = 1 << 20


@pytest.fixture(scope="module")
def origin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Origin]:
    yield from trusted_origin(
        tmp_path_factory.mktemp("origin"),
        "the fetcher runs as root on a node; these attacks need root to be real",
    )


class TamperingFetcher(Fetcher):
    """A fetcher that lets ``tamper(node, path)`` change a seed's file the moment before
    the seed starts serving it: after every check the control host makes of the seed."""

    tamper: Callable[[str, str], None] = staticmethod(lambda node, path: None)

    async def call(self, node: str, config: dict[str, Any]) -> dict[str, Any]:
        if config.get("mode") == "serve":
            self.tamper(node, str(config["file"]))
        return await super().call(node, config)


def fetch_tampering(
    spec: ClusterSpec, base: Path, wanted: dict[str, list[str]], tamper: Callable[[str, str], None]
) -> list[FetchResult]:
    async def go() -> list[FetchResult]:
        f = TamperingFetcher(spec, base, lambda _e: None)
        f.tamper = tamper
        try:
            held = await held_on_nodes(f, spec, wanted)
            return await f.run(plan_fetch(spec, wanted, held, set(), Peers.fabric))
        finally:
            await f.close()

    return asyncio.run(go())


def overwrite_in_place(path: Path) -> None:
    """Another writer of the weights folder's files (a shared filer's other client; the
    lab test does it as the engines' account) rewrites the file: same size, other bytes."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.write(b"EVIL" * (size // 4))
    assert path.stat().st_size == size


def test_a_seed_changed_after_its_check_is_refused_by_every_peer(origin: Origin, tmp_path: Path) -> None:
    digest = origin.add("window.gguf", 4 * MiB)
    spec = cluster(tmp_path, model("m", origin.url("window.gguf")), nodes=3)
    [first] = fetch(spec, tmp_path, {"m": ["n1"]})
    assert first.ok and first.source == "origin", first
    seed = tmp_path / "n1" / "window.gguf"

    def tamper(node: str, path: str) -> None:
        assert (node, path) == ("n1", str(seed))
        overwrite_in_place(seed)

    results = fetch_tampering(spec, tmp_path, {"m": ["n2", "n3"]}, tamper)
    assert sorted(r.node for r in results) == ["n2", "n3"], results
    for r in results:
        assert not r.ok and r.kind == "seed-changed", r
        assert str(tmp_path / r.node / "window.gguf") in r.message and "n1" in r.message, r.message
        assert digest in r.message and "sha256" in r.message, r.message  # what the origin sent
        for name in ("window.gguf", "window.gguf.part"):
            assert not (tmp_path / r.node / name).exists(), (r.node, name)
        assert not Path(side_files(str(tmp_path / r.node / "window.gguf"))["origin"]).exists()
    assert len(origin.gets("window.gguf")) == 1  # refused, not made up for from the origin


def test_a_seed_changed_before_the_fetch_is_not_a_seed(origin: Origin, tmp_path: Path) -> None:
    """Changed at the same size between two fetches: its record no longer matches, so it
    is hashed, downloaded again, and only then copied from."""
    digest = origin.add("before.gguf", 4 * MiB)
    spec = cluster(tmp_path, model("m", origin.url("before.gguf")), nodes=2)
    [first] = fetch(spec, tmp_path, {"m": ["n1"]})
    assert first.ok, first
    overwrite_in_place(tmp_path / "n1" / "before.gguf")
    results = fetch(spec, tmp_path, {"m": ["n1", "n2"]})
    assert all(r.ok for r in results), results
    for node in ("n1", "n2"):
        assert sha(tmp_path / node / "before.gguf") == digest, node
    assert len(origin.gets("before.gguf")) == 2


def test_a_seed_of_another_size_than_its_record_is_downloaded_again(origin: Origin, tmp_path: Path) -> None:
    digest = origin.add("size.gguf", 2 * MiB)
    spec = cluster(tmp_path, model("m", origin.url("size.gguf")), nodes=1)
    [first] = fetch(spec, tmp_path, {"m": ["n1"]})
    assert first.ok, first
    with open(tmp_path / "n1" / "size.gguf", "ab") as f:
        f.write(b"more")
    [again] = fetch(spec, tmp_path, {"m": ["n1"]})
    assert again.ok and again.state == "done", again
    assert sha(tmp_path / "n1" / "size.gguf") == digest
