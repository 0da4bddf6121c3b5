"""A local stand-in for the Hugging Face Hub, for tests: the HTTP API that huggingface_hub calls.

Two plain HTTP servers on 127.0.0.1, each on a port of its own: the Hub (``url``) and a CDN
(``cdn_url``). Being another origin (another port) matters: huggingface_hub sends the token
only to the origin it asked and to the Hub's own, so a test can see that the CDN never gets
it. What they answer, and the fields huggingface_hub reads from each answer:

- ``GET /api/models/{repo}[/revision/{rev}]`` (``HfApi.model_info``): ``id``, ``sha`` (the
  commit the revision points at), ``gated``, ``private``, ``siblings`` (``rfilename``; with
  ``?blobs=true`` also ``size``, ``blobId`` and ``lfs: {sha256, size, pointerSize}``).
- ``GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=&expand=`` (``HfApi.list_repo_tree``):
  entries ``{type: file|directory, oid, size, path}``, LFS files with ``lfs: {oid: <sha256>,
  size, pointerSize}`` and ``size`` the content's (``oid`` is the git blob sha1 of the pointer
  file); ``expand=true`` adds ``lastCommit``. Pages of ``page_size`` entries (the Hub's 1000,
  50 with expand), the next one named by a ``Link: <...>; rel="next"`` header, as
  huggingface_hub follows them.
- ``HEAD``/``GET /{repo}/resolve/{rev}/{path}`` (``hf_hub_download``,
  ``get_hf_file_metadata``): always ``X-Repo-Commit``. A git file answers 200 with ``ETag``
  (its git blob sha1) and ``Content-Length``; an LFS file answers 302 to the CDN with
  ``X-Linked-Etag`` (the content's sha256) and ``X-Linked-Size``, which huggingface_hub
  takes as the file's etag and size (it does not follow a redirect to another origin on the
  HEAD).
- ``GET``/``HEAD {cdn}/blobs/{sha256}``: the bytes, with single ``Range`` requests (206 and
  ``Content-Range``, 416 with ``bytes */<size>``) and ``If-Range`` on the ETag.

Errors carry the ``X-Error-Code`` that huggingface_hub maps to its exceptions:
``RepoNotFound`` (404; 401 for a private repo without a token), ``RevisionNotFound`` (404),
``EntryNotFound`` (404, with ``X-Repo-Commit``), ``GatedRepo`` (401 without a token, 403
with a token that is not the repo's). As on the Hub, a gated repo's metadata and file list
are public and only its files need the token; a private repo needs it everywhere.

The description is data a test may change while the servers run (``Repo.push`` moves a
branch) and may make hostile: any path, even ``../x``, is served as given. ``cut_after``
makes the next GET of a blob stop after that many bytes, to test a resume; ``held`` makes
every GET of a blob wait until its event is set (a download still under way, for as long as
a test wants); every request is logged in ``requests`` with its headers. ``cdn_url`` may be pointed at another server
(nginx serving the files ``write_blobs`` writes) after ``start``.
"""

from __future__ import annotations

import base64
import contextlib
import fnmatch
import hashlib
import json
import re
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

DEFAULT_LFS = ("*.safetensors", "*.bin", "*.gguf", "*.pt", "*.pth", "*.onnx", "*.msgpack", "*.h5", "*.model")
"""What a new Hub repo's ``.gitattributes`` sends to LFS (abridged)."""
DATE = "2024-05-01T12:00:00.000Z"


