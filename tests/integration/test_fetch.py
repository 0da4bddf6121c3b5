"""Weight fetching against a real HTTPS origin (nginx on 127.0.0.1) onto ``connection:
local`` nodes whose weights folders are temporary folders. The origin's access log is
the witness: what was requested, with which Range, and how many bytes it really sent.
Nodes have distinct loopback addresses (127.0.0.1-4) so peers reach each other's server.
"""

from __future__ import annotations

import asyncio
import hashlib
import http.client
import json
import os
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.planning.plan import Action, Plan, UnitFile
from llmgw_cli.core.weights.fetch import Peers, plan_fetch
from llmgw_cli.node.fetch_disk import side_files
from llmgw_cli.remote.connect import Connections
from llmgw_cli.remote.fetch import (
    Fetcher,
    FetchEvent,
    FetchResult,
    held_on_nodes,
    node_script,
)
from llmgw_cli.remote.weights import ensure_for_plan
from tests.integration.weights_origin import TOKEN, Origin, trusted_origin
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

MiB = 1 << 20


@pytest.fixture(scope="module")
def origin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Origin]:
    yield from trusted_origin(
        tmp_path_factory.mktemp("origin"),
        "the origin runs nginx as root and the disk-full test mounts a tmpfs",
    )


def cluster(tmp_path: Path, models: str, nodes: int = 1, fabrics: tuple[str, ...] = ("ib0",)) -> ClusterSpec:
    return parse_cluster(cluster_text(tmp_path, models, nodes, fabrics))


def cluster_text(tmp_path: Path, models: str, nodes: int = 1, fabrics: tuple[str, ...] = ("ib0",)) -> str:
    lines = [
        f"  - {{name: n{i}, address: 127.0.0.{i}, connection: local, "
        f"fabric: {fabrics[(i - 1) * len(fabrics) // nodes]}, weights: [{tmp_path}/n{i}]}}"
        for i in range(1, nodes + 1)
    ]
    fabric_block = ", ".join(f"{f}: {{kind: infiniband}}" for f in fabrics)
    text = (
        f"cluster: {{name: t}}\nfabrics: {{{fabric_block}}}\nnodes:\n"
        + "\n".join(lines)
        + f"\nprofiles: {{p: {{engine: llama-server}}}}\nmodels:\n{models}"
    )
    return text


def model(name: str, url: str, sha256: str | None = None) -> str:
    checksum = f', sha256: "{sha256}"' if sha256 else ""
    return f'  - {{name: {name}, source: "{url}", profile: p{checksum}}}\n'


