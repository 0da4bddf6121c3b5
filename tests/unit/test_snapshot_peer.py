"""A snapshot copied from node to node: ``serve-snapshot`` on one node, a ``snapshot`` job
with ``peer: true`` on another. Both run as they do on a node (the node program piped to
``python3 -``), in two temporary weights folders, with the Hub stand-in as the origin and
real servers on 127.0.0.1 only. A test holds a snapshot's lock itself where it plays the
job that runs on the serving node."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import http.client
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import pytest

from llmgw_cli.core.weights import snapshot as core
from llmgw_cli.core.weights.snapshot import RepoRef, Selection, Snapshot, snapshot_job, verify_snapshot_job
from llmgw_cli.node import fetch_disk, fetch_http
from llmgw_cli.remote.fetch import node_script
from llmgw_cli.remote.hub import resolve
from tests.hub_standin import HubStandin
from tests.ports import free_port
from tests.unit.test_snapshot_fetch import files_under, manifest, snapshot_dir
from tests.waiting import wait_until

MiB = 1 << 20
REPO = "acme/tiny"
SECRET = "s3cr3t-0123456789abcdef-0123456789abcdef"
BIND = "127.0.0.1"  # this machine plays every node: its loopback is their fabric
TOKEN = "hf_secret_token"
FILES = {
    "config.json": b'{"model_type": "llama"}\n',  # a git file: checked by its blob id
    "model-00001-of-00002.safetensors": os.urandom(MiB + 5),  # LFS: by sha256
    "weights/deep/model-00002-of-00002.safetensors": os.urandom(MiB // 2 + 3),
}
FIRST, LAST = "config.json", "weights/deep/model-00002-of-00002.safetensors"


@pytest.fixture
def hub(hub_standin: HubStandin, hf_home: str) -> HubStandin:
    hub_standin.repo(REPO).push(FILES)
    return hub_standin


@pytest.fixture
def snap(hub: HubStandin) -> Snapshot:
    snap = resolve(RepoRef(REPO), None, hub.url, Selection(include=("*",)))
    assert [f.path for f in snap.files] == sorted(FILES)  # the jobs fetch in this order
    return snap


@pytest.fixture
def origin(tmp_path: Path) -> Path:
    """The weights folder of the node that downloads from the Hub and serves its peers."""
    (tmp_path / "origin").mkdir()
    return tmp_path / "origin"


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """The weights folder of the node that copies from the serving one."""
    (tmp_path / "copy").mkdir()
    return tmp_path / "copy"


def script(job: dict[str, Any], retries: int | None = None) -> str:
    text = node_script(job)
    if retries is not None:
        text = text.replace(f"RETRIES = {fetch_disk.RETRIES}\n", f"RETRIES = {retries}\n", 1)
    return text


def node(job: dict[str, Any], retries: int | None = None) -> list[dict[str, Any]]:
    """Run the node program on ``job`` to its end; its JSON lines."""
    done = subprocess.run(
        [sys.executable, "-"], input=script(job, retries), text=True, capture_output=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def started(job: dict[str, Any], retries: int | None = None) -> subprocess.Popen[str]:
    """The node program on ``job``, running (the caller waits for it or ends it)."""
    proc = subprocess.Popen(
        [sys.executable, "-"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None
    proc.stdin.write(script(job, retries))
    proc.stdin.close()
    proc.stdin = None  # written and closed: communicate() must not flush it
    return proc


def ended(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    proc.communicate(timeout=30)


def status(weights: Path, snap: Snapshot) -> dict[str, Any]:
    path = Path(core.repo_folder(str(weights), snap.repo)) / f".{snap.commit}.snapshot-status"
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def fetched(hub: HubStandin, snap: Snapshot, weights: Path) -> None:
    """The whole snapshot in ``weights``, from the Hub."""
    assert node({**snapshot_job(snap, str(weights), hub.url), "foreground": True}) == []
    assert status(weights, snap)["state"] == "done"


@contextlib.contextmanager
def serving(weights: Path, snap: Snapshot, **options: Any) -> Iterator[int]:
    """``serve-snapshot`` of ``weights``' snapshot, in the foreground; its port."""
    job = {
        **core.serve_snapshot_job(
            str(weights), snap.repo, snap.commit, SECRET, 60, bind=BIND, foreground=True
        ),
        **options,
    }
    proc = started(job)
    try:
        assert proc.stdout is not None
        answer = json.loads(proc.stdout.readline())
        assert answer["state"] == "serving" and answer["pid"] == proc.pid, answer
        yield int(answer["port"])
    finally:
        ended(proc)