def git_blob_sha1(data: bytes) -> str:
    """Git's object id of a file: sha1 over ``blob <size>\\0`` and the bytes."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(data: bytes) -> bytes:
    """The pointer file git stores in place of an LFS file."""
    return (
        f"version https://git-lfs.github.com/spec/v1\noid sha256:{hashlib.sha256(data).hexdigest()}\n"
        f"size {len(data)}\n"
    ).encode()


@dataclass
class Repo:
    """One model repository: commits (sha40 -> files), refs (branch or tag -> sha40)."""

    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    gated: bool = False
    private: bool = False
    token: str | None = None
    lfs: tuple[str, ...] = DEFAULT_LFS

    def push(self, files: Mapping[str, bytes], branch: str = "main") -> str:
        """A new commit holding exactly ``files``, on ``branch`` (moved there); its sha40."""
        parent = self.refs.get(branch, "")
        h = hashlib.sha1(f"commit {parent} {len(self.commits)}\n".encode())
        for path in sorted(files):
            h.update(path.encode("utf-8", "surrogatepass") + b"\0" + hashlib.sha256(files[path]).digest())
        commit = h.hexdigest()
        self.commits[commit] = dict(files)
        self.refs[branch] = commit
        return commit

    def tag(self, name: str, commit: str) -> None:
        self.refs[name] = commit

    def is_lfs(self, path: str) -> bool:
        return any(fnmatch.fnmatchcase(path.rsplit("/", 1)[-1], p) for p in self.lfs)

    def commit_of(self, revision: str) -> str | None:
        if revision in self.refs:
            return self.refs[revision]
        return revision if revision in self.commits else None


@dataclass(frozen=True)
class Logged:
    server: str  # "hub" or "cdn"
    method: str
    path: str  # with the query
    headers: dict[str, str]
    status: int


class HubStandin:
    """The servers and what they serve; use as a context manager, or ``start``/``stop``."""

    def __init__(
        self, repos: dict[str, Repo] | None = None, page_size: int = 1000, expand_page_size: int = 50
    ):
        self.repos: dict[str, Repo] = repos if repos is not None else {}
        self.page_size = page_size
        self.expand_page_size = expand_page_size
        self.cut_after: dict[str, int] = {}  # sha256 -> bytes sent by the next GET of that blob
        self.held: dict[str, threading.Event] = {}  # sha256 -> set when a GET of that blob may answer
        self.requests: list[Logged] = []
        self.url = ""
        self.cdn_url = ""
        self._lock = threading.Lock()
        self._servers: list[tuple[ThreadingHTTPServer, threading.Thread]] = []

    # --- running ------------------------------------------------------------------------

    def start(self) -> HubStandin:
        for name in ("hub", "cdn"):
            server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self, name))
            server.daemon_threads = True
            thread = threading.Thread(
                target=server.serve_forever, args=(0.05,), name=f"hub-standin-{name}", daemon=True
            )
            thread.start()
            self._servers.append((server, thread))
            url = f"http://127.0.0.1:{server.server_address[1]}"
            if name == "hub":
                self.url = url
            else:
                self.cdn_url = url
        return self

    def stop(self) -> None:
        for event in self.held.values():
            event.set()
        for server, thread in self._servers:
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)
        self._servers.clear()

    def __enter__(self) -> HubStandin:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- what it serves ------------------------------------------------------------------

    def repo(self, repo_id: str, **settings: Any) -> Repo:
        """The repo named ``repo_id``, created (with ``settings``) if new."""
        if repo_id not in self.repos:
            self.repos[repo_id] = Repo(**settings)
        return self.repos[repo_id]

    def blobs(self) -> dict[str, bytes]:
        """sha256 -> content of every LFS file of every commit: what the CDN serves."""
        found = {}
        for repo in list(self.repos.values()):
            for files in list(repo.commits.values()):
                for path, data in files.items():
                    if repo.is_lfs(path):
                        found[hashlib.sha256(data).hexdigest()] = data
        return found

    def write_blobs(self, folder: Path) -> None:
        """Every blob as ``folder/blobs/<sha256>``: what another server needs to be the CDN."""
        (folder / "blobs").mkdir(parents=True, exist_ok=True)
        for sha, data in self.blobs().items():
            (folder / "blobs" / sha).write_bytes(data)

    def seen(self, server: str, header: str) -> list[str]:
        """The values of ``header`` in the requests ``server`` got."""
        with self._lock:
            logged = list(self.requests)
        return [
            r.headers[header.lower()] for r in logged if r.server == server and header.lower() in r.headers
        ]

    def log(self, entry: Logged) -> None:
        with self._lock:
            self.requests.append(entry)


# --- HTTP ---------------------------------------------------------------------------------


@dataclass
class Answer:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    cut: int | None = None  # send only this many body bytes, then drop the connection


def _error(status: int, code: str, message: str, **headers: str) -> Answer:
    body = json.dumps({"error": message}).encode()
    return Answer(
        status,
        {"X-Error-Code": code, "X-Error-Message": message, "Content-Type": "application/json", **headers},
        body,
    )


def _json(data: Any, **headers: str) -> Answer:
    return Answer(200, {"Content-Type": "application/json", **headers}, json.dumps(data).encode())


def _handler(hub: HubStandin, name: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            self._answer("GET")

        def do_HEAD(self) -> None:
            self._answer("HEAD")

        def _answer(self, method: str) -> None:
            headers = {k.lower(): v for k, v in self.headers.items()}
            try:
                answer = (_hub if name == "hub" else _cdn)(hub, method, self.path, headers)
            except Exception as e:  # a bug of the stand-in: say so rather than hang the client
                answer = Answer(500, {"Content-Type": "text/plain"}, repr(e).encode())
            hub.log(Logged(name, method, self.path, headers, answer.status))
            self.send_response(answer.status)
            for key, value in answer.headers.items():
                self.send_header(key, value)
            if "Content-Length" not in answer.headers:
                self.send_header("Content-Length", str(len(answer.body)))
            if answer.cut is not None:
                self.send_header("Connection", "close")
            self.end_headers()
            if method == "HEAD":
                return
            if answer.cut is not None:
                with contextlib.suppress(OSError):
                    self.wfile.write(answer.body[: answer.cut])
                    self.wfile.flush()
                self.close_connection = True
                return
            with contextlib.suppress(OSError):
                self.wfile.write(answer.body)

    return Handler


def _token(headers: dict[str, str]) -> str | None:
    auth = headers.get("authorization", "")
    return auth[len("Bearer ") :] if auth.startswith("Bearer ") else None


def _refused(repo_id: str, repo: Repo | None, headers: dict[str, str], files: bool) -> Answer | None:
    """Why this request may not see this repo (None: it may)."""
    token = _token(headers)
    if repo is None:
        return _error(404, "RepoNotFound", "Repository not found")
    if repo.private and token != repo.token:
        return _error(401 if token is None else 404, "RepoNotFound", "Repository not found")
    if repo.gated and files and token != repo.token:
        if token is None:
            return _error(
                401,
                "GatedRepo",
                f"Access to model {repo_id} is restricted. You must have access to it and be "
                "authenticated to access it. Please log in.",
            )
        return _error(
            403,
            "GatedRepo",
            f"Access to model {repo_id} is restricted and you are not in the authorized list.",
        )
    return None


def _true(query: dict[str, list[str]], key: str) -> bool:
    return query.get(key, ["false"])[-1].lower() in {"true", "1"}


def _hub(hub: HubStandin, method: str, raw_path: str, headers: dict[str, str]) -> Answer:
    split = urlsplit(raw_path)
    query = parse_qs(split.query)
    parts = [unquote(p) for p in split.path.split("/")[1:]]
    if len(parts) >= 3 and parts[0] == "api" and parts[1] == "models" and method == "GET":
        return _api(hub, parts[2:], query, headers)
    if len(parts) >= 5 and parts[2] == "resolve":
        repo_id = f"{parts[0]}/{parts[1]}"
        return _resolve(
            hub, repo_id, revision=parts[3], path="/".join(parts[4:]), method=method, headers=headers
        )
    return _error(404, "NotFound", f"no route for {split.path}")


def _api(hub: HubStandin, parts: list[str], query: dict[str, list[str]], headers: dict[str, str]) -> Answer:
    if len(parts) < 2:
        return _error(404, "RepoNotFound", "Repository not found")
    repo_id, rest = f"{parts[0]}/{parts[1]}", parts[2:]
    repo = hub.repos.get(repo_id)
    refused = _refused(repo_id, repo, headers, files=False)
    if refused is not None:
        return refused
    assert repo is not None
    if not rest or (rest[0] == "revision" and len(rest) == 2):
        revision = rest[1] if rest else "main"
        commit = repo.commit_of(revision)
        if commit is None:
            return _error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return _json(_model_info(repo_id, repo, commit, blobs=_true(query, "blobs")))
    if rest[0] == "tree" and len(rest) >= 2:
        return _tree(hub, repo_id, repo, revision=rest[1], folder="/".join(rest[2:]), query=query)
    return _error(404, "NotFound", "no such API")


def _file_fields(repo: Repo, path: str, data: bytes) -> dict[str, Any]:
    if repo.is_lfs(path):
        pointer = lfs_pointer(data)
        return {
            "oid": git_blob_sha1(pointer),
            "size": len(data),
            "lfs": {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": len(pointer)},
        }
    return {"oid": git_blob_sha1(data), "size": len(data)}


def _model_info(repo_id: str, repo: Repo, commit: str, blobs: bool) -> dict[str, Any]:
    files = repo.commits[commit]
    siblings = []
    for path in sorted(files):
        sibling: dict[str, Any] = {"rfilename": path}
        if blobs:
            f = _file_fields(repo, path, files[path])
            sibling |= {"size": f["size"], "blobId": f["oid"]}
            if "lfs" in f:
                lfs = f["lfs"]
                sibling["lfs"] = {
                    "sha256": lfs["oid"],
                    "size": lfs["size"],
                    "pointerSize": lfs["pointerSize"],
                }
        siblings.append(sibling)
    return {
        "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24],
        "id": repo_id,
        "modelId": repo_id,
        "author": repo_id.split("/", maxsplit=1)[0],
        "sha": commit,
        "lastModified": DATE,
        "createdAt": DATE,
        "private": repo.private,
        "gated": "manual" if repo.gated else False,
        "disabled": False,
        "downloads": 0,
        "likes": 0,
        "tags": [],
        "library_name": "transformers",
        "siblings": siblings,
        "spaces": [],
        "usedStorage": sum(len(d) for d in files.values()),
    }


def _entries(repo: Repo, files: dict[str, bytes], folder: str, recursive: bool) -> list[dict[str, Any]]:
    """The tree under ``folder``: folders first, then files, as the Hub lists them."""
    prefix = folder + "/" if folder else ""
    dirs: set[str] = set()
    found = []
    for path in sorted(files):
        if not path.startswith(prefix):
            continue
        rest = path[len(prefix) :]
        segments = rest.split("/")
        for i in range(1, len(segments)):
            if not recursive and i > 1:
                break
            dirs.add(prefix + "/".join(segments[:i]))
        if recursive or len(segments) == 1:
            found.append({"type": "file", "path": path, **_file_fields(repo, path, files[path])})
    folders = [
        {
            "type": "directory",
            "oid": hashlib.sha1(d.encode("utf-8", "surrogatepass")).hexdigest(),
            "size": 0,
            "path": d,
        }
        for d in sorted(dirs)
    ]
    return folders + found


def _tree(
    hub: HubStandin, repo_id: str, repo: Repo, *, revision: str, folder: str, query: dict[str, list[str]]
) -> Answer:
    commit = repo.commit_of(revision)
    if commit is None:
        return _error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
    files = repo.commits[commit]
    if folder and not any(p.startswith(folder + "/") for p in files):
        return _error(
            404, "EntryNotFound", f"{folder} does not exist on {revision}", **{"X-Repo-Commit": commit}
        )
    recursive, expand = _true(query, "recursive"), _true(query, "expand")
    entries = _entries(repo, files, folder, recursive)
    if expand:
        for e in entries:
            e["lastCommit"] = {"id": commit, "title": "Upload", "date": DATE}
    size = hub.expand_page_size if expand else hub.page_size
    cursor = query.get("cursor", [""])[-1]
    start = int(base64.urlsafe_b64decode(cursor.encode()).decode()) if cursor else 0
    page = entries[start : start + size]
    headers = {}
    if start + size < len(entries):
        nxt = base64.urlsafe_b64encode(str(start + size).encode()).decode()
        url = (
            f"{hub.url}/api/models/{repo_id}/tree/{quote(revision, safe='')}"
            + (f"/{quote(folder, safe='')}" if folder else "")
            + f"?recursive={str(recursive).lower()}&expand={str(expand).lower()}&cursor={nxt}"
        )
        headers["Link"] = f'<{url}>; rel="next"'
    return _json(page, **headers)


def _resolve(
    hub: HubStandin, repo_id: str, *, revision: str, path: str, method: str, headers: dict[str, str]
) -> Answer:
    repo = hub.repos.get(repo_id)
    refused = _refused(repo_id, repo, headers, files=True)
    if refused is not None:
        return refused
    assert repo is not None
    commit = repo.commit_of(revision)
    if commit is None:
        return _error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
    files = repo.commits[commit]
    if path not in files:
        return _error(
            404, "EntryNotFound", f"{path} does not exist on {revision}", **{"X-Repo-Commit": commit}
        )
    data = files[path]
    if repo.is_lfs(path):
        sha = hashlib.sha256(data).hexdigest()
        name = quote(path.rsplit("/", 1)[-1])
        body = b"Found. Redirecting to the CDN"
        return Answer(
            302,
            {
                "Location": f"{hub.cdn_url}/blobs/{sha}?filename={name}",
                "X-Repo-Commit": commit,
                "X-Linked-Etag": f'"{sha}"',
                "X-Linked-Size": str(len(data)),
                "ETag": f'"{git_blob_sha1(lfs_pointer(data))}"',
                "Content-Type": "text/plain",
            },
            body,
        )
    return _ranged(
        data, method, headers, etag=f'"{git_blob_sha1(data)}"', extra={"X-Repo-Commit": commit}, cut=None
    )


def _cdn(hub: HubStandin, method: str, raw_path: str, headers: dict[str, str]) -> Answer:
    split = urlsplit(raw_path)
    m = re.fullmatch(r"/blobs/([0-9a-f]{64})", split.path)
    data = hub.blobs().get(m.group(1)) if m else None
    if m is None or data is None:
        return Answer(404, {"Content-Type": "text/plain"}, b"no such blob")
    sha = m.group(1)
    held = hub.held.get(sha) if method == "GET" else None
    if held is not None:
        held.wait(timeout=60)
    cut = hub.cut_after.pop(sha, None) if method == "GET" else None
    name = parse_qs(split.query).get("filename", [sha])[-1]
    extra = {"Content-Disposition": f'attachment; filename="{name}"'}
    return _ranged(data, method, headers, etag=f'"{sha}"', extra=extra, cut=cut)


def _ranged(
    data: bytes, method: str, headers: dict[str, str], *, etag: str, extra: dict[str, str], cut: int | None
) -> Answer:
    """The file, or the one range asked for (RFC 9110: a changed ETag under If-Range: all of it)."""
    base = {"ETag": etag, "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream", **extra}
    asked = headers.get("range")
    if asked and headers.get("if-range", etag) != etag:
        asked = None
    if not asked:
        return Answer(200, base, data, cut)
    m = re.fullmatch(r"bytes=(\d*)-(\d*)", asked.strip())
    if m is None or m.groups() == ("", ""):
        return Answer(200, base, data, cut)
    total = len(data)
    first, last = m.groups()
    if first == "":
        start, end = max(total - int(last), 0), total - 1
    else:
        start, end = int(first), min(int(last), total - 1) if last else total - 1
    if start >= total or start > end:
        return Answer(416, {**base, "Content-Range": f"bytes */{total}"}, b"")
    part = data[start : end + 1]
    return Answer(206, {**base, "Content-Range": f"bytes {start}-{end}/{total}"}, part, cut)


@contextlib.contextmanager
def running(repos: dict[str, Repo] | None = None, **settings: Any) -> Iterator[HubStandin]:
    with HubStandin(repos, **settings) as hub:
        yield hub
