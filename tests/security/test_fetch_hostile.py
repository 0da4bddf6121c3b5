"""Attacks on the weight fetcher, which runs as root on every node.

Someone who can write a weights folder (the engines' account, another client of a shared
filer) plants links and files beside a model's target; a hostile or misconfigured origin
redirects a download that carries the Hugging Face token. Each test is the attack, run
against the real fetcher: the node program as root (``connection: local`` nodes whose
weights folders are temporary folders) and a real nginx origin on loopback over TLS, whose
access log records every Authorization header each of its listeners received.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw_cli.node.fetch_disk import side_files
from llmgw_cli.node.fetch_http import may_carry_token
from tests.integration.test_fetch import cluster, cluster_text, fetch, model, sha
from tests.integration.weights_origin import TOKEN, Origin, trusted_origin

MiB = 1 << 20
ENGINE_UID = 4242  # the account that planted the links (the engines' account on a node)
CANARY = b"root:$6$canary$do-not-overwrite:19000:0:99999:7:::\n"


@pytest.fixture(scope="module")
def origin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Origin]:
    yield from trusted_origin(
        tmp_path_factory.mktemp("origin"),
        "the fetcher runs as root on a node; these attacks need root to be real",
    )


@pytest.fixture
def canary(tmp_path: Path) -> Path:
    """A root-only file standing for /etc/shadow."""
    folder = tmp_path / "root-only"
    folder.mkdir(mode=0o700)
    path = folder / "shadow"
    path.write_bytes(CANARY)
    path.chmod(0o600)
    return path


def shared_folder(tmp_path: Path, node: str = "n1") -> Path:
    """A weights folder others may write, as /tmp is: root-owned, world-writable, sticky."""
    folder = tmp_path / node
    folder.mkdir(exist_ok=True)
    folder.chmod(0o1777)
    return folder


def plant_link(link: Path, points_to: Path) -> None:
    link.symlink_to(points_to)
    os.lchown(link, ENGINE_UID, ENGINE_UID)


def after(path: Path) -> bytes:
    return path.read_bytes()


# --- links and files planted in a weights folder --------------------------------------


@pytest.mark.integration
def test_status_file_linked_to_a_root_file_is_never_written(
    origin: Origin, tmp_path: Path, canary: Path
) -> None:
    digest = origin.add("status.gguf", 2 * MiB)
    folder = shared_folder(tmp_path)
    plant_link(Path(side_files(str(folder / "status.gguf"))["status"]), canary)
    spec = cluster(tmp_path, model("m", origin.url("status.gguf"), digest))
    [result] = fetch(spec, tmp_path, {"m": ["n1"]})
    assert after(canary) == CANARY
    assert not result.ok and result.kind == "unsafe", result
    assert ".status.gguf.fetch-status is a symbolic link" in result.message
    assert not (folder / "status.gguf").exists() and not (folder / "status.gguf.part").exists()


@pytest.mark.integration
def test_partial_file_linked_to_a_root_file_is_never_truncated(
    origin: Origin, tmp_path: Path, canary: Path
) -> None:
    """With a planted meta file naming the URL, the fetcher would resume (or restart) the
    partial file in place: through the link, that is the root file."""
    digest = origin.add("part.gguf", 2 * MiB)
    url = origin.url("part.gguf")
    folder = shared_folder(tmp_path)
    target = folder / "part.gguf"
    plant_link(Path(str(target) + ".part"), canary)
    meta = Path(side_files(str(target))["meta"])
    meta.write_text(json.dumps({"url": url}))
    os.chown(meta, ENGINE_UID, ENGINE_UID)
    spec = cluster(tmp_path, model("m", url, digest))
    [result] = fetch(spec, tmp_path, {"m": ["n1"]})
    assert after(canary) == CANARY
    assert not result.ok and result.kind == "unsafe", result
    assert "part.gguf.part is a symbolic link" in result.message
    assert origin.gets("part.gguf") == []  # refused before a byte was asked for


@pytest.mark.integration
def test_target_linked_to_a_root_file_is_not_accepted_nor_served_to_peers(
    origin: Origin, tmp_path: Path, canary: Path
) -> None:
    """n2's "weights" are a link to the root file: they must not count as present on n2,
    and n2 must not serve the root file to n1 as the model (no sha256 pinned here)."""
    digest = origin.add("target.gguf", 2 * MiB)
    shared_folder(tmp_path, "n1")
    plant_link(shared_folder(tmp_path, "n2") / "target.gguf", canary)
    spec = cluster(tmp_path, model("m", origin.url("target.gguf")), nodes=2)
    results = {r.node: r for r in fetch(spec, tmp_path, {"m": ["n1", "n2"]})}
    assert after(canary) == CANARY
    assert results["n1"].ok, results["n1"]
    assert sha(tmp_path / "n1" / "target.gguf") == digest  # the model, not the root file
    assert not results["n2"].ok and results["n2"].kind == "unsafe", results["n2"]
    assert "target.gguf is a symbolic link" in results["n2"].message
    assert (tmp_path / "n2" / "target.gguf").is_symlink()  # left for the operator to look at


@pytest.mark.integration
def test_dangling_lock_link_creates_no_file_where_it_points(origin: Origin, tmp_path: Path) -> None:
    digest = origin.add("lock.gguf", 1 * MiB)
    folder = shared_folder(tmp_path)
    (tmp_path / "root-only").mkdir(mode=0o700)
    planted = tmp_path / "root-only" / "cron-job"
    plant_link(Path(side_files(str(folder / "lock.gguf"))["lock"]), planted)
    spec = cluster(tmp_path, model("m", origin.url("lock.gguf"), digest))
    [result] = fetch(spec, tmp_path, {"m": ["n1"]})
    assert not planted.exists()
    assert not result.ok and result.kind == "unsafe", result


@pytest.mark.integration
def test_weights_folder_replaced_by_a_link_owned_by_the_engine_account_is_not_followed(
    origin: Origin, tmp_path: Path
) -> None:
    """The engine account swaps the weights folder for a link to a root-only folder: the
    download must not land there (a root-owned file in a folder of root's choosing)."""
    digest = origin.add("folder.gguf", 1 * MiB)
    root_only = tmp_path / "etc-cron.d"
    root_only.mkdir(mode=0o755)
    plant_link(tmp_path / "n1", root_only)
    spec = cluster(tmp_path, model("m", origin.url("folder.gguf"), digest))
    [result] = fetch(spec, tmp_path, {"m": ["n1"]})
    assert list(root_only.iterdir()) == []
    assert not result.ok and result.kind == "unsafe", result
    assert f"{tmp_path}/n1 is a symbolic link owned by uid {ENGINE_UID}" in result.message


@pytest.mark.integration
def test_weights_folder_owned_by_the_engine_account_is_refused(origin: Origin, tmp_path: Path) -> None:
    digest = origin.add("owned.gguf", 1 * MiB)
    folder = tmp_path / "n1"
    folder.mkdir()
    os.chown(folder, ENGINE_UID, ENGINE_UID)
    spec = cluster(tmp_path, model("m", origin.url("owned.gguf"), digest))
    [result] = fetch(spec, tmp_path, {"m": ["n1"]})
    assert not result.ok and result.kind == "unsafe", result
    assert f"belongs to uid {ENGINE_UID}" in result.message and "chown" in result.message
    assert list(folder.iterdir()) == []


# --- an existing target and the pinned sha256 -----------------------------------------


@pytest.mark.integration
def test_existing_target_with_wrong_content_is_not_accepted_under_a_pinned_sha256(
    origin: Origin, tmp_path: Path
) -> None:
    digest = origin.add("pinned.gguf", 2 * MiB)
    folder = tmp_path / "n1"
    folder.mkdir()
    (folder / "pinned.gguf").write_bytes(b"poisoned weights " * 1000)
    spec = cluster(tmp_path, model("m", origin.url("pinned.gguf"), digest))
    [result] = fetch(spec, tmp_path, {"m": ["n1"]})
    assert result.ok and result.state == "done", result  # downloaded again, not "present"
    assert sha(folder / "pinned.gguf") == digest
    assert len(origin.gets("pinned.gguf")) == 1


@pytest.mark.integration
def test_llmgw_fetch_does_not_accept_a_wrong_existing_target(origin: Origin, tmp_path: Path) -> None:
    """The command plans from the probe's facts, where the file looks complete."""
    digest = origin.add("cli-pinned.gguf", 2 * MiB)
    (tmp_path / "n1").mkdir()
    (tmp_path / "n1" / "cli-pinned.gguf").write_bytes(b"\0" * (2 * MiB))
    cluster_file = tmp_path / "cluster.yaml"
    cluster_file.write_text(cluster_text(tmp_path, model("m", origin.url("cli-pinned.gguf"), digest)))
    done = subprocess.run(
        [sys.executable, "-m", "llmgw_cli", "fetch", "--yes", "-f", str(cluster_file), "m"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert sha(tmp_path / "n1" / "cli-pinned.gguf") == digest


@pytest.mark.integration
def test_target_changed_in_place_with_its_mtime_restored_is_hashed_again(
    origin: Origin, tmp_path: Path
) -> None:
    """A verified file is remembered by inode, size, mtime and ctime: an account that
    rewrites it and sets the mtime back cannot set the ctime back."""
    digest = origin.add("tamper.gguf", 2 * MiB)
    spec = cluster(tmp_path, model("m", origin.url("tamper.gguf"), digest))
    [first] = fetch(spec, tmp_path, {"m": ["n1"]})
    assert first.ok, first
    target = tmp_path / "n1" / "tamper.gguf"
    assert fetch(spec, tmp_path, {"m": ["n1"]}) == []  # verified: present, nothing to do
    st = target.stat()
    time.sleep(0.05)  # past the tick of the verification: the ctime would change anyway
    with open(target, "r+b") as f:
        f.write(b"EVIL")
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert target.stat().st_mtime_ns == st.st_mtime_ns and target.stat().st_size == st.st_size
    [again] = fetch(spec, tmp_path, {"m": ["n1"]})
    assert again.ok and again.state == "done", again
    assert sha(target) == digest
    assert len(origin.gets("tamper.gguf")) == 2


# --- the token and redirects ----------------------------------------------------------


def _auth_seen(o: Origin, *, port: int) -> list[str]:
    return [str(e["auth"]) for e in o.log() if str(e.get("port")) == str(port)]


@pytest.mark.integration
def test_redirect_from_https_to_plain_http_never_receives_the_token(origin: Origin, tmp_path: Path) -> None:
    origin.add("downgrade.gguf", 1 * MiB)
    origin.clear_log()
    spec = cluster(tmp_path, model("m", origin.url("to-http/downgrade.gguf")))
    [result] = fetch(spec, tmp_path, {"m": ["n1"]}, token=TOKEN, endpoint=origin.url(""))
    assert TOKEN not in " ".join(_auth_seen(origin, port=origin.http_port))
    assert not result.ok and result.kind == "http", result
    assert "never continues without TLS" in result.message
    assert not (tmp_path / "n1" / "downgrade.gguf").exists()


@pytest.mark.integration
@pytest.mark.parametrize("route", ["to-other", "to-localhost"])
def test_redirect_to_another_origin_never_receives_the_token(
    origin: Origin, tmp_path: Path, route: str
) -> None:
    """``to-other``: the same host, another port (another service); ``to-localhost``:
    another host name. Both are what a CDN redirect looks like: the file comes, the
    token stays."""
    digest = origin.add(f"{route}.gguf", 1 * MiB)
    origin.clear_log()
    spec = cluster(tmp_path, model("m", origin.url(f"{route}/{route}.gguf"), digest))
    [result] = fetch(spec, tmp_path, {"m": ["n1"]}, token=TOKEN, endpoint=origin.url(""))
    assert result.ok, result
    assert sha(tmp_path / "n1" / f"{route}.gguf") == digest
    assert _auth_seen(origin, port=origin.port)[-1] == f"Bearer {TOKEN}"  # the origin had it
    seen = _auth_seen(origin, port=origin.other_port)
    assert seen and all(a == "" for a in seen), seen


@pytest.mark.parametrize(
    ("first", "then", "carries"),
    [
        ("https://huggingface.co/a", "https://huggingface.co/b", True),
        ("https://huggingface.co/a", "https://HuggingFace.co:443/b", True),
        ("https://huggingface.co/a", "http://huggingface.co/b", False),
        ("https://huggingface.co/a", "http://huggingface.co:443/b", False),
        ("https://huggingface.co/a", "https://cdn-lfs.huggingface.co/b", False),
        ("https://huggingface.co/a", "https://huggingface.co:8443/b", False),
        ("https://huggingface.co/a", "https://huggingface.co.evil.example/b", False),
        ("https://huggingface.co/a", "https://evil.example@huggingface.co/b", True),
        ("https://huggingface.co/a", "https://huggingface.co@evil.example/b", False),
        ("http://huggingface.co/a", "http://huggingface.co/a", False),
    ],
)
def test_token_rule_for_each_redirect(first: str, then: str, carries: bool) -> None:
    assert may_carry_token(first, then) is carries