@contextlib.contextmanager
def job_running(weights: Path, snap: Snapshot) -> Iterator[None]:
    """The snapshot's lock held, as its job on that node holds it."""
    folder = Path(core.repo_folder(str(weights), snap.repo))
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / f".{snap.commit}.snapshot-lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def ask(port: int, raw_path: str, method: str = "GET", **headers: str) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, raw_path, headers=headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def url(port: int, path: str) -> str:
    return f"http://127.0.0.1:{port}/{SECRET}/{quote(path)}"


def copy_job(snap: Snapshot, weights: Path, port: int, *, peer: bool = True) -> dict[str, Any]:
    """The snapshot job of the copying node, its files' URLs on the peer."""
    job = core.peer_snapshot_job(snap, str(weights), url(port, ""))
    return {**job, "peer": peer, "foreground": True}


def cdn_gets(hub: HubStandin) -> list[str]:
    return [r.path for r in hub.requests if r.server == "cdn" and r.method == "GET"]


# --- serve-snapshot -------------------------------------------------------------------------


def test_a_complete_snapshots_files_are_served_byte_exact_with_ranges(
    hub: HubStandin, snap: Snapshot, origin: Path
) -> None:
    fetched(hub, snap, origin)
    big = FILES["model-00001-of-00002.safetensors"]
    with serving(origin, snap) as port:
        for path, data in FILES.items():
            got, headers, body = ask(port, f"/{SECRET}/{quote(path)}")
            assert (got, body == data) == (200, True), path
            assert headers["content-length"] == str(len(data)) and headers["accept-ranges"] == "bytes"
        got, headers, body = ask(port, f"/{SECRET}/model-00001-of-00002.safetensors", "HEAD")
        assert (got, headers["content-length"], body) == (200, str(len(big)), b"")
        etag = headers["etag"]
        got, headers, body = ask(
            port, f"/{SECRET}/model-00001-of-00002.safetensors", Range=f"bytes={MiB}-", **{"If-Range": etag}
        )
        assert (got, headers["content-range"], body) == (
            206,
            f"bytes {MiB}-{len(big) - 1}/{len(big)}",
            big[MiB:],
        )
        got, _, body = ask(
            port,
            f"/{SECRET}/model-00001-of-00002.safetensors",
            Range=f"bytes={MiB}-",
            **{"If-Range": '"old"'},
        )
        assert (got, body == big) == (200, True)  # another version than the one resumed: all of it
        got, headers, _ = ask(port, f"/{SECRET}/config.json", Range="bytes=999-")
        assert (got, headers["content-range"]) == (416, f"bytes */{len(FILES['config.json'])}")


def test_a_copy_from_a_complete_peer_is_verified_and_asks_the_hub_nothing(
    hub: HubStandin, snap: Snapshot, origin: Path, copy: Path
) -> None:
    fetched(hub, snap, origin)
    before = len(hub.requests)
    with serving(origin, snap) as port:
        assert node(copy_job(snap, copy, port)) == []
    st = status(copy, snap)
    assert st["state"] == "done", st
    assert files_under(snapshot_dir(copy, snap)) == FILES
    assert manifest(copy, snap).read_text() == manifest(origin, snap).read_text()
    [check] = node({**verify_snapshot_job(snap, str(copy)), "full": True})
    assert check["state"] == "complete", check
    assert len(hub.requests) == before


