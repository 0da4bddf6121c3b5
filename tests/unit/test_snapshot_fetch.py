"""The node program's whole-repository verbs (``snapshot``, ``verify-snapshot``,
``poll-snapshot``) against the Hub stand-in: the program runs as it does on a node (piped
to ``python3 -``, standard library only) into a temporary weights folder, with the job the
control host builds from ``resolve()``'s Snapshot. The stand-in's request log is the
witness of what was downloaded, with which Range, and where the token went."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from llmgw_cli.core.weights import snapshot as core
from llmgw_cli.core.weights.snapshot import (
    Digest,
    RepoRef,
    Selection,
    Snapshot,
    SnapshotFile,
    manifest_text,
    parse_manifest,
    parse_snapshot_check,
    parse_snapshot_status,
    poll_snapshot_job,
    snapshot_job,
    verify_snapshot_job,
)
from llmgw_cli.node import fetch_disk, fetch_http, fetch_snapshot, repo_path
from llmgw_cli.remote.fetch import node_script
from llmgw_cli.remote.hub import resolve
from tests.hub_standin import HubStandin
from tests.waiting import wait_until

MiB = 1 << 20
REPO = "acme/tiny"
TOKEN = "hf_secret_token"
BIG = os.urandom(3 * MiB)
DEEP = os.urandom(MiB + 17)
CONFIG = b'{"model_type": "llama"}\n'
TOKENIZER = json.dumps({"vocab": {f"t{i}": i for i in range(300)}}).encode()
FILES = {
    "config.json": CONFIG,  # plain git files: checked by their git blob id
    "tokenizer/tokenizer.json": TOKENIZER,
    "model-00001-of-00002.safetensors": BIG,  # LFS: by sha256, served by the CDN
    "weights/deep/model-00002-of-00002.safetensors": DEEP,
}
BIG_SHA = hashlib.sha256(BIG).hexdigest()


@pytest.fixture
def hub(hub_standin: HubStandin, hf_home: str) -> HubStandin:
    hub_standin.repo(REPO).push(FILES)
    return hub_standin


@pytest.fixture
def snap(hub: HubStandin) -> Snapshot:
    return resolve(RepoRef(REPO), None, hub.url, Selection(include=("*",)))


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    folder = tmp_path / "w"
    folder.mkdir()
    return folder


def node(job: dict[str, Any]) -> list[dict[str, Any]]:
    """Run the node program on ``job`` as the control host does; its JSON lines."""
    done = subprocess.run(
        [sys.executable, "-"],
        input=node_script(job),
        text=True,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def fetch(job: dict[str, Any]) -> dict[str, Any]:
    """A snapshot job run in the foreground; its status file once it ended."""
    answers = node({**job, "foreground": True})
    assert answers == [], answers  # the foreground job says how it went in its status only
    return status(job)


def status(job: dict[str, Any]) -> dict[str, Any]:
    path = Path(job["folder"]) / f".{job['commit']}.snapshot-status"
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def snapshot_dir(weights: Path, snap: Snapshot) -> Path:
    return Path(core.snapshot_folder(str(weights), snap.repo, snap.commit))


def manifest(weights: Path, snap: Snapshot) -> Path:
    return Path(core.manifest_path(str(weights), snap.repo, snap.commit))


def blob_gets(hub: HubStandin, sha: str) -> list[dict[str, str]]:
    return [r.headers for r in hub.requests if r.server == "cdn" and r.method == "GET" and sha in r.path]


def files_under(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def verify(snap: Snapshot, weights: Path, **options: Any) -> dict[str, Any]:
    [answer] = node({**verify_snapshot_job(snap, str(weights)), **options})
    return answer


# --- a whole repository ----------------------------------------------------------------------


def test_a_repo_with_subfolders_and_lfs_and_git_files_is_fetched_and_its_manifest_written_last(
    hub: HubStandin, snap: Snapshot, weights: Path
) -> None:
    assert {f.algorithm for f in snap.files} == {Digest.sha256, Digest.git_sha1}
    job = snapshot_job(snap, str(weights), hub.url)
    st = fetch(job)
    assert st["state"] == "done", st
    assert (st["files_done"], st["files_total"]) == (4, 4)
    assert st["bytes_done"] == st["bytes_total"] == snap.total_bytes
    folder = snapshot_dir(weights, snap)
    assert files_under(folder) == FILES  # and nothing else: bookkeeping lives beside it
    sha256s = {p: hashlib.sha256(d).hexdigest() for p, d in FILES.items()}
    text = manifest(weights, snap).read_text()
    assert text == manifest_text(snap, sha256s)
    assert parse_manifest(text).commit == snap.commit
    latest_file = max(p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file())
    assert manifest(weights, snap).stat().st_mtime_ns >= latest_file
    assert verify(snap, weights, full=True)["state"] == "complete"


def test_a_fetched_snapshot_is_present_and_not_downloaded_again(
    hub: HubStandin, snap: Snapshot, weights: Path
) -> None:
    job = snapshot_job(snap, str(weights), hub.url)
    assert fetch(job)["state"] == "done"
    before = len(hub.requests)
    assert node(job) == [{"state": "present", "files": 4, "bytes": snap.total_bytes}]
    assert len(hub.requests) == before


def test_a_detached_job_is_polled_until_done(hub: HubStandin, snap: Snapshot, weights: Path) -> None:
    job = snapshot_job(snap, str(weights), hub.url)
    assert node(job) == [{"state": "started"}]
    poll = poll_snapshot_job(str(weights), snap.repo, snap.commit)

    def answer() -> dict[str, Any]:
        [a] = node(poll)
        return a

    final = wait_until(
        answer,
        until=lambda a: a["free"] and a["status"].get("state") == "done",
        timeout=60,
        what="the detached snapshot job to finish",
    )
    progress = parse_snapshot_status(final["status"])
    assert (progress.state, progress.files_done, progress.bytes_done) == ("done", 4, snap.total_bytes)
    assert progress.finished and manifest(weights, snap).exists()


def test_a_download_cut_in_the_middle_resumes_with_range(
    hub: HubStandin, snap: Snapshot, weights: Path
) -> None:
    hub.cut_after[BIG_SHA] = MiB
    st = fetch(snapshot_job(snap, str(weights), hub.url))
    assert st["state"] == "done", st
    first, second = blob_gets(hub, BIG_SHA)
    assert "range" not in first
    assert second["range"] == f"bytes={MiB}-" and second["if-range"] == f'"{BIG_SHA}"'
    assert (snapshot_dir(weights, snap) / "model-00001-of-00002.safetensors").read_bytes() == BIG
    assert manifest(weights, snap).exists()


def test_a_partial_file_left_by_an_earlier_job_is_resumed(
    hub: HubStandin, snap: Snapshot, weights: Path
) -> None:
    """A job that died (cut, then no retry left) keeps its partial file; the next one asks
    only for the rest."""
    job = snapshot_job(snap, str(weights), hub.url)
    hub.cut_after[BIG_SHA] = MiB
    job_one = {**job, "files": [f for f in job["files"] if f["path"].endswith("00001-of-00002.safetensors")]}
    real_retries = fetch_disk.RETRIES
    script = node_script({**job_one, "foreground": True}).replace(
        f"RETRIES = {real_retries}\n", "RETRIES = 0\n", 1
    )
    subprocess.run(
        [sys.executable, "-"], input=script, text=True, capture_output=True, timeout=60, check=True
    )
    assert status(job)["state"] == "error" and status(job)["kind"] == "network"
    assert not manifest(weights, snap).exists()
    assert fetch(job)["state"] == "done"
    assert blob_gets(hub, BIG_SHA)[-1]["range"] == f"bytes={MiB}-"
    assert files_under(snapshot_dir(weights, snap)) == FILES


def test_a_file_already_present_and_correct_is_kept(hub: HubStandin, snap: Snapshot, weights: Path) -> None:
    folder = snapshot_dir(weights, snap)
    (folder / "weights" / "deep").mkdir(parents=True)
    (folder / "model-00001-of-00002.safetensors").write_bytes(BIG)
    (folder / "config.json").write_bytes(CONFIG)
    (folder / "weights/deep/model-00002-of-00002.safetensors").write_bytes(b"x" * len(DEEP))  # wrong
    st = fetch(snapshot_job(snap, str(weights), hub.url))
    assert st["state"] == "done", st
    assert blob_gets(hub, BIG_SHA) == []
    hub_paths = [r.path for r in hub.requests if r.server == "hub"]
    assert not any(p.endswith("/config.json") for p in hub_paths)
    assert len(blob_gets(hub, hashlib.sha256(DEEP).hexdigest())) == 1  # the wrong one replaced
    assert files_under(folder) == FILES
    assert manifest(weights, snap).exists()


def test_a_correct_file_another_account_owns_is_replaced_by_a_download(
    hub: HubStandin, snap: Snapshot, weights: Path
) -> None:
    """Its owner could change it once checked: the snapshot holds the fetcher's own copy."""
    if os.geteuid() != 0:
        pytest.skip("planting a file as another account needs root")
    folder = snapshot_dir(weights, snap)
    folder.mkdir(parents=True)
    planted = folder / "model-00001-of-00002.safetensors"
    planted.write_bytes(BIG)
    os.chown(planted, 4242, 4242)
    assert fetch(snapshot_job(snap, str(weights), hub.url))["state"] == "done"
    assert len(blob_gets(hub, BIG_SHA)) == 1
    assert planted.stat().st_uid == 0 and planted.read_bytes() == BIG


