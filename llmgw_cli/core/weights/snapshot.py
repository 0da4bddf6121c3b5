"""Whole Hugging Face repositories as weights: which repo and commit, which of its files,
where they live on a node, and when a copy there is complete. Pure: no I/O; the Hub is
asked by ``remote/hub.py``, the files are written by the node program.

Source: ``org/name`` or ``org/name@revision``. The repo id follows the Hub's own rules
(ASCII letters, digits, ``_ . -``, starting and ending with a letter, digit or ``_``, at
most 96 characters a part, no ``--`` nor ``..``, not ending in ``.git``). A revision is a
branch, a tag or a 40-hex commit; branches and tags are a strict subset of git's ref names:
components of ``A-Z a-z 0-9 _ . -`` that start with a letter, digit or ``_``, joined by
single slashes (``refs/pr/1``), no ``..``, no component ending in ``.lock``, at most 255
characters. Without one, the revision is ``main``. Only a commit pins what a node gets: a
branch is resolved to its commit once, and that commit is what is fetched and recorded.

Layout on a node, under a weights folder ``W``::

    W/hf/<org>--<name>/<commit40>/<the repo's files, at their paths>
    W/hf/<org>--<name>/<commit40>.manifest.json

One folder per repo and commit (``--`` cannot occur in a repo id, so the folder name is the
repo's alone, as in huggingface_hub's own cache), so a new commit never changes the files
an engine is running from, and two commits share nothing. The manifest sits beside the
snapshot folder, not in it: every name inside the folder is the repository's, so no file a
repository ships can take the manifest's place. It is written last, once every file is in
place and checked: a snapshot without its manifest is incomplete, whatever files it holds.

Hostile data: the Hub's listing (or anything pretending to be the Hub) chooses every path
in it, so each is checked before it is used, and a bad one fails the whole snapshot with
its reason (``check_repo_path``); it is never joined to a folder. A manifest read back from
a node is checked the same way.

Hashes: the Hub gives an LFS file's sha256 and a git file's blob id (sha1 over ``blob
<size>\\0`` and the bytes, ``git_blob_header``); a ``SnapshotFile`` says which it holds. The
manifest holds the sha256 of every file, as computed on the node while writing it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from fnmatch import fnmatchcase
from typing import Any
from urllib.parse import quote, urlsplit

from llmgw_cli.errors import BadPath, BadSource
from llmgw_cli.node.repo_path import SNAPSHOT_MAX_COMPONENT_BYTES, SNAPSHOT_MAX_PATH_CHARS, repo_path_problem

DEFAULT_REVISION = "main"
DEFAULT_ENDPOINT = "https://huggingface.co"
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})
HF_FOLDER = "hf"
MANIFEST_SUFFIX = ".manifest.json"
MANIFEST_FORMAT = 1
MAX_PATH_CHARS = SNAPSHOT_MAX_PATH_CHARS
MAX_COMPONENT_BYTES = SNAPSHOT_MAX_COMPONENT_BYTES
MAX_FILES = 100_000
"""Most files a snapshot may hold: a listing beyond it is refused, not truncated."""
MAX_MANIFEST_BYTES = 64 << 20
MAX_SNAPSHOT_BYTES = 1 << 42
"""Most bytes a snapshot may hold (4 TiB: more than the largest public checkpoints)."""

_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
_REPO = re.compile(rf"({_PART})/({_PART})")
_COMPONENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
COMMIT = re.compile(r"[0-9a-f]{40}")
SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class RepoRef:
    """A parsed source: the repo id and the revision asked for (``main`` when none is)."""

    repo: str
    revision: str = DEFAULT_REVISION

    def __post_init__(self) -> None:
        # Built directly or parsed, a ref is checked: its parts go into the Hub's URLs.
        check_repo_id(self.repo)
        check_revision(self.revision)

    @property
    def org(self) -> str:
        return self.repo.split("/", 1)[0]

    @property
    def name(self) -> str:
        return self.repo.split("/", 1)[1]

    @property
    def pinned(self) -> bool:
        """Whether the revision is a commit: the only revision whose files cannot change."""
        return COMMIT.fullmatch(self.revision) is not None

    def __str__(self) -> str:
        return f"{self.repo}@{self.revision}"


def check_repo_id(repo: str) -> str:
    """``repo`` if it is an ``org/name`` the Hub would accept, else BadSource with why."""
    m = _REPO.fullmatch(repo) if isinstance(repo, str) else None
    if m is None:
        raise BadSource(
            f"{repo!r} is not a repo id: give org/name, each part of letters, digits, '_', '.' "
            "or '-' (at most 96), starting and ending with a letter, digit or '_'"
        )
    if "--" in repo or ".." in repo:
        raise BadSource(f"{repo!r}: a repo id has no '--' and no '..'")
    if repo.endswith(".git"):
        raise BadSource(f"{repo!r}: a repo id does not end in '.git'")
    return repo


def check_revision(revision: str) -> str:
    """``revision`` if it is a commit, or a branch or tag name this module accepts, else
    BadSource with why."""
    if not isinstance(revision, str):
        raise BadSource(f"{revision!r}: a revision is a string")
    if COMMIT.fullmatch(revision):
        return revision
    if not revision:
        raise BadSource("empty revision: give a branch, a tag or a 40-hex commit after '@'")
    if len(revision) > 255:
        raise BadSource(f"revision of {len(revision)} characters: at most 255")
    if ".." in revision:
        raise BadSource(f"{revision!r}: a revision has no '..'")
    for component in revision.split("/"):
        if not component:
            raise BadSource(f"{revision!r}: slashes only between names (no leading, trailing or double '/')")
        if not _COMPONENT.fullmatch(component):
            raise BadSource(
                f"{revision!r}: a branch or tag is made of letters, digits, '_', '.' and '-' "
                "(each part starting with a letter, digit or '_'), parts joined by '/'"
            )
        if component.endswith(".lock"):
            raise BadSource(f"{revision!r}: no part of a revision ends in '.lock'")
    return revision


def parse_repo_ref(source: str) -> RepoRef:
    """``org/name`` or ``org/name@revision`` as a RepoRef; BadSource, saying why, otherwise."""
    if not isinstance(source, str):
        raise BadSource(f"{source!r} is not a string")
    repo, at, revision = source.partition("@")
    return RepoRef(repo, revision) if at else RepoRef(repo)


def check_endpoint(endpoint: str) -> str:
    """``endpoint`` (the Hub, or a mirror of its API) as ``scheme://host[:port]``, else
    ValueError with why. The token goes to it, so it is https, or plain http to this
    machine only (a local mirror, a test's stand-in): never in clear over a network."""
    split = urlsplit(endpoint)
    if split.scheme not in {"https", "http"} or not split.hostname:
        raise ValueError(f"{endpoint!r}: a Hub endpoint is an https:// URL")
    if split.username or split.password or split.query or split.fragment or split.path not in {"", "/"}:
        raise ValueError(f"{endpoint!r}: a Hub endpoint is scheme://host[:port], nothing more")
    if split.scheme == "http" and split.hostname not in LOOPBACK_HOSTS:
        raise ValueError(f"{endpoint!r}: plain http only to this machine (127.0.0.1); use https")
    return endpoint.rstrip("/")


# --- paths the repository names ------------------------------------------------------------


def check_repo_path(path: object) -> str:
    """``path`` if it names a file inside a snapshot folder, else BadPath with why: the
    node's own check (``node/repo_path.py``), so both sides accept the same paths."""
    why = repo_path_problem(path)
    if why is not None:
        raise BadPath(why)
    return str(path)


def check_repo_paths(paths: Iterable[str]) -> list[str]:
    """Every path checked, none twice, and none both a file and a folder (``a`` and
    ``a/b``): a listing that says so is not a git tree, and writing it would replace one
    file by another."""
    seen: set[str] = set()
    folders: set[str] = set()
    checked = []
    for path in paths:
        check_repo_path(path)
        if path in seen:
            raise BadPath(f"{path!r}: listed twice")
        if len(seen) >= MAX_FILES:
            raise BadPath(f"more than {MAX_FILES} files")
        seen.add(path)
        parts = path.split("/")
        folders.update("/".join(parts[:i]) for i in range(1, len(parts)))
        checked.append(path)
    if clashes := sorted(seen & folders):
        raise BadPath(f"{clashes[0]!r}: listed both as a file and as a folder")
    return checked


# --- which files -------------------------------------------------------------------------

DEFAULT_INCLUDE = (
    "*.json",  # config, generation_config, tokenizer, the safetensors index
    "*.safetensors",
    "*.model",  # sentencepiece vocabularies: tokenizer.model, spiece.model
    "*.tiktoken",
    "*.txt",  # merges.txt, vocab.txt
    "*.jinja",  # chat templates kept apart from tokenizer_config.json
)
"""What a repo brings when its model names no ``include``: the weights in safetensors and
what an engine reads beside them. Not ``*.py``: a repository's code runs only when an
engine is told to trust it, and whoever does that says ``include`` as well."""
DEFAULT_EXCLUDE = (
    "original/*",  # the author's own checkpoint format, beside the transformers one
    "*.pth",
    "*.pt",
    "*.gguf",
    "*.onnx",
    "*.onnx_data",
    "*.msgpack",
    "*.h5",
    "*.ckpt",
    "*.tflite",
    "onnx/*",
    "training_args.bin",
)
"""What a repo without ``include`` never brings: other formats of the same weights, and
training leftovers."""
PYTORCH_FALLBACK = ("*.bin",)
"""With the default selection and no ``*.safetensors`` in the repo: its weights are
pickled PyTorch files, which are brought instead."""


class WeightFormat(StrEnum):
    safetensors = "safetensors"
    pytorch = "pytorch"  # *.bin
    none = "none"  # neither: a tokenizer-only or GGUF repo, say


@dataclass(frozen=True)
class Selection:
    """Which files of a repo are fetched.

    ``include``/``exclude`` are glob patterns with huggingface_hub's semantics
    (``allow_patterns``/``ignore_patterns``): ``fnmatch``, case-sensitive, matched against
    the whole path, ``*`` crossing ``/`` (``*.json`` matches ``a/b.json``), a pattern ending
    in ``/`` taken as that folder's content. A file is kept when it matches some include and
    no exclude.

    ``include`` None: DEFAULT_INCLUDE, with DEFAULT_EXCLUDE added to ``exclude``, and
    ``*.bin`` in place of ``*.safetensors`` for a repo that has no safetensors. Given, it
    replaces both defaults: the list says exactly what is wanted.

    Whatever the patterns, the weights are never brought twice over: when a kept file is a
    ``*.safetensors``, the ``*.bin`` files (and ``*.bin.index.json``) are left out; and
    when safetensors shards are kept beside a ``consolidated*.safetensors`` (Mistral's own
    format of the same weights), the latter is left out.
    """

    include: tuple[str, ...] | None = None
    exclude: tuple[str, ...] = ()

    def patterns(self, paths: Iterable[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The include and exclude lists in force for a repo holding ``paths``."""
        if self.include is not None:
            return _patterns(self.include), _patterns(self.exclude)
        include: tuple[str, ...] = DEFAULT_INCLUDE
        if not any(fnmatchcase(p, "*.safetensors") for p in paths):
            include = tuple(p for p in include if p != "*.safetensors") + PYTORCH_FALLBACK
        return _patterns(include), _patterns(DEFAULT_EXCLUDE + self.exclude)

    def select(self, paths: Iterable[str]) -> list[str]:
        """The paths kept, in the order given."""
        paths = list(paths)
        include, exclude = self.patterns(paths)
        kept = [
            p
            for p in paths
            if any(fnmatchcase(p, i) for i in include) and not any(fnmatchcase(p, e) for e in exclude)
        ]
        return one_format(kept)


def _patterns(patterns: Iterable[str]) -> tuple[str, ...]:
    """As huggingface_hub reads them: ``\\`` as ``/``, ``dir/`` as ``dir/*``."""
    out = []
    for p in patterns:
        if not isinstance(p, str) or not p:
            raise ValueError(f"{p!r} is not a glob pattern")
        slashed = p.replace("\\", "/")
        out.append(slashed + "*" if slashed.endswith("/") else slashed)
    return tuple(out)


def _is_consolidated(path: str) -> bool:
    return fnmatchcase(path.rsplit("/", 1)[-1], "consolidated*.safetensors")


def one_format(paths: list[str]) -> list[str]:
    """``paths`` without a second copy of the same weights (see ``Selection``)."""
    safetensors = [p for p in paths if p.endswith(".safetensors")]
    if not safetensors:
        return paths
    kept = [p for p in paths if not (p.endswith(".bin") or p.endswith(".bin.index.json"))]
    if any(not _is_consolidated(p) for p in safetensors):
        kept = [p for p in kept if not _is_consolidated(p)]
    return kept


def weight_format(paths: Iterable[str]) -> WeightFormat:
    """What the selected weights are: what an engine will be given to load."""
    paths = list(paths)
    if any(p.endswith(".safetensors") for p in paths):
        return WeightFormat.safetensors
    if any(p.endswith(".bin") for p in paths):
        return WeightFormat.pytorch
    return WeightFormat.none


# --- the snapshot ------------------------------------------------------------------------


class Digest(StrEnum):
    sha256 = "sha256"  # an LFS file: the Hub's lfs.oid, the content's sha256
    git_sha1 = "git-sha1"  # a git file: its blob id, sha1 over "blob <size>\0" + content


def git_blob_header(size: int) -> bytes:
    """What git hashes before a file's bytes to make its blob id."""
    return b"blob %d\0" % size


@dataclass(frozen=True)
class SnapshotFile:
    path: str
    size: int
    digest: str  # hex, lowercase
    algorithm: Digest

    def __post_init__(self) -> None:
        check_repo_path(self.path)
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 0:
            raise ValueError(f"{self.path!r}: size {self.size!r} is not a byte count")
        shape = SHA256 if self.algorithm is Digest.sha256 else COMMIT
        if not isinstance(self.digest, str) or not shape.fullmatch(self.digest):
            raise ValueError(f"{self.path!r}: {self.digest!r} is not a {self.algorithm}")


@dataclass(frozen=True)
class Snapshot:
    """The files of one repo at one commit that a node is to hold."""

    repo: str
    commit: str
    files: tuple[SnapshotFile, ...]
    revision: str = DEFAULT_REVISION  # what was asked for; ``commit`` is what it was then

    def __post_init__(self) -> None:
        check_repo_id(self.repo)
        if not COMMIT.fullmatch(self.commit):
            raise ValueError(f"{self.commit!r} is not a 40-hex commit")
        check_repo_paths(f.path for f in self.files)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def weight_format(self) -> WeightFormat:
        return weight_format(f.path for f in self.files)


def repo_folder_name(repo: str) -> str:
    """``<org>--<name>``: the folder of one repo in a weights folder's ``hf/``."""
    org, name = check_repo_id(repo).split("/")
    return f"{org}--{name}"


def snapshot_name(repo: str, commit: str) -> str:
    """``hf/<org>--<name>/<commit>``: a snapshot's path inside a weights folder (what the
    probe lists it as)."""
    if not COMMIT.fullmatch(commit):
        raise ValueError(f"{commit!r} is not a 40-hex commit")
    return f"{HF_FOLDER}/{repo_folder_name(repo)}/{commit}"


def repo_folder(weights: str, repo: str) -> str:
    """``W/hf/<org>--<name>``: every commit of one repo lives in it."""
    if not weights.startswith("/"):
        raise ValueError(f"{weights!r}: a weights folder is an absolute path")
    return f"{weights.rstrip('/')}/{HF_FOLDER}/{repo_folder_name(repo)}"


def snapshot_folder(weights: str, repo: str, commit: str) -> str:
    """``W/hf/<org>--<name>/<commit>``: what the engine is given."""
    if not COMMIT.fullmatch(commit):
        raise ValueError(f"{commit!r} is not a 40-hex commit")
    return f"{repo_folder(weights, repo)}/{commit}"


def manifest_path(weights: str, repo: str, commit: str) -> str:
    """``W/hf/<org>--<name>/<commit>.manifest.json``, beside the snapshot folder."""
    return snapshot_folder(weights, repo, commit) + MANIFEST_SUFFIX


def file_path(weights: str, snapshot: Snapshot, path: str) -> str:
    """Where one of the snapshot's files lives on the node (checked before it is joined)."""
    return f"{snapshot_folder(weights, snapshot.repo, snapshot.commit)}/{check_repo_path(path)}"


# --- the manifest ------------------------------------------------------------------------


@dataclass(frozen=True)
class ManifestFile:
    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    repo: str
    commit: str
    files: tuple[ManifestFile, ...]


def manifest_text(snapshot: Snapshot, sha256s: Mapping[str, str]) -> str:
    """The manifest of a complete snapshot: every file's path, size and sha256 (``sha256s``:
    path -> sha256 as computed while writing it; an LFS file's must be the Hub's)."""
    files = []
    for f in snapshot.files:
        sha = sha256s.get(f.path)
        if sha is None or not SHA256.fullmatch(sha):
            raise ValueError(f"{f.path!r}: no sha256 for it")
        if f.algorithm is Digest.sha256 and sha != f.digest:
            raise ValueError(f"{f.path!r}: sha256 {sha}, the Hub says {f.digest}")
        files.append({"path": f.path, "size": f.size, "sha256": sha})
    body = {"format": MANIFEST_FORMAT, "repo": snapshot.repo, "commit": snapshot.commit, "files": files}
    return json.dumps(body, indent=1, sort_keys=True) + "\n"


def parse_manifest(text: str | bytes) -> Manifest:
    """A manifest read back from a node, checked as hostile: ValueError saying what is wrong."""
    if len(text) > MAX_MANIFEST_BYTES:
        raise ValueError(f"manifest of {len(text)} bytes, at most {MAX_MANIFEST_BYTES}")
    try:
        data: Any = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"manifest is not JSON: {e}") from None
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"not a manifest of format {MANIFEST_FORMAT}")
    repo, commit, raw = data.get("repo"), data.get("commit"), data.get("files")
    if not isinstance(repo, str):
        raise ValueError("manifest: repo is not a string")
    check_repo_id(repo)
    if not isinstance(commit, str) or not COMMIT.fullmatch(commit):
        raise ValueError(f"manifest: {commit!r} is not a 40-hex commit")
    if not isinstance(raw, list):
        raise ValueError("manifest: files is not a list")
    files = []
    for entry in raw:
        if not isinstance(entry, dict):
            raise ValueError(f"manifest: {entry!r} is not a file")
        path, size, sha = entry.get("path"), entry.get("size"), entry.get("sha256")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"manifest: {path!r} has size {size!r}")
        if not isinstance(sha, str) or not SHA256.fullmatch(sha):
            raise ValueError(f"manifest: {path!r} has sha256 {sha!r}")
        files.append(ManifestFile(check_repo_path(path), size, sha))
    check_repo_paths(f.path for f in files)
    return Manifest(repo, commit, tuple(files))


@dataclass(frozen=True)
class OnDisk:
    """One file as a node found it in a snapshot folder; ``sha256`` None when not hashed."""

    size: int
    sha256: str | None = None


@dataclass(frozen=True)
class Completeness:
    missing: tuple[str, ...]
    wrong: tuple[tuple[str, str], ...]  # (path, what is wrong)
    extra: tuple[str, ...]  # on disk, not in the manifest: left alone, never used

    @property
    def complete(self) -> bool:
        return not self.missing and not self.wrong


def complete_snapshot(files_on_disk: Mapping[str, OnDisk], manifest: Manifest) -> Completeness:
    """Which of the manifest's files are missing from the folder, or there with another size
    or sha256. A file not hashed is judged by its size alone."""
    missing, wrong = [], []
    for f in manifest.files:
        found = files_on_disk.get(f.path)
        if found is None:
            missing.append(f.path)
        elif found.size != f.size:
            wrong.append((f.path, f"{found.size} bytes, the manifest says {f.size}"))
        elif found.sha256 is not None and found.sha256 != f.sha256:
            wrong.append((f.path, f"sha256 {found.sha256}, the manifest says {f.sha256}"))
    listed = {f.path for f in manifest.files}
    extra = sorted(p for p in files_on_disk if p not in listed)
    return Completeness(tuple(missing), tuple(wrong), tuple(extra))


def manifest_matches(snapshot: Snapshot, manifest: Manifest) -> list[str]:
    """Why a manifest found on a node is not the one of ``snapshot`` (empty: it is)."""
    problems = []
    if (manifest.repo, manifest.commit) != (snapshot.repo, snapshot.commit):
        problems.append(f"manifest is of {manifest.repo}@{manifest.commit}")
    have = {f.path: f for f in manifest.files}
    for f in snapshot.files:
        m = have.get(f.path)
        if m is None:
            problems.append(f"{f.path}: not in the manifest")
        elif m.size != f.size:
            problems.append(f"{f.path}: {m.size} bytes in the manifest, {f.size} on the Hub")
        elif f.algorithm is Digest.sha256 and m.sha256 != f.digest:
            problems.append(f"{f.path}: sha256 {m.sha256} in the manifest, {f.digest} on the Hub")
    return problems


# --- the node's snapshot job -----------------------------------------------------------
#
# The node program (``node/fetch_*.py``, standard library only) fills the snapshot
# folder and writes the manifest last; these build its jobs and read its answers.

SNAPSHOT_STATES = frozenset({"fetching", "verifying", "done", "error"})
"""What a snapshot job's status file says it is doing."""


def file_url(endpoint: str, repo: str, commit: str, path: str) -> str:
    """``{endpoint}/{repo}/resolve/{commit}/{path}``, the path quoted as huggingface_hub
    quotes it (``/`` kept)."""
    return f"{check_endpoint(endpoint)}/{check_repo_id(repo)}/resolve/{commit}/{quote(check_repo_path(path))}"


def snapshot_job(
    snapshot: Snapshot, weights: str, endpoint: str = DEFAULT_ENDPOINT, token: str | None = None
) -> dict[str, Any]:
    """The node program's ``snapshot`` job: every file with its size, its digest (the
    sha256 of an LFS file, else the git blob id) and its resolve URL. A token goes with
    ``token_origin``, the endpoint: the node sends it there only, never to the CDN a
    resolve redirects to. ValueError when the snapshot is larger than MAX_SNAPSHOT_BYTES."""
    endpoint = check_endpoint(endpoint)
    if snapshot.total_bytes > MAX_SNAPSHOT_BYTES:
        raise ValueError(
            f"{snapshot.repo}@{snapshot.commit}: {snapshot.total_bytes} bytes, at most {MAX_SNAPSHOT_BYTES}"
        )
    files = [
        {
            "path": f.path,
            "size": f.size,
            "sha256": f.digest if f.algorithm is Digest.sha256 else None,
            "git_sha1": f.digest if f.algorithm is Digest.git_sha1 else None,
            "url": file_url(endpoint, snapshot.repo, snapshot.commit, f.path),
        }
        for f in snapshot.files
    ]
    job: dict[str, Any] = {
        "mode": "snapshot",
        "folder": repo_folder(weights, snapshot.repo),
        "repo": snapshot.repo,
        "commit": snapshot.commit,
        "files": files,
    }
    if token:
        job |= {"token": token, "token_origin": endpoint}
    return job


def verify_snapshot_job(snapshot: Snapshot, weights: str, *, full: bool = False) -> dict[str, Any]:
    """The node program's ``verify-snapshot`` job: is the snapshot complete (its manifest
    there, every file of ``snapshot`` in place with its size; ``full``: and its digest)?"""
    job = snapshot_job(snapshot, weights)
    for f in job["files"]:
        del f["url"]
    return {**job, "mode": "verify-snapshot", "full": full}


def poll_snapshot_job(weights: str, repo: str, commit: str) -> dict[str, Any]:
    """The node program's ``poll-snapshot`` job: the status of the snapshot's job, and
    whether it still runs (holds its lock)."""
    if not COMMIT.fullmatch(commit):
        raise ValueError(f"{commit!r} is not a 40-hex commit")
    return {"mode": "poll-snapshot", "folder": repo_folder(weights, repo), "repo": repo, "commit": commit}


def peer_snapshot_job(snapshot: Snapshot, weights: str, prefix: str) -> dict[str, Any]:
    """The ``snapshot`` job that copies from a peer's ``serve-snapshot`` at ``prefix``
    (``http://<peer>:<port>/<secret>/``): each file's URL is the prefix and its quoted
    path, no token, and ``peer`` set (a 503 there means "not yet", not a failure)."""
    job = snapshot_job(snapshot, weights)
    for f in job["files"]:
        f["url"] = prefix + quote(f["path"])
    return {**job, "peer": True}


def serve_snapshot_job(
    weights: str,
    repo: str,
    commit: str,
    secret: str,
    idle: float,
    *,
    bind: str,
    foreground: bool = False,
) -> dict[str, Any]:
    """The node program's ``serve-snapshot`` job: the snapshot's files to peers at
    ``/<secret>/<quoted path>``, until ``idle`` seconds without a request, listening on
    ``bind`` only: the address peers reach the node at (``Node.engine_host``), which their
    URLs name; the node refuses every interface."""
    if not COMMIT.fullmatch(commit):
        raise ValueError(f"{commit!r} is not a 40-hex commit")
    job: dict[str, Any] = {
        "mode": "serve-snapshot",
        "folder": repo_folder(weights, repo),
        "repo": repo,
        "commit": commit,
        "secret": secret,
        "idle": idle,
        "bind": bind,
    }
    return {**job, "foreground": True} if foreground else job


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _text(value: object, limit: int = 2000) -> str:
    """A string from a node's answer, printable and bounded; anything else is ''."""
    if not isinstance(value, str):
        return ""
    return "".join(c if c.isprintable() else "?" for c in value[:limit])


@dataclass(frozen=True)
class SnapshotProgress:
    """A snapshot job's status file, read back as hostile data: a state outside
    SNAPSHOT_STATES is ``unknown``, a count that is not one is 0, and done never exceeds
    total."""

    state: str
    files_done: int = 0
    files_total: int = 0
    bytes_done: int = 0
    bytes_total: int = 0
    current: str = ""
    kind: str = ""
    message: str = ""

    @property
    def finished(self) -> bool:
        return self.state in {"done", "error"}


def parse_snapshot_status(data: object) -> SnapshotProgress:
    """The status a ``poll-snapshot`` answer holds (``{}`` when none was written yet:
    state ``unknown``)."""
    if not isinstance(data, dict):
        return SnapshotProgress("unknown")
    state = data.get("state")
    files_total, bytes_total = _count(data.get("files_total")), _count(data.get("bytes_total"))
    return SnapshotProgress(
        state=state if isinstance(state, str) and state in SNAPSHOT_STATES else "unknown",
        files_done=min(_count(data.get("files_done")), files_total),
        files_total=files_total,
        bytes_done=min(_count(data.get("bytes_done")), bytes_total),
        bytes_total=bytes_total,
        current=_text(data.get("current"), MAX_PATH_CHARS),
        kind=_text(data.get("kind"), 40),
        message=_text(data.get("message")),
    )


@dataclass(frozen=True)
class SnapshotCheck:
    """A ``verify-snapshot`` answer, read as hostile data. ``state``: complete, incomplete,
    absent, or error (``message`` says why)."""

    state: str
    manifest: bool = False
    missing: tuple[str, ...] = ()
    missing_count: int = 0
    wrong: tuple[tuple[str, str], ...] = ()
    wrong_count: int = 0
    message: str = ""

    @property
    def complete(self) -> bool:
        return self.state == "complete"


def parse_snapshot_check(data: object) -> SnapshotCheck:
    if not isinstance(data, dict):
        return SnapshotCheck("error", message="the node's answer is not an object")
    state = data.get("state")
    if state == "error" or state not in {"complete", "incomplete", "absent"}:
        return SnapshotCheck("error", message=_text(data.get("message")) or f"state {_text(state, 40)!r}")
    raw_missing, raw_wrong = data.get("missing"), data.get("wrong")
    raw_missing = raw_missing if isinstance(raw_missing, list) else []
    raw_wrong = raw_wrong if isinstance(raw_wrong, list) else []
    missing = tuple(_text(p, MAX_PATH_CHARS) for p in raw_missing[:100])
    wrong = tuple(
        (_text(w[0], MAX_PATH_CHARS), _text(w[1]))
        for w in raw_wrong[:100]
        if isinstance(w, list) and len(w) == 2
    )
    manifest = data.get("manifest") is True
    if state == "complete" and (not manifest or missing or wrong):
        state = "incomplete"  # an answer that contradicts itself is not believed
    return SnapshotCheck(
        state=str(state),
        manifest=manifest,
        missing=missing,
        missing_count=max(_count(data.get("missing_count")), len(missing)),
        wrong=wrong,
        wrong_count=max(_count(data.get("wrong_count")), len(wrong)),
        message=_text(data.get("why")),
    )