def test_hostile_requests_are_refused_even_while_the_job_runs(
    hub: HubStandin, snap: Snapshot, origin: Path
) -> None:
    """Nothing but a regular file inside the snapshot folder is served: not the manifest or
    a canary beside or above it, however ``..`` or ``/`` is spelled, nor through a link
    planted in the folder; and a refusal is 404 (never 503: not worth waiting for)."""
    fetched(hub, snap, origin)
    folder = snapshot_dir(origin, snap)
    canary = origin / "hf" / "canary.txt"
    canary.write_bytes(b"root only")
    (folder / "planted.json").symlink_to(canary)
    (folder / "planted").symlink_to(canary.parent)
    hostile = [
        f"/{SECRET}/../{snap.commit}.manifest.json",
        f"/{SECRET}/..%2F{snap.commit}.manifest.json",
        f"/{SECRET}/%2e%2e/%2e%2e/canary.txt",
        f"/{SECRET}/weights%2F..%2F..%2F..%2Fcanary.txt",
        f"/{SECRET}/weights/./deep/model-00002-of-00002.safetensors",
        f"/{SECRET}//etc/passwd",
        f"/{SECRET}/%2Fetc%2Fpasswd",
        f"/{SECRET}/%2F{str(canary).lstrip('/')}",
        f"/{SECRET}/planted.json",
        f"/{SECRET}/planted/canary.txt",
        f"/{SECRET}/weights/deep",
        f"/{SECRET}/",
        f"/{SECRET}/config.json%00",
        f"/{SECRET}/%ff.json",
        f"/{SECRET}/config.json?download=1",
        f"/{SECRET}/weights%5Cdeep%5Cmodel-00002-of-00002.safetensors",
        "/wrong-secret/config.json",
        f"/{SECRET[:-1]}/config.json",
        f"/{SECRET}config.json",
        "/config.json",
    ]
    with job_running(origin, snap), serving(origin, snap) as port:
        assert ask(port, f"/{SECRET}/config.json")[0] == 200  # the server serves; these it refuses
        answers = {raw: ask(port, raw)[0] for raw in hostile}
    assert answers == dict.fromkeys(hostile, 404)


def test_a_missing_file_is_503_while_the_job_runs_and_404_once_it_ended(
    hub: HubStandin, snap: Snapshot, origin: Path
) -> None:
    fetched(hub, snap, origin)
    folder = snapshot_dir(origin, snap)
    manifest(origin, snap).unlink()
    (folder / LAST).unlink()
    (folder / "weights" / "deep").rmdir()  # a folder of the path not made yet either
    with serving(origin, snap) as port:
        with job_running(origin, snap):
            got, headers, _ = ask(port, f"/{SECRET}/{quote(LAST)}")
            assert (got, headers.get("retry-after")) == (503, "1")
            assert ask(port, f"/{SECRET}/{quote(LAST)}", "HEAD")[0] == 503
            assert ask(port, f"/{SECRET}/{FIRST}")[0] == 200  # what is in place is served meanwhile
        assert ask(port, f"/{SECRET}/{quote(LAST)}")[0] == 404
        (folder / "weights" / "deep").mkdir()
        (folder / LAST).write_bytes(FILES[LAST])  # whatever is at its final name: the copier checks it
        got, _, body = ask(port, f"/{SECRET}/{quote(LAST)}")
        assert (got, body == FILES[LAST]) == (200, True)


def test_serve_snapshot_refuses_a_bad_job_and_a_planted_snapshot_folder(
    hub: HubStandin, snap: Snapshot, origin: Path, tmp_path: Path
) -> None:
    base = core.serve_snapshot_job(
        str(origin), snap.repo, snap.commit, SECRET, 60, bind=BIND, foreground=True
    )
    for bad in ({"commit": "main"}, {"folder": "/tmp/hf/other--repo"}, {"repo": "a/../b"}, {"secret": ""}):
        [answer] = node({**base, **bad})
        assert (answer["state"], answer["kind"]) == ("error", "job"), (bad, answer)
    Path(base["folder"]).mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    Path(base["folder"], snap.commit).symlink_to(tmp_path / "elsewhere")
    [answer] = node(base)
    assert (answer["state"], answer["kind"]) == ("error", "unsafe"), answer
    assert "symbolic link" in answer["message"]


def test_an_idle_serve_snapshot_ends_by_itself(snap: Snapshot, origin: Path) -> None:
    folder = core.repo_folder(str(origin), snap.repo)
    Path(folder).mkdir(parents=True)
    job = {"mode": "serve-snapshot", "folder": folder, "repo": snap.repo, "commit": snap.commit, "bind": BIND}
    proc = started({**job, "secret": SECRET, "idle": 0.5, "foreground": True})
    try:
        assert proc.stdout is not None
        port = json.loads(proc.stdout.readline())["port"]
        assert ask(port, f"/{SECRET}/{FIRST}")[0] == 404  # no job, no file
        proc.communicate(timeout=20)  # ends by itself, idle
        assert proc.returncode == 0
    finally:
        if proc.returncode is None:
            ended(proc)