# --- refused: what no snapshot may be completed with ------------------------------------------


def test_a_corrupted_lfs_file_on_the_cdn_is_refused_and_no_manifest_written(
    hub: HubStandin, snap: Snapshot, weights: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    served = hub.blobs

    def corrupted() -> dict[str, bytes]:
        # its first byte flipped: a byte set to a constant leaves a random file as it was
        # once in 256 runs
        return {
            sha: (bytes([data[0] ^ 0xFF]) + data[1:] if sha == BIG_SHA else data)
            for sha, data in served().items()
        }

    monkeypatch.setattr(hub, "blobs", corrupted)
    st = fetch(snapshot_job(snap, str(weights), hub.url))
    assert st["state"] == "error" and st["kind"] == "checksum", st
    assert "model-00001-of-00002.safetensors" in st["message"]
    assert not manifest(weights, snap).exists()
    assert not (snapshot_dir(weights, snap) / "model-00001-of-00002.safetensors").exists()
    answer = verify(snap, weights)
    assert answer["state"] == "incomplete" and "model-00001-of-00002.safetensors" in answer["missing"]


def test_a_changed_git_file_fails_its_blob_id_and_no_manifest_is_written(
    hub: HubStandin, snap: Snapshot, weights: Path
) -> None:
    hub.repos[REPO].commits[snap.commit]["config.json"] = CONFIG.replace(b"llama", b"LLAMA")
    st = fetch(snapshot_job(snap, str(weights), hub.url))
    assert st["state"] == "error" and st["kind"] == "checksum", st
    assert "git blob id" in st["message"] and "config.json" in st["message"]
    assert not manifest(weights, snap).exists()
    assert not (snapshot_dir(weights, snap) / "config.json").exists()


@pytest.fixture
def endless() -> Iterator[str]:
    """An origin that answers without a Content-Length and sends 64 KiB more than the
    job's size (200000 bytes) before it closes the connection."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_HEAD(self) -> None:
            self.send_response(200)
            self.end_headers()

        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            for _ in range(5):
                self.wfile.write(b"y" * 53_107)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/file.bin"
    server.shutdown()
    server.server_close()


def test_an_origin_sending_more_than_the_size_is_cut_off_and_refused(endless: str, weights: Path) -> None:
    f = SnapshotFile("file.bin", 200_000, "0" * 40, Digest.git_sha1)
    snap = Snapshot(REPO, "a" * 40, (f,))
    job = snapshot_job(snap, str(weights))
    job["files"][0]["url"] = endless
    st = fetch(job)
    assert st["state"] == "error" and st["kind"] == "size", st
    assert "more than the 200000 bytes" in st["message"]
    work = Path(job["folder"]) / f".{snap.commit}.snapshot-work"
    assert [p.name for p in work.iterdir() if p.name.endswith(".part")] == []
    assert not (snapshot_dir(weights, snap) / "file.bin").exists()
    assert not manifest(weights, snap).exists()


def test_a_size_other_than_the_jobs_is_refused_before_writing(
    hub: HubStandin, snap: Snapshot, weights: Path
) -> None:
    job = snapshot_job(snap, str(weights), hub.url)
    for f in job["files"]:
        if f["path"] == "config.json":
            f["size"] -= 1
    st = fetch(job)
    assert st["state"] == "error" and st["kind"] == "size", st
    assert not manifest(weights, snap).exists()


@pytest.mark.parametrize("planted", ["commit", "subfolder"])
def test_a_link_planted_in_place_of_a_folder_is_refused(
    hub: HubStandin, snap: Snapshot, weights: Path, tmp_path: Path, planted: str
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    folder = snapshot_dir(weights, snap)
    link = folder if planted == "commit" else folder / "weights"
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(elsewhere)
    if os.geteuid() == 0:
        os.lchown(link, 4242, 4242)
    st = fetch(snapshot_job(snap, str(weights), hub.url))
    assert st["state"] == "error" and st["kind"] == "unsafe", st
    assert f"{link.name} is a symbolic link" in st["message"]
    assert list(elsewhere.iterdir()) == []
    assert not manifest(weights, snap).exists()
    assert verify(snap, weights)["state"] == "incomplete"


@pytest.mark.parametrize(
    "path",
    [
        "../escape.json",
        "a/../../escape.json",
        "/etc/escape.json",
        "a//b.json",
        "a/./b.json",
        "./a.json",
        "a/",
        "",
        "a\x00b.json",
        "a\nb.json",
        "a\\b.json",
        "a\u2028b.json",
        "\udc80.json",
        "x" * 256,
    ],
)
def test_a_hostile_path_in_the_job_is_refused_before_anything_is_written(
    snap: Snapshot, weights: Path, path: str
) -> None:
    job = snapshot_job(snap, str(weights), "http://127.0.0.1:9")
    job["files"][0]["path"] = path
    [answer] = node({**job, "foreground": True})
    assert answer["state"] == "error" and answer["kind"] == "unsafe", answer
    assert list(weights.iterdir()) == []
    with pytest.raises(core.BadPath):
        core.check_repo_path(path)  # the control host's check refuses it too


def test_a_file_listed_also_as_a_folder_is_refused(snap: Snapshot, weights: Path) -> None:
    job = snapshot_job(snap, str(weights), "http://127.0.0.1:9")
    job["files"][0]["path"] = "weights"  # weights/deep/... is listed too
    [answer] = node({**job, "foreground": True})
    assert answer["state"] == "error" and answer["kind"] == "unsafe", answer
    assert "both as a file and as a folder" in answer["message"]


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("folder", "/tmp/hf/other--repo"),
        ("folder", "relative/hf/acme--tiny"),
        ("commit", "main"),
        ("repo", "a/../b"),
    ],
)
def test_a_job_whose_folder_repo_or_commit_is_not_one_is_refused(
    snap: Snapshot, weights: Path, key: str, value: str
) -> None:
    job = snapshot_job(snap, str(weights), "http://127.0.0.1:9")
    job[key] = value
    [answer] = node(job)
    assert answer["state"] == "error", answer
    assert list(weights.iterdir()) == []


def test_a_second_job_of_the_same_snapshot_attaches_to_the_first(
    hub: HubStandin, snap: Snapshot, weights: Path
) -> None:
    job = snapshot_job(snap, str(weights), hub.url)
    folder = Path(job["folder"])
    folder.mkdir(parents=True)
    fd = os.open(folder / f".{snap.commit}.snapshot-lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # what a running job holds
        assert node(job) == [{"state": "attached"}]
        [polled] = node(poll_snapshot_job(str(weights), snap.repo, snap.commit))
        assert polled["free"] is False
    finally:
        os.close(fd)
    assert [r.path for r in hub.requests if r.server == "cdn" or "/resolve/" in r.path] == []


# --- the token --------------------------------------------------------------------------------


def test_the_token_goes_to_the_hub_and_never_to_the_cdn(
    hub_standin: HubStandin, hf_home: str, weights: Path
) -> None:
    hub_standin.repo(REPO, gated=True, token=TOKEN).push(FILES)
    snap = resolve(RepoRef(REPO), TOKEN, hub_standin.url, Selection(include=("*",)))
    del hub_standin.requests[:]
    st = fetch(snapshot_job(snap, str(weights), hub_standin.url, TOKEN))
    assert st["state"] == "done", st  # a gated repo: the Hub had the token
    assert hub_standin.seen("cdn", "authorization") == []
    hub_auth = hub_standin.seen("hub", "authorization")
    assert hub_auth and set(hub_auth) == {f"Bearer {TOKEN}"}
    assert len([r for r in hub_standin.requests if r.server == "cdn" and r.method == "GET"]) == 2


def test_a_token_without_its_origin_is_sent_nowhere(
    hub_standin: HubStandin, hf_home: str, weights: Path
) -> None:
    hub_standin.repo(REPO, gated=True, token=TOKEN).push(FILES)
    snap = resolve(RepoRef(REPO), TOKEN, hub_standin.url, Selection(include=("*",)))
    job = snapshot_job(snap, str(weights), hub_standin.url, TOKEN)
    del job["token_origin"]
    del hub_standin.requests[:]
    st = fetch(job)
    assert st["state"] == "error" and st["kind"] == "auth", st
    assert hub_standin.seen("hub", "authorization") == [] == hub_standin.seen("cdn", "authorization")


@pytest.mark.parametrize(
    ("origin", "url", "carries"),
    [
        ("https://huggingface.co", "https://huggingface.co/a/b/resolve/c/x", True),
        ("https://huggingface.co", "https://cdn-lfs.huggingface.co/x", False),
        ("https://huggingface.co", "https://huggingface.co:8443/x", False),
        ("https://huggingface.co", "http://huggingface.co/x", False),
        ("http://127.0.0.1:8080", "http://127.0.0.1:8080/x", True),
        ("http://127.0.0.1:8080", "http://127.0.0.1:8081/x", False),
        ("http://10.0.0.1:8080", "http://10.0.0.1:8080/x", False),
        ("http://huggingface.co", "http://huggingface.co/x", False),
    ],
)
def test_a_snapshot_token_goes_to_its_origin_only_and_in_clear_only_on_loopback(
    origin: str, url: str, carries: bool
) -> None:
    assert fetch_http.may_carry_token_to(origin, url) is carries


# --- verify-snapshot --------------------------------------------------------------------------


def test_verify_names_a_missing_file_and_a_missing_manifest(
    hub: HubStandin, snap: Snapshot, weights: Path
) -> None:
    assert verify(snap, weights)["state"] == "absent"
    assert fetch(snapshot_job(snap, str(weights), hub.url))["state"] == "done"
    assert parse_snapshot_check(verify(snap, weights)).complete
    deep = snapshot_dir(weights, snap) / "weights/deep/model-00002-of-00002.safetensors"
    deep.rename(deep.with_name("aside"))
    check = parse_snapshot_check(verify(snap, weights))
    assert (check.state, check.missing) == ("incomplete", ("weights/deep/model-00002-of-00002.safetensors",))
    deep.with_name("aside").rename(deep)
    manifest(weights, snap).unlink()
    check = parse_snapshot_check(verify(snap, weights))
    assert (check.state, check.manifest, check.missing) == ("incomplete", False, ())
    assert "no manifest" in check.message


def test_verify_full_hashes_and_finds_a_file_changed_in_place(
    hub: HubStandin, snap: Snapshot, weights: Path
) -> None:
    assert fetch(snapshot_job(snap, str(weights), hub.url))["state"] == "done"
    config = snapshot_dir(weights, snap) / "config.json"
    config.write_bytes(CONFIG.replace(b"llama", b"LLAMA"))
    # same size: the quick check tells by the file's identity, which changed since it was checked
    quick = parse_snapshot_check(verify(snap, weights))
    assert quick.state == "incomplete" and quick.wrong == (
        ("config.json", "not checked since it last changed"),
    )
    check = parse_snapshot_check(verify(snap, weights, full=True))
    assert check.state == "incomplete" and [p for p, _ in check.wrong] == ["config.json"]


def test_verify_without_the_files_trusts_the_manifest_list(
    hub: HubStandin, snap: Snapshot, weights: Path
) -> None:
    assert fetch(snapshot_job(snap, str(weights), hub.url))["state"] == "done"
    job = {k: v for k, v in verify_snapshot_job(snap, str(weights)).items() if k != "files"}
    [answer] = node(job)
    assert answer["state"] == "complete" and answer["files"] == 4


def test_a_manifest_another_account_planted_is_not_believed(
    hub: HubStandin, snap: Snapshot, weights: Path
) -> None:
    if os.geteuid() != 0:
        pytest.skip("planting a file as another account needs root")
    assert fetch(snapshot_job(snap, str(weights), hub.url))["state"] == "done"
    os.chown(manifest(weights, snap), 4242, 4242)
    check = parse_snapshot_check(verify(snap, weights))
    assert check.state != "complete"


# --- the control host's side (pure) -----------------------------------------------------------


def test_the_job_names_every_file_with_its_digest_and_quoted_url() -> None:
    files = (
        SnapshotFile("a b/ü.json", 3, "1" * 40, Digest.git_sha1),
        SnapshotFile("m.safetensors", 5, "2" * 64, Digest.sha256),
    )
    snap = Snapshot(REPO, "c" * 40, files)
    job = snapshot_job(snap, "/w/", "https://hub.example", "tok")
    assert job["folder"] == "/w/hf/acme--tiny" and job["mode"] == "snapshot"
    assert job["files"][0] == {
        "path": "a b/ü.json",
        "size": 3,
        "sha256": None,
        "git_sha1": "1" * 40,
        "url": f"https://hub.example/acme/tiny/resolve/{'c' * 40}/a%20b/%C3%BC.json",
    }
    assert job["files"][1]["sha256"] == "2" * 64 and job["files"][1]["git_sha1"] is None
    assert (job["token"], job["token_origin"]) == ("tok", "https://hub.example")
    assert "token" not in snapshot_job(snap, "/w", "https://hub.example")
    with pytest.raises(ValueError, match="plain http"):
        snapshot_job(snap, "/w", "http://hub.example", "tok")


def test_a_snapshot_larger_than_allowed_is_refused() -> None:
    big = SnapshotFile("x.safetensors", core.MAX_SNAPSHOT_BYTES + 1, "2" * 64, Digest.sha256)
    with pytest.raises(ValueError, match="at most"):
        snapshot_job(Snapshot(REPO, "c" * 40, (big,)), "/w")


def test_the_node_program_keeps_the_control_hosts_limits() -> None:
    assert fetch_snapshot.SNAPSHOT_MAX_FILES == core.MAX_FILES
    assert fetch_snapshot.SNAPSHOT_MAX_BYTES == core.MAX_SNAPSHOT_BYTES
    assert repo_path.SNAPSHOT_MAX_PATH_CHARS == core.MAX_PATH_CHARS
    assert repo_path.SNAPSHOT_MAX_COMPONENT_BYTES == core.MAX_COMPONENT_BYTES
    assert fetch_snapshot.SNAPSHOT_MAX_MANIFEST_BYTES == core.MAX_MANIFEST_BYTES


def test_the_node_refuses_too_many_files_or_bytes() -> None:
    entry = {"path": "a", "size": 1, "sha256": None, "git_sha1": "1" * 40, "url": "https://h/x"}
    with pytest.raises(fetch_disk.JobFailed, match="at most"):
        fetch_snapshot._snapshot_files([entry] * (fetch_snapshot.SNAPSHOT_MAX_FILES + 1), urls=True)
    huge = {**entry, "size": fetch_snapshot.SNAPSHOT_MAX_BYTES + 1}
    with pytest.raises(fetch_disk.JobFailed, match="at most"):
        fetch_snapshot._snapshot_files([huge], urls=True)
    with pytest.raises(fetch_disk.JobFailed, match="neither a sha256"):
        fetch_snapshot._snapshot_files([{**entry, "git_sha1": None}], urls=True)


@pytest.mark.parametrize(
    "path", ["config.json", ".gitattributes", "a/b/c.safetensors", "ü/x y.json", "a..b", "x" * 255]
)
def test_the_node_accepts_the_paths_the_control_host_accepts(path: str) -> None:
    assert fetch_snapshot.check_snapshot_path(path) == core.check_repo_path(path)


def test_a_hostile_status_reads_as_unknown_and_bounded() -> None:
    assert parse_snapshot_status("nonsense").state == "unknown"
    assert parse_snapshot_status({}).state == "unknown"
    progress = parse_snapshot_status(
        {
            "state": "rm -rf",
            "files_done": 9,
            "files_total": 4,
            "bytes_done": -1,
            "bytes_total": True,
            "current": "a\x1b[2Jb",
            "message": ["x"],
        }
    )
    assert progress.state == "unknown"
    assert (progress.files_done, progress.files_total, progress.bytes_done, progress.bytes_total) == (
        4,
        4,
        0,
        0,
    )
    assert progress.current == "a?[2Jb" and progress.message == ""
    error = parse_snapshot_status({"state": "error", "kind": "checksum", "message": "m" * 5000})
    assert error.finished and error.kind == "checksum" and len(error.message) == 2000


def test_a_contradictory_check_is_not_complete() -> None:
    assert not parse_snapshot_check({"state": "complete", "manifest": False}).complete
    assert not parse_snapshot_check({"state": "complete", "manifest": True, "missing": ["a"]}).complete
    assert parse_snapshot_check({"state": "complete", "manifest": True}).complete
    assert parse_snapshot_check({"state": "error", "message": "unsafe: x"}).state == "error"
    assert parse_snapshot_check([1]).state == "error"


def test_a_single_file_cut_by_its_origin_is_resumed_not_refused(
    hub: HubStandin, snap: Snapshot, weights: Path
) -> None:
    """http.client ends a body cut short without an error; a single-file fetch whose origin
    closed the connection early is retried from where it stopped (Range, If-Range), as a
    snapshot's file is, instead of failing as a file of the wrong size."""
    weights.mkdir(parents=True, exist_ok=True)
    target = weights / "big.bin"
    hub.cut_after[BIG_SHA] = MiB
    job = {"mode": "fetch", "url": f"{hub.cdn_url}/blobs/{BIG_SHA}", "target": str(target), "sha256": BIG_SHA}
    node({**job, "foreground": True})
    status = json.loads((weights / ".big.bin.fetch-status").read_text())
    assert status["state"] == "done", status
    first, second = blob_gets(hub, BIG_SHA)
    assert "range" not in first and second["range"] == f"bytes={MiB}-", (first, second)
    assert target.read_bytes() == BIG