def fetch(
    spec: ClusterSpec,
    base: Path,
    wanted: dict[str, list[str]],
    *,
    peers: Peers = Peers.fabric,
    token: str | None = None,
    endpoint: str | None = None,
    events: list[FetchEvent] | None = None,
) -> list[FetchResult]:
    async def go() -> list[FetchResult]:
        f = Fetcher(
            spec,
            base,
            (events.append if events is not None else lambda _e: None),
            token=token,
            hf_endpoint=endpoint,
        )
        try:
            held = await held_on_nodes(f, spec, wanted)
            return await f.run(plan_fetch(spec, wanted, held, set(), peers))
        finally:
            await f.close()

    return asyncio.run(go())


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def status(target: Path) -> dict[str, object]:
    try:
        data = json.loads(Path(side_files(str(target))["status"]).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def start_detached(url: str, target: Path) -> None:
    """Start a node download directly (as the control host does), without waiting."""
    config = {"mode": "fetch", "url": url, "target": str(target), "sha256": None, "token": None}
    done = subprocess.run(
        ["python3", "-"], input=node_script(config), text=True, capture_output=True, check=True
    )
    assert json.loads(done.stdout.splitlines()[-1])["state"] == "started"


def wait_bytes(target: Path, at_least: int, timeout: float = 20) -> dict[str, object]:
    return wait_until(
        lambda: status(target),
        until=lambda st: int(str(st.get("bytes") or 0)) >= at_least and st.get("pid"),
        timeout=timeout,
        what=f"the download to reach {at_least} bytes",
    )


def kill_download(target: Path, at_least: int) -> int:
    """SIGKILL the node's download once it has ``at_least`` bytes; returns the partial size."""
    st = wait_bytes(target, at_least)
    os.kill(int(str(st["pid"])), signal.SIGKILL)
    lock = side_files(str(target))["lock"]
    wait_until(
        lambda: subprocess.run(["flock", "-n", lock, "true"], check=False).returncode == 0,
        timeout=5,
        what="the killed download's lock to be free",
    )
    return Path(str(target) + ".part").stat().st_size


def etag(o: Origin, path: str) -> str:
    context = ssl.create_default_context(cafile=str(o.cert))
    conn = http.client.HTTPSConnection("127.0.0.1", o.port, context=context)
    conn.request("HEAD", path)
    value = conn.getresponse().getheader("ETag") or ""
    conn.close()
    return value


# --- one node -------------------------------------------------------------------------


def test_full_fetch_verified_and_renamed(origin: Origin, tmp_path: Path) -> None:
    digest = origin.add("full.gguf", 96 * MiB)
    spec = cluster(tmp_path, model("m", origin.url("full.gguf"), digest))
    started = time.monotonic()
    [result] = fetch(spec, tmp_path, {"m": ["n1"]})
    seconds = time.monotonic() - started
    assert result.ok and result.state == "done", result
    target = tmp_path / "n1" / "full.gguf"
    assert sha(target) == digest
    assert not Path(str(target) + ".part").exists()
    gets = origin.gets("full.gguf")
    assert [(g["status"], g["sent"]) for g in gets] == [(200, 96 * MiB)]
    print(f"\n96 MiB over loopback TLS in {seconds:.2f}s: {96 / seconds:.0f} MiB/s")
    # a complete copy present means nothing is fetched
    assert fetch(spec, tmp_path, {"m": ["n1"]}) == []  # planned as present: no job at all
    assert len(origin.gets("full.gguf")) == 1


def test_a_correct_file_already_there_is_hashed_on_the_node_and_kept(origin: Origin, tmp_path: Path) -> None:
    """A file put there by hand (or before the fetcher remembered checks) is hashed once,
    by the detached job, and kept; the next run plans it as present from what the node
    remembers, without hashing or downloading."""
    digest = origin.add("kept.gguf", 8 * MiB)
    (tmp_path / "n1").mkdir()
    (tmp_path / "n1" / "kept.gguf").write_bytes((origin.www / "kept.gguf").read_bytes())
    spec = cluster(tmp_path, model("m", origin.url("kept.gguf"), digest))
    [result] = fetch(spec, tmp_path, {"m": ["n1"]})
    assert result.ok and result.state == "present", result
    assert status(tmp_path / "n1" / "kept.gguf")["sha256"] == digest
    assert fetch(spec, tmp_path, {"m": ["n1"]}) == []
    assert origin.gets("kept.gguf") == []


def test_killed_download_resumes_with_range_and_only_the_rest_is_sent(origin: Origin, tmp_path: Path) -> None:
    size = 48 * MiB
    digest = origin.add("resume.gguf", size)
    spec = cluster(tmp_path, model("m", origin.url("slow/resume.gguf"), digest))
    target = tmp_path / "n1" / "resume.gguf"
    start_detached(origin.url("slow/resume.gguf"), target)
    wait_bytes(target, 4 * MiB)
    assert not target.exists(), "a partial file must never be visible under the final name"
    have = kill_download(target, 8 * MiB)
    assert 0 < have < size
    [result] = fetch(spec, tmp_path, {"m": ["n1"]})
    assert result.ok, result
    assert sha(target) == digest
    first, second = origin.gets("resume.gguf")
    assert first["status"] == 200 and first["range"] == ""
    assert second["status"] == 206
    assert second["range"] == f"bytes={have}-"
    assert second["if_range"] == etag(origin, "/resume.gguf")
    assert second["sent"] == size - have  # the origin served the rest, not the whole again


def test_fetcher_restarts_a_download_that_died(origin: Origin, tmp_path: Path) -> None:
    """The control host notices the node's job died (lock free, not finished) and starts it
    again; it resumes."""
    size = 48 * MiB
    digest = origin.add("died.gguf", size)
    spec = cluster(tmp_path, model("m", origin.url("slow/died.gguf"), digest))
    target = tmp_path / "n1" / "died.gguf"

    async def go() -> list[FetchResult]:
        f = Fetcher(spec, tmp_path, lambda _e: None)
        task = asyncio.create_task(f.run(plan_fetch(spec, {"m": ["n1"]}, set(), set())))
        await asyncio.to_thread(kill_download, target, 8 * MiB)
        try:
            return await task
        finally:
            await f.close()

    [result] = asyncio.run(go())
    assert result.ok, result
    assert sha(target) == digest
    statuses = [g["status"] for g in origin.gets("died.gguf")]
    assert statuses == [200, 206]


def test_changed_origin_file_restarts_from_zero(origin: Origin, tmp_path: Path) -> None:
    size = 48 * MiB
    origin.add("changed.gguf", size)
    target = tmp_path / "n1" / "changed.gguf"
    start_detached(origin.url("slow/changed.gguf"), target)
    kill_download(target, 8 * MiB)
    new_digest = origin.add("changed.gguf", size, seed=1)
    later = time.time() + 60
    os.utime(origin.www / "changed.gguf", (later, later))  # nginx's ETag is mtime seconds + size
    spec = cluster(tmp_path, model("m", origin.url("slow/changed.gguf"), new_digest))
    [result] = fetch(spec, tmp_path, {"m": ["n1"]})
    assert result.ok, result
    assert sha(target) == new_digest
    last = origin.gets("changed.gguf")[-1]
    assert last["range"].startswith("bytes=") and last["if_range"]  # type: ignore[union-attr]
    assert (last["status"], last["sent"]) == (200, size)  # If-Range did not match: whole file


def test_416_on_a_complete_partial_finishes_without_downloading(origin: Origin, tmp_path: Path) -> None:
    """A crash after the last byte but before the rename: the resume asks for bytes past
    the end, the origin answers 416 with the total, and the file is verified and renamed."""
    digest = origin.add("crashed.gguf", 8 * MiB)
    url = origin.url("crashed.gguf")
    target = tmp_path / "n1" / "crashed.gguf"
    target.parent.mkdir(parents=True)
    Path(str(target) + ".part").write_bytes((origin.www / "crashed.gguf").read_bytes())
    meta = {"url": url, "validator": etag(origin, "/crashed.gguf"), "total": 8 * MiB}
    Path(side_files(str(target))["meta"]).write_text(json.dumps(meta))
    spec = cluster(tmp_path, model("m", url, digest))
    [result] = fetch(spec, tmp_path, {"m": ["n1"]})
    assert result.ok, result
    assert sha(target) == digest
    [get] = origin.gets("crashed.gguf")
    assert (get["status"], get["range"]) == (416, f"bytes={8 * MiB}-")
    assert int(str(get["sent"])) < 1024  # nginx's short error page, not the file


def test_checksum_mismatch_removes_the_partial(origin: Origin, tmp_path: Path) -> None:
    origin.add("bad.gguf", 4 * MiB)
    spec = cluster(tmp_path, model("m", origin.url("bad.gguf"), "0" * 64))
    [result] = fetch(spec, tmp_path, {"m": ["n1"]})
    assert not result.ok and result.kind == "checksum"
    assert "expected " + "0" * 64 in result.message and "removed" in result.message
    assert sorted(p.name for p in (tmp_path / "n1").iterdir() if not p.name.startswith(".")) == []


def test_hugging_face_resolve_redirect_is_verified_with_x_linked_etag(origin: Origin, tmp_path: Path) -> None:
    good = origin.add("linked.gguf", 4 * MiB)
    origin.add("lying.gguf", 4 * MiB)
    origin.link("linked.gguf", good)
    origin.link("lying.gguf", good)  # announces the other file's sha256
    spec = cluster(
        tmp_path,
        model("good", origin.url("org/repo/resolve/main/linked.gguf"))
        + model("lying", origin.url("org/repo/resolve/main/lying.gguf")),
    )
    results = {r.model: r for r in fetch(spec, tmp_path, {"good": ["n1"], "lying": ["n1"]})}
    assert results["good"].ok, results["good"]
    assert sha(tmp_path / "n1" / "linked.gguf") == good
    assert not results["lying"].ok and results["lying"].kind == "checksum"
    assert not (tmp_path / "n1" / "lying.gguf").exists()
    gets = origin.gets("linked.gguf")
    assert [(g["uri"], g["status"]) for g in gets] == [
        ("/org/repo/resolve/main/linked.gguf", 302),
        ("/cdn/linked.gguf", 200),
    ]


def test_404_names_the_model_and_url(origin: Origin, tmp_path: Path) -> None:
    url = origin.url("missing.gguf")
    spec = cluster(tmp_path, model("m", url), nodes=2)
    results = fetch(spec, tmp_path, {"m": ["n1", "n2"]})
    assert all(not r.ok and r.kind == "not-found" for r in results), results
    assert url in results[0].message and "404" in results[0].message
    assert len([e for e in origin.log() if e["uri"] == "/missing.gguf"]) == 1  # n2 did not hammer it


def test_gated_file_needs_the_token_which_goes_only_to_hugging_face(origin: Origin, tmp_path: Path) -> None:
    digest = origin.add("gated.gguf", 4 * MiB)
    plain = origin.add("plain.gguf", 1 * MiB)
    spec = cluster(
        tmp_path, model("m", origin.url("gated/gated.gguf")) + model("p", origin.url("plain.gguf"))
    )
    [denied] = fetch(spec, tmp_path, {"m": ["n1"]})
    assert not denied.ok and denied.kind == "auth"
    assert "401" in denied.message and "HF_TOKEN" in denied.message
    # a token is sent only to the Hugging Face endpoint (here HF_ENDPOINT = the origin)...
    [allowed] = fetch(spec, tmp_path, {"m": ["n1"]}, token=TOKEN, endpoint=origin.url(""))
    assert allowed.ok and sha(tmp_path / "n1" / "gated.gguf") == digest
    # ...and never to another origin
    [other] = fetch(spec, tmp_path, {"p": ["n1"]}, token=TOKEN, endpoint="https://huggingface.example")
    assert other.ok and sha(tmp_path / "n1" / "plain.gguf") == plain
    assert all(g["auth"] == "" for g in origin.gets("plain.gguf"))
    assert any(g["auth"] == f"Bearer {TOKEN}" for g in origin.gets("gated.gguf"))


def test_concurrent_fetches_of_one_file_make_one_download(origin: Origin, tmp_path: Path) -> None:
    digest = origin.add("twice.gguf", 24 * MiB)
    spec = cluster(tmp_path, model("m", origin.url("slow/twice.gguf"), digest))

    async def go() -> list[FetchResult]:
        fetchers = [Fetcher(spec, tmp_path, lambda _e: None) for _ in range(3)]
        plan = plan_fetch(spec, {"m": ["n1"]}, set(), set())
        try:
            runs = await asyncio.gather(*(f.run(plan) for f in fetchers))
        finally:
            await asyncio.gather(*(f.close() for f in fetchers))
        return [r for run in runs for r in run]

    results = asyncio.run(go())
    assert all(r.ok for r in results), results
    assert sha(tmp_path / "n1" / "twice.gguf") == digest
    assert len(origin.gets("twice.gguf")) == 1


# --- several nodes --------------------------------------------------------------------


def test_four_nodes_of_one_fabric_download_once_and_copy_from_peers(origin: Origin, tmp_path: Path) -> None:
    digest = origin.add("fabric.gguf", 64 * MiB)
    spec = cluster(tmp_path, model("m", origin.url("fabric.gguf")), nodes=4)
    started = time.monotonic()
    results = fetch(spec, tmp_path, {"m": ["n1", "n2", "n3", "n4"]})
    seconds = time.monotonic() - started
    assert all(r.ok for r in results), results
    for i in range(1, 5):
        assert sha(tmp_path / f"n{i}" / "fabric.gguf") == digest
    assert len(origin.gets("fabric.gguf")) == 1  # the origin served the file once
    sources = sorted(r.source for r in results)
    assert sources.count("origin") == 1 and len(set(sources) - {"origin"}) >= 1
    print(f"\n4 nodes x 64 MiB, 1 origin download, {seconds:.2f}s")


def test_two_fabrics_download_once_each_and_peers_off_every_node(origin: Origin, tmp_path: Path) -> None:
    origin.add("two.gguf", 8 * MiB)
    spec = cluster(tmp_path, model("m", origin.url("two.gguf")), nodes=4, fabrics=("ib0", "ib1"))
    results = fetch(spec, tmp_path, {"m": ["n1", "n2", "n3", "n4"]})
    assert all(r.ok for r in results), results
    assert len(origin.gets("two.gguf")) == 2
    origin.add("each.gguf", 8 * MiB)
    spec = cluster(tmp_path, model("e", origin.url("each.gguf")), nodes=3)
    results = fetch(spec, tmp_path, {"e": ["n1", "n2", "n3"]}, peers=Peers.off)
    assert all(r.ok and r.source == "origin" for r in results), results
    assert len(origin.gets("each.gguf")) == 3


def test_a_node_that_holds_the_file_seeds_the_others(origin: Origin, tmp_path: Path) -> None:
    """A file put on a node by hand seeds its peers once it matches the pinned sha256."""
    digest = origin.add("seed.gguf", 8 * MiB)
    spec = cluster(tmp_path, model("m", origin.url("seed.gguf"), digest), nodes=2)
    (tmp_path / "n2").mkdir()
    (tmp_path / "n2" / "seed.gguf").write_bytes((origin.www / "seed.gguf").read_bytes())
    [kept] = fetch(spec, tmp_path, {"m": ["n2"]})
    assert kept.ok and kept.state == "present", kept  # hashed on n2, and remembered
    [result] = fetch(spec, tmp_path, {"m": ["n1"]})
    assert result.ok and result.source == "n2", result
    assert sha(tmp_path / "n1" / "seed.gguf") == digest
    assert origin.gets("seed.gguf") == []


def test_a_fetched_unpinned_file_seeds_the_others_with_its_origin_record(
    origin: Origin, tmp_path: Path
) -> None:
    digest = origin.add("record.gguf", 8 * MiB)
    spec = cluster(tmp_path, model("m", origin.url("record.gguf")), nodes=2)
    [first] = fetch(spec, tmp_path, {"m": ["n2"]})
    assert first.ok and first.source == "origin" and first.origin, first
    assert first.origin["size"] == 8 * MiB and first.origin["sha256"] == digest
    assert first.origin["etag"] and first.origin["last_modified"]
    [result] = fetch(spec, tmp_path, {"m": ["n1"]})
    assert result.ok and result.source == "n2", result
    assert result.origin == first.origin  # carried to the copy, which can seed in turn
    assert len(origin.gets("record.gguf")) == 1


def test_an_unpinned_file_put_there_by_hand_is_downloaded_again(origin: Origin, tmp_path: Path) -> None:
    """Without a pin or a record of its download, nothing says which file it should be."""
    digest = origin.add("byhand.gguf", 2 * MiB)
    spec = cluster(tmp_path, model("m", origin.url("byhand.gguf")), nodes=2)
    for node in ("n1", "n2"):
        (tmp_path / node).mkdir()
    (tmp_path / "n2" / "byhand.gguf").write_bytes(b"\1" * (2 * MiB))
    [result] = fetch(spec, tmp_path, {"m": ["n1"]})
    assert result.ok and result.source == "origin", result  # n2 seeds nothing
    assert sha(tmp_path / "n1" / "byhand.gguf") == digest
    [again] = fetch(spec, tmp_path, {"m": ["n2"]})
    assert again.ok and again.source == "n1", again  # replaced, from the peer that has the record
    assert sha(tmp_path / "n2" / "byhand.gguf") == digest


# --- disk full ------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "n1"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_disk_full_is_reported_before_downloading(origin: Origin, tmp_path: Path, small_disk: Path) -> None:
    origin.add("huge.gguf", 48 * MiB)
    spec = cluster(tmp_path, model("m", origin.url("huge.gguf")))
    [result] = fetch(spec, tmp_path, {"m": ["n1"]})
    assert not result.ok and result.kind == "disk-full", result
    assert "free" in result.message


def test_disk_full_while_writing_keeps_the_partial_for_a_resume(
    origin: Origin, tmp_path: Path, small_disk: Path
) -> None:
    size = 32 * MiB
    digest = origin.add("fills.gguf", size)
    spec = cluster(tmp_path, model("m", origin.url("slow/fills.gguf"), digest))
    target = small_disk / "fills.gguf"

    async def go() -> list[FetchResult]:
        f = Fetcher(spec, tmp_path, lambda _e: None)
        task = asyncio.create_task(f.run(plan_fetch(spec, {"m": ["n1"]}, set(), set())))
        await asyncio.to_thread(wait_bytes, target, 4 * MiB)
        (small_disk / "filler").write_bytes(b"\0" * (20 * MiB))  # someone else fills the disk
        try:
            return await task
        finally:
            await f.close()

    [result] = asyncio.run(go())
    assert not result.ok and result.kind == "disk-full", result
    kept = Path(str(target) + ".part").stat().st_size
    assert kept > 0 and "kept" in result.message
    assert not target.exists()
    (small_disk / "filler").unlink()
    [again] = fetch(spec, tmp_path, {"m": ["n1"]})
    assert again.ok, again
    assert sha(target) == digest
    assert origin.gets("fills.gguf")[-1]["range"] == f"bytes={kept}-"


# --- the command ----------------------------------------------------------------------


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmgw_cli", *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_llmgw_fetch_command(origin: Origin, tmp_path: Path) -> None:
    digest = origin.add("cli.gguf", 8 * MiB)
    spec_text = cluster_text(
        tmp_path,
        model("good", origin.url("cli.gguf"), digest) + model("gone", origin.url("gone.gguf")),
        nodes=2,
    )
    cluster_file = tmp_path / "cluster.yaml"
    cluster_file.write_text(spec_text)
    ok = run_cli("fetch", "--yes", "-f", str(cluster_file), "good")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "done" in ok.stdout and "n1" in ok.stdout and "n2" in ok.stdout
    for i in (1, 2):
        assert sha(tmp_path / f"n{i}" / "cli.gguf") == digest
    again = run_cli("fetch", "--yes", "-f", str(cluster_file), "good")
    assert again.returncode == 0 and "present" in again.stdout, again.stdout
    missing = run_cli("fetch", "--yes", "-f", str(cluster_file), "gone", "--nodes", "n1")
    assert missing.returncode == 1
    assert origin.url("gone.gguf") in missing.stdout and "404" in missing.stdout
    assert "error:" in missing.stderr
    unknown = run_cli("fetch", "--yes", "-f", str(cluster_file), "nope")
    assert unknown.returncode == 2 and f"no model nope in {cluster_file}" in unknown.stderr


# --- before a replica starts ----------------------------------------------------------


def test_apply_fetches_missing_weights_of_started_replicas(origin: Origin, tmp_path: Path) -> None:
    """What the executor calls before it writes and starts units: the started replica's
    nodes get the file (once from the origin), and a node whose weights failed is named."""
    digest = origin.add("apply.gguf", 8 * MiB)
    spec = cluster(
        tmp_path,
        model("m", origin.url("apply.gguf"), digest) + model("x", origin.url("absent.gguf")),
        nodes=3,
    )
    unit = UnitFile(node="n1", name="llmgw-m-0.service", text="")
    plan = Plan(
        actions=(
            Action(op="+", model="m", replica=0, nodes=("n1", "n2"), reason="new", write=(unit,)),
            Action(op="+", model="x", replica=0, nodes=("n3",), reason="new", write=(unit,)),
            Action(op="=", model="m", replica=1, nodes=("n3",), reason="running"),
        ),
        unplaced=(),
        warnings=(),
        facts_digest="",
    )
    lines: list[tuple[str, str]] = []

    async def ensure() -> dict[str, str]:
        async with Connections(spec, tmp_path) as conns:
            return await ensure_for_plan(spec, plan, conns, lambda s, m, _phase=None: lines.append((s, m)))

    failed = asyncio.run(ensure())
    assert set(failed) == {"n3"} and "404" in failed["n3"]
    assert sha(tmp_path / "n1" / "apply.gguf") == digest and sha(tmp_path / "n2" / "apply.gguf") == digest
    assert not (tmp_path / "n3" / "apply.gguf").exists()  # n3 runs nothing new of m
    assert len(origin.gets("apply.gguf")) == 1
    assert ("m@n1", "weights done from origin, 8.4 MB") in lines


def test_apply_checks_path_sources_on_each_node_of_a_started_replica(tmp_path: Path) -> None:
    """A path source is brought by nobody: before its units start, each node of the
    replica is asked whether it is there (a non-empty file or folder); a node where it is
    not fails, naming the path, and the others go on. No origin is involved."""
    folder = tmp_path / "models" / "Qwen2.5-7B-Instruct"
    spec = cluster(
        tmp_path,
        f"  - {{name: qwen, source: {folder}, profile: p}}\n  - {{name: smol, source: ./smol.gguf, profile: p}}\n",
        nodes=3,
    )
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    for i in (1, 2, 3):
        (tmp_path / f"n{i}").mkdir()
    (tmp_path / "n1" / "smol.gguf").write_bytes(b"GGUF")
    (tmp_path / "n2" / "smol.gguf").write_bytes(b"")
    unit = UnitFile(node="n1", name="llmgw-qwen-0.service", text="")
    plan = Plan(
        actions=(
            Action(op="+", model="qwen", replica=0, nodes=("n1", "n2"), reason="new", write=(unit,)),
            Action(op="+", model="smol", replica=0, nodes=("n1", "n2", "n3"), reason="new", write=(unit,)),
        ),
        unplaced=(),
        warnings=(),
        facts_digest="",
    )

    async def ensure() -> dict[str, str]:
        async with Connections(spec, tmp_path) as conns:
            return await ensure_for_plan(spec, plan, conns, lambda *_a: None)

    assert asyncio.run(ensure()) == {
        "n2": f"weights of smol: {tmp_path}/n2/smol.gguf is not on n2 (an empty file)",
        "n3": f"weights of smol: {tmp_path}/n3/smol.gguf is not on n3 (missing)",
    }
    # the folder goes away: every node of its replica says so
    (folder / "config.json").unlink()
    folder.rmdir()
    failed = asyncio.run(ensure())
    assert failed["n1"] == f"weights of qwen: {folder} is not on n1 (missing)"