def test_serve_still_serves_one_file_with_ranges(tmp_path: Path) -> None:
    """``serve`` shares its answer with ``serve-snapshot``."""
    data = os.urandom(100_000)
    (tmp_path / "one.bin").write_bytes(data)
    proc = started(
        {
            "mode": "serve",
            "file": str(tmp_path / "one.bin"),
            "secret": SECRET,
            "bind": BIND,
            "foreground": True,
        }
    )
    try:
        assert proc.stdout is not None
        port = json.loads(proc.stdout.readline())["port"]
        got, headers, body = ask(port, f"/{SECRET}/one.bin", Range="bytes=10-")
        assert (got, headers["content-range"], body) == (206, f"bytes 10-99999/{len(data)}", data[10:])
        assert ask(port, f"/{SECRET}/other.bin")[0] == 404
    finally:
        ended(proc)


# --- copying from a peer --------------------------------------------------------------------


def test_a_copy_takes_each_file_as_soon_as_the_peer_has_it(
    hub: HubStandin, snap: Snapshot, origin: Path, copy: Path
) -> None:
    """The origin's download of the last file is held at the Hub; meanwhile the copy has
    the files before it, copied and in place, and waits for the last one on the peer.
    Once the origin has it, the copy takes it too. Only the origin asked the Hub."""
    last_sha = hashlib.sha256(FILES[LAST]).hexdigest()
    hold = hub.held[last_sha] = threading.Event()
    origin_job = started({**snapshot_job(snap, str(origin), hub.url), "foreground": True})
    copying: subprocess.Popen[str] | None = None
    try:
        wait_until(
            lambda: status(origin, snap).get("current") == LAST,
            timeout=60,
            what="the origin to ask for its last file",
            retry_on=(FileNotFoundError, ValueError),
        )
        with serving(origin, snap) as port:
            copying = started(copy_job(snap, copy, port))
            waiting = wait_until(
                lambda: status(copy, snap),
                until=lambda st: st.get("waiting") == f"{LAST} on the peer",
                timeout=60,
                what="the copy to wait for the last file on the peer",
                retry_on=(FileNotFoundError, ValueError),
            )
            # The origin has not finished its last file, and the copy has every file before it.
            assert not (snapshot_dir(origin, snap) / LAST).exists()
            assert status(origin, snap)["state"] == "fetching"
            assert (waiting["state"], waiting["current"], waiting["files_done"]) == ("fetching", LAST, 2)
            assert files_under(snapshot_dir(copy, snap)) == {p: d for p, d in FILES.items() if p != LAST}
            hold.set()
            origin_job.communicate(timeout=60)
            copying.communicate(timeout=60)
    finally:
        hold.set()
        for proc in (origin_job, copying):
            if proc is not None and proc.returncode is None:
                ended(proc)
    assert status(origin, snap)["state"] == "done"
    st = status(copy, snap)
    assert (st["state"], st["waiting"]) == ("done", None), st
    assert files_under(snapshot_dir(copy, snap)) == FILES
    [check] = node({**verify_snapshot_job(snap, str(copy)), "full": True})
    assert check["state"] == "complete", check
    gets = cdn_gets(hub)
    assert len(gets) == 2 and len(set(gets)) == 2  # each LFS file once from the Hub: by the origin


def test_a_peer_whose_job_ends_without_the_file_fails_the_copy_as_peer(
    hub: HubStandin, snap: Snapshot, origin: Path, copy: Path
) -> None:
    fetched(hub, snap, origin)
    manifest(origin, snap).unlink()
    (snapshot_dir(origin, snap) / LAST).unlink()
    with serving(origin, snap) as port:
        with job_running(origin, snap):
            copying = started(copy_job(snap, copy, port))
            try:
                wait_until(
                    lambda: status(copy, snap).get("waiting"),
                    timeout=60,
                    what="the copy to wait on the peer",
                    retry_on=(FileNotFoundError, ValueError),
                )
            except BaseException:
                ended(copying)
                raise
        copying.communicate(timeout=60)  # the lock is free, the file still missing: 404
    st = status(copy, snap)
    assert (st["state"], st["kind"]) == ("error", "peer"), st
    assert LAST in st["message"] and "404" in st["message"]
    assert not (snapshot_dir(copy, snap) / LAST).exists()
    assert (snapshot_dir(copy, snap) / FIRST).read_bytes() == FILES[FIRST]
    assert not manifest(copy, snap).exists()


def test_a_peer_that_is_gone_fails_the_copy_as_peer(snap: Snapshot, copy: Path) -> None:
    assert node(copy_job(snap, copy, free_port()), retries=1) == []
    st = status(copy, snap)
    assert (st["state"], st["kind"]) == ("error", "peer"), st
    assert "cannot be reached" in st["message"]
    assert not manifest(copy, snap).exists()


def test_a_corrupted_file_on_the_peer_is_refused_and_not_placed(
    hub: HubStandin, snap: Snapshot, origin: Path, copy: Path
) -> None:
    fetched(hub, snap, origin)
    served = snapshot_dir(origin, snap) / "model-00001-of-00002.safetensors"
    data = bytearray(served.read_bytes())
    data[MiB] ^= 0xFF
    served.write_bytes(bytes(data))  # same size: only the digest tells
    with serving(origin, snap) as port:
        assert node(copy_job(snap, copy, port)) == []
    st = status(copy, snap)
    assert (st["state"], st["kind"]) == ("error", "checksum"), st
    assert "model-00001-of-00002.safetensors" in st["message"]
    assert not (snapshot_dir(copy, snap) / "model-00001-of-00002.safetensors").exists()
    work = Path(core.repo_folder(str(copy), snap.repo)) / f".{snap.commit}.snapshot-work"
    assert [p.name for p in work.iterdir() if p.name.endswith(".part")] == []
    assert not manifest(copy, snap).exists()


def test_without_peer_a_503_is_an_http_error_as_before(
    hub: HubStandin, snap: Snapshot, origin: Path, copy: Path
) -> None:
    fetched(hub, snap, origin)
    (snapshot_dir(origin, snap) / FIRST).unlink()
    with job_running(origin, snap), serving(origin, snap) as port:
        assert node(copy_job(snap, copy, port, peer=False)) == []
    st = status(copy, snap)
    assert (st["state"], st["kind"]) == ("error", "http"), st
    assert "503" in st["message"]


@pytest.fixture
def logging_peer() -> Iterator[tuple[str, list[dict[str, str]]]]:
    """A peer that serves FILES at ``/<secret>/<path>`` and logs every request's headers."""
    seen: list[dict[str, str]] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            seen.append({k.lower(): v for k, v in self.headers.items()})
            data = FILES.get(unquote(self.path.split("/", 2)[-1]))
            self.send_response(200 if data is not None else 404)
            self.send_header("Content-Length", str(len(data or b"")))
            self.end_headers()
            self.wfile.write(data or b"")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("peer", [True, False])
def test_no_token_goes_to_a_peer_even_one_named_as_the_token_origin(
    snap: Snapshot, copy: Path, logging_peer: tuple[str, list[dict[str, str]]], peer: bool
) -> None:
    """The peer is on loopback, where a token may go to its own origin in clear: only
    ``peer`` keeps it from going (the case without shows the witness would see it)."""
    origin_url, seen = logging_peer
    port = int(origin_url.rsplit(":", 1)[1])
    job = {**copy_job(snap, copy, port, peer=peer), "token": TOKEN, "token_origin": origin_url}
    assert fetch_http.may_carry_token_to(origin_url, url(port, FIRST))
    assert node(job) == []
    assert status(copy, snap)["state"] == "done"
    assert len(seen) == len(FILES)
    auth = {h.get("authorization") for h in seen}
    assert auth == ({None} if peer else {f"Bearer {TOKEN}"})


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(None, 1.0), ("1", 1.0), ("3", 3.0), ("60", 5.0), ("0", 0.5), ("soon", 1.0), ("-2", 1.0)],
)
def test_retry_after_is_honoured_within_bounds(value: str | None, seconds: float) -> None:
    assert fetch_http.retry_after(value) == seconds
