"""The node fetcher's snapshots: a whole Hugging Face repository at one commit, checked
path by path, filled through the single-file download, its manifest written last; modes
``snapshot``, ``verify-snapshot`` and ``poll-snapshot``.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import stat
import time
import traceback
from typing import Any
from urllib.parse import urlsplit

from llmgw_cli.node.fetch_disk import (
    STATUS_EVERY,
    STATUS_SIZE,
    TRUSTED_OWNERS,
    JobFailed,
    Unsafe,
    _detach,
    _emit,
    _error,
    _hash_file,
    _identity,
    _lstat,
    _open_checked,
    _read_json,
    _settled,
    _stat_or_make,
    _unlink,
    _write_json,
    open_file,
    open_folder,
    side_files,
)
from llmgw_cli.node.fetch_http import Download
from llmgw_cli.node.repo_path import repo_path_problem

# --- snapshot: a whole repository at one commit ---------------------------------------

SNAPSHOT_MAX_FILES = 100_000
"""Most files a snapshot job may name (``MAX_FILES`` of the control host's snapshot rules)."""
SNAPSHOT_MAX_BYTES = 1 << 42
"""Most bytes a snapshot job may name, 4 TiB (``MAX_SNAPSHOT_BYTES`` there)."""
SNAPSHOT_MAX_MANIFEST_BYTES = 64 << 20
LISTED_AT_MOST = 100
"""Names of missing or wrong files an answer lists (their counts are always given)."""
_REPO_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
_REPO_ID = re.compile(rf"{_REPO_PART}/{_REPO_PART}")
_HEX40 = re.compile(r"[0-9a-f]{40}")
_HEX64 = re.compile(r"[0-9a-f]{64}")


def check_snapshot_path(path: object) -> str:
    """``path`` if it may name a file inside a snapshot folder, else Unsafe with why
    (``repo_path_problem``)."""
    why = repo_path_problem(path)
    if why is not None:
        raise Unsafe(why)
    return str(path)


def _count_of(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise JobFailed("job", f"{what}: {value!r} is not a byte count")
    return value


def _snapshot_files(raw: object, *, urls: bool) -> list[dict[str, Any]]:
    """The job's files, each checked: path, size, sha256 or git_sha1 (one at least), url."""
    if not isinstance(raw, list):
        raise JobFailed("job", "files is not a list")
    if len(raw) > SNAPSHOT_MAX_FILES:
        raise JobFailed("job", f"{len(raw)} files, at most {SNAPSHOT_MAX_FILES}")
    files = [_snapshot_file(entry, urls=urls) for entry in raw]
    seen: set[str] = set()
    folders: set[str] = set()
    for f in files:
        if f["path"] in seen:
            raise Unsafe(f"{f['path']!r}: listed twice")
        seen.add(f["path"])
        parts = f["path"].split("/")
        folders.update("/".join(parts[:i]) for i in range(1, len(parts)))
    total = sum(f["size"] for f in files)
    if total > SNAPSHOT_MAX_BYTES:
        raise JobFailed("job", f"{total} bytes, at most {SNAPSHOT_MAX_BYTES}")
    if clashes := sorted(seen & folders):
        raise Unsafe(f"{clashes[0]!r}: listed both as a file and as a folder")
    return files


def _snapshot_file(entry: object, *, urls: bool) -> dict[str, Any]:
    if not isinstance(entry, dict):
        raise JobFailed("job", f"{entry!r} is not a file")
    path = check_snapshot_path(entry.get("path"))
    size = _count_of(entry.get("size"), path)
    sha256, git_sha1, url = entry.get("sha256"), entry.get("git_sha1"), entry.get("url")
    if sha256 is not None and not (isinstance(sha256, str) and _HEX64.fullmatch(sha256)):
        raise JobFailed("job", f"{path!r}: {sha256!r} is not a sha256")
    if git_sha1 is not None and not (isinstance(git_sha1, str) and _HEX40.fullmatch(git_sha1)):
        raise JobFailed("job", f"{path!r}: {git_sha1!r} is not a git blob id")
    if sha256 is None and git_sha1 is None and urls:
        raise JobFailed("job", f"{path!r}: neither a sha256 nor a git blob id to check it against")
    if urls and not (isinstance(url, str) and urlsplit(url).scheme in ("https", "http")):
        raise JobFailed("job", f"{path!r}: {url!r} is not an http(s) URL")
    return {"path": path, "size": size, "sha256": sha256, "git_sha1": git_sha1, "url": url}


def _snapshot_where(config: dict[str, Any]) -> tuple[str, str, str]:
    """The job's repo folder, repo id and commit, checked against one another: the folder is
    ``<weights>/hf/<org>--<name>`` of the repo it names."""
    folder, repo, commit = config.get("folder"), config.get("repo"), config.get("commit")
    if not isinstance(repo, str) or not _REPO_ID.fullmatch(repo) or "--" in repo or ".." in repo:
        raise JobFailed("job", f"{repo!r} is not a repo id")
    if not isinstance(commit, str) or not _HEX40.fullmatch(commit):
        raise JobFailed("job", f"{commit!r} is not a 40-hex commit")
    expected = "/hf/" + repo.replace("/", "--")
    if not isinstance(folder, str) or not folder.startswith("/") or not folder.endswith(expected):
        raise JobFailed("job", f"{folder!r} is not an absolute <weights>{expected} folder")
    if any(p in (".", "..") for p in folder.split("/")):
        raise JobFailed("job", f"{folder!r} has a '.' or '..' component")
    return folder, repo, commit


def snapshot_names(commit: str) -> dict[str, str]:
    """What a snapshot of ``commit`` is made of, in its repo folder: the snapshot folder,
    the manifest written last, and hidden bookkeeping (status, lock, a work folder for
    partial files and checks), kept out of the snapshot folder, which holds only the
    repository's names."""
    return {
        "snapshot": commit,
        "manifest": commit + ".manifest.json",
        "status": f".{commit}.snapshot-status",
        "lock": f".{commit}.snapshot-lock",
        "work": f".{commit}.snapshot-work",
    }


def _enter(fd: int, name: str, where: str, *, create: bool) -> int:
    """A descriptor of the folder ``name`` in ``fd``, never reached through a symbolic link
    (whoever owns it: a snapshot's folders are the fetcher's own), checked like the folders
    on the way to the weights folder."""
    st = _stat_or_make(fd, name, create=create)
    if stat.S_ISLNK(st.st_mode):
        raise Unsafe(
            f"{where} is a symbolic link: the fetcher (root) never reaches a snapshot's folders "
            "through one; remove it (and find out who planted it)"
        )
    return _open_checked(fd, name, st, where)


def _parent(root: int, shown: str, path: str, *, create: bool) -> int:
    """A descriptor of the folder holding ``path`` (checked) inside ``root``, entered one
    component at a time with ``_enter``; the caller closes it."""
    fd = os.dup(root)
    try:
        for name in path.split("/")[:-1]:
            shown = f"{shown}/{name}"
            sub = _enter(fd, name, shown, create=create)
            os.close(fd)
            fd = sub
    except BaseException:
        os.close(fd)
        raise
    return fd


def _file_state(folder: int, name: str, where: str) -> os.stat_result | None:
    """A snapshot file's stat, None when absent; Unsafe for a link, something that is not a
    regular file, or a hard-linked file another account owns (as ``inspect`` a target)."""
    st = _lstat(folder, name)
    if st is None:
        return None
    if stat.S_ISLNK(st.st_mode):
        raise Unsafe(
            f"{where} is a symbolic link: the fetcher (root) never writes or reads through one; "
            "remove it (and find out who planted it)"
        )
    if not stat.S_ISREG(st.st_mode):
        raise Unsafe(f"{where} is not a regular file; remove it")
    if st.st_nlink != 1 and st.st_uid not in TRUSTED_OWNERS:
        raise Unsafe(f"{where} has {st.st_nlink} hard links and belongs to uid {st.st_uid}; remove it")
    return st


def _read_manifest(folder: int, name: str, where: str, repo: str, commit: str) -> dict[str, tuple[int, str]]:
    """The manifest's files (path -> (size, sha256)), read as hostile: Unsafe when it is not
    the fetcher's own file, JobFailed("manifest") when it is not a manifest of this commit.
    FileNotFoundError when there is none."""
    fd = open_file(folder, name, os.O_RDONLY, where)
    try:
        with os.fdopen(fd, "rb") as f:
            text = f.read(SNAPSHOT_MAX_MANIFEST_BYTES + 1)
    except OSError as exc:
        raise JobFailed("manifest", f"cannot read {where}: {exc}") from None
    if len(text) > SNAPSHOT_MAX_MANIFEST_BYTES:
        raise JobFailed("manifest", f"{where} is larger than {SNAPSHOT_MAX_MANIFEST_BYTES} bytes")
    try:
        data = json.loads(text)
    except ValueError:
        raise JobFailed("manifest", f"{where} is not JSON") from None
    if not isinstance(data, dict) or data.get("format") != 1:
        raise JobFailed("manifest", f"{where} is not a manifest of format 1")
    if data.get("repo") != repo or data.get("commit") != commit:
        raise JobFailed("manifest", f"{where} is of {data.get('repo')!r}@{data.get('commit')!r}")
    raw = data.get("files")
    if not isinstance(raw, list):
        raise JobFailed("manifest", f"{where}: files is not a list")
    listed: dict[str, tuple[int, str]] = {}
    for entry in raw:
        if not isinstance(entry, dict):
            raise JobFailed("manifest", f"{where}: {entry!r} is not a file")
        path, size, sha = entry.get("path"), entry.get("size"), entry.get("sha256")
        try:
            path = check_snapshot_path(path)
            size = _count_of(size, path)
        except JobFailed as exc:
            raise JobFailed("manifest", f"{where}: {exc}") from None
        if not isinstance(sha, str) or not _HEX64.fullmatch(sha) or path in listed:
            raise JobFailed("manifest", f"{where}: {path!r} has sha256 {sha!r} or is listed twice")
        listed[path] = (size, sha)
    return listed


def _wanted(
    listed: dict[str, tuple[int, str]] | None, expected: list[dict[str, Any]] | None, wrong: list[list[str]]
) -> dict[str, tuple[int, str | None, str | None]]:
    """path -> (size, sha256, git blob id) of every file to look at: the manifest's and the
    expected ones; an expected file the manifest lacks or lists otherwise goes to ``wrong``."""
    wanted: dict[str, tuple[int, str | None, str | None]] = {}
    if listed is not None:
        wanted = {p: (size, sha, None) for p, (size, sha) in listed.items()}
    for f in expected or []:
        m = wanted.get(f["path"])
        if listed is not None and m is None:
            wrong.append([f["path"], "not in the manifest"])
        elif m is not None and (m[0] != f["size"] or (f["sha256"] and m[1] != f["sha256"])):
            wrong.append([f["path"], f"the manifest says {m[0]} bytes, sha256 {m[1]}: not the file expected"])
        wanted[f["path"]] = (f["size"], f["sha256"] or (m[1] if m else None), f["git_sha1"])
    return wanted


def _snapshot_key(path: str) -> str:
    """A snapshot file's name in the job's work folder (its partial download, its marker)."""
    return hashlib.sha256(path.encode("utf-8")).hexdigest()[:40]


def _checked_identity(work: int, path: str) -> list[int] | None:
    """The identity (device, inode, size, mtime, ctime) the file at ``path`` had when the
    snapshot's job last checked its digest; None when it has no marker."""
    if work < 0:
        return None
    marker = os.path.basename(side_files(_snapshot_key(path))["verified"])
    identity = _read_json(work, marker).get("identity")
    return identity if isinstance(identity, list) else None


def _open_work(folder: int, shown: str, name: str) -> int:
    """The snapshot's work folder (its markers), or -1 when there is none to trust."""
    try:
        return _enter(folder, name, f"{shown}/{name}", create=False)
    except (FileNotFoundError, JobFailed):
        return -1


def _check_snapshot(
    folder: int, shown: str, repo: str, commit: str, expected: list[dict[str, Any]] | None, *, full: bool
) -> dict[str, Any]:
    """Whether the snapshot of ``commit`` is complete: its manifest is there and every file
    it lists (and, given ``expected``, every file expected, with that size and digest) is
    in place with its size (``full``: and its sha256). Never writes."""
    names = snapshot_names(commit)
    missing: list[str] = []
    wrong: list[list[str]] = []
    listed: dict[str, tuple[int, str]] | None
    try:
        listed = _read_manifest(folder, names["manifest"], f"{shown}/{names['manifest']}", repo, commit)
    except FileNotFoundError:
        listed = None
    except JobFailed as exc:
        listed = None
        wrong.append([names["manifest"], str(exc)])
    wanted = _wanted(listed, expected, wrong)
    snap_shown = f"{shown}/{names['snapshot']}"
    try:
        root = _enter(folder, names["snapshot"], snap_shown, create=False)
    except FileNotFoundError:
        root = -1
    except JobFailed as exc:
        root = -1
        wrong.append([names["snapshot"], str(exc)])
    # quick: in place with its size, and unchanged since its digest was checked
    work = _open_work(folder, shown, names["work"]) if not full and root >= 0 else -1
    try:
        for path, (size, sha, git) in wanted.items():
            if root < 0:
                missing.append(path)
                continue
            checked = None if full else _checked_identity(work, path)
            problem = _check_file(
                root, snap_shown, path, size, digests=(sha, git), full=full, checked=checked
            )
            if problem == "missing":
                missing.append(path)
            elif problem:
                wrong.append([path, problem])
    finally:
        if root >= 0:
            os.close(root)
        if work >= 0:
            os.close(work)
    if listed is None and root < 0 and not wrong:
        state = "absent"
    elif listed is not None and not missing and not wrong:
        state = "complete"
    else:
        state = "incomplete"
    answer: dict[str, Any] = {
        "state": state,
        "manifest": listed is not None,
        "files": len(wanted),
        "bytes": sum(size for size, _, _ in wanted.values()),
        "missing_count": len(missing),
        "missing": missing[:LISTED_AT_MOST],
        "wrong_count": len(wrong),
        "wrong": wrong[:LISTED_AT_MOST],
    }
    if listed is None and state == "incomplete":
        answer["why"] = f"no manifest {names['manifest']}: the snapshot was never completed"
    return answer


def _check_file(
    root: int,
    shown: str,
    path: str,
    size: int,
    *,
    digests: tuple[str | None, str | None],
    full: bool,
    checked: list[int] | None = None,
) -> str:
    """ "" when the file is in place with ``size`` (``full``: and its sha256, else its git
    blob id; not ``full``: and the identity it had when it was ``checked``), "missing", or
    what is wrong with it. A file changed in place since its digest was checked keeps its
    size: only its identity (inode, mtime, ctime) tells, and then it is checked again."""
    sha, git = digests
    where = f"{shown}/{path}"
    try:
        parent = _parent(root, shown, path, create=False)
    except FileNotFoundError:
        return "missing"
    except JobFailed as exc:
        return str(exc)
    try:
        st = _file_state(parent, path.rsplit("/", 1)[-1], where)
        if st is None:
            return "missing"
        if st.st_size != size:
            return f"{st.st_size} bytes, expected {size}"
        if not full:
            return "" if checked == _identity(st) else "not checked since it last changed"
        fd = open_file(parent, path.rsplit("/", 1)[-1], os.O_RDONLY, where, strict=False)
        try:
            hashes = _hash_file(fd, size if git and not sha else None)
        finally:
            os.close(fd)
        if sha and hashes.hexdigest() != sha:
            return f"sha256 {hashes.hexdigest()}, expected {sha}"
        if git and not sha and hashes.git_sha1() != git:
            return f"git blob id {hashes.git_sha1()}, expected {git}"
        return ""
    except JobFailed as exc:
        return str(exc)
    finally:
        os.close(parent)


class _Status:
    """A job's status file, rewritten in place (as ``Download`` does its own)."""

    def __init__(self, fd: int, status: dict[str, Any]) -> None:
        self.fd, self.status = fd, status
        self._last = 0.0

    def report(self, force: bool = False, **changes: Any) -> None:
        self.status.update(changes)
        now = time.monotonic()
        if force or now - self._last >= STATUS_EVERY:
            self._last = now
            text = json.dumps(self.status).encode()
            text += b" " * (STATUS_SIZE - len(text)) if len(text) < STATUS_SIZE else b""
            os.pwrite(self.fd, text, 0)
            os.ftruncate(self.fd, len(text))


class _FileDownload(Download):
    """One file of a snapshot: its progress goes to the snapshot's status."""

    def __init__(self, config: dict[str, Any], folder: int, work: int, work_path: str, progress: Any) -> None:
        super().__init__(config, folder, work, work_path)
        self._progress = progress

    def _write_status(self) -> None:
        self._progress(self.status)


class SnapshotJob:
    """The detached job that fills ``<folder>/<commit>/`` and writes the manifest last."""

    def __init__(
        self, config: dict[str, Any], folder: int, where: tuple[str, str, str], files: list[dict[str, Any]]
    ) -> None:
        self.config, self.folder, self.files = config, folder, files
        self.shown, self.repo, self.commit = where
        self.names = snapshot_names(self.commit)
        self.snap_shown = f"{self.shown}/{self.names['snapshot']}"
        self.work_shown = f"{self.shown}/{self.names['work']}"
        self.status: _Status | None = None
        self.done_bytes = 0

    def report(self, force: bool = False, **changes: Any) -> None:
        if self.status is not None:
            self.status.report(force, **changes)

    def run(self) -> None:
        # Whatever manifest was there no longer says what the folder holds.
        _unlink(self.folder, self.names["manifest"])
        root = _enter(self.folder, self.names["snapshot"], self.snap_shown, create=True)
        work = -1
        try:
            work = _enter(self.folder, self.names["work"], self.work_shown, create=True)
            self._run_in(root, work)
        finally:
            os.close(root)
            if work >= 0:
                os.close(work)

    def _run_in(self, root: int, work: int) -> None:
        sha256s: dict[str, str] = {}
        identities: dict[str, list[int]] = {}
        for index, f in enumerate(self.files):
            path = f["path"]
            self.report(True, state="fetching", current=path, files_done=index, bytes_done=self.done_bytes)
            parent = _parent(root, self.snap_shown, path, create=True)
            try:
                sha256s[path], identities[path] = self._one(parent, work, f)
            except JobFailed as exc:
                raise JobFailed(exc.kind, f"{path}: {exc}") from None
            finally:
                os.close(parent)
            self.done_bytes += f["size"]
        self.report(
            True, state="verifying", current=None, files_done=len(self.files), bytes_done=self.done_bytes
        )
        for f in self.files:  # a last look: nothing replaced since it was checked
            parent = _parent(root, self.snap_shown, f["path"], create=False)
            try:
                name = f["path"].rsplit("/", 1)[-1]
                st = _file_state(parent, name, f"{self.snap_shown}/{f['path']}")
            finally:
                os.close(parent)
            if st is None or _identity(st) != identities[f["path"]]:
                raise JobFailed("changed", f"{f['path']} changed after it was checked; fetch again")
        self._write_manifest(sha256s)
        self.report(True, state="done", current=None, finished=time.time())

    def _progress(self, path: str, base: int, st: dict[str, Any]) -> None:
        """A file's download status, in the snapshot's: its bytes, and at once when it
        starts or stops waiting for a peer or retrying."""
        changes = {
            "bytes_done": base + _nonneg(st.get("bytes")),
            "retrying": st.get("retrying"),
            "waiting": f"{path} on the peer" if st.get("waiting") else None,
        }
        seen = self.status.status if self.status is not None else {}
        self.report(any(seen.get(k) != changes[k] for k in ("retrying", "waiting")), **changes)

    def _key(self, path: str) -> str:
        return _snapshot_key(path)

    def _one(self, parent: int, work: int, f: dict[str, Any]) -> tuple[str, list[int]]:
        """The file in place and checked: its sha256 and the identity it was checked with."""
        path, name = f["path"], f["path"].rsplit("/", 1)[-1]
        where = f"{self.snap_shown}/{path}"
        key = self._key(path)
        marker = os.path.basename(side_files(key)["verified"])
        kept = self._reuse(parent, work, f, name=name, where=where, marker=marker)
        if kept is not None:
            return kept
        config = {
            "url": f["url"],
            "target": where,
            "sha256": f["sha256"],
            "git_sha1": f["git_sha1"],
            "size": f["size"],
            "token": self.config.get("token"),
            "token_origin": self.config.get("token_origin"),
            "peer": bool(self.config.get("peer")),
        }
        if config["peer"] or not config["token_origin"]:
            # A snapshot's token goes to the origin it was given for, or nowhere; never to a
            # peer, whose secret is in its URLs.
            config["token"] = None
        base = self.done_bytes
        job = _FileDownload(
            config, parent, work, f"{self.work_shown}/{key}", lambda st: self._progress(path, base, st)
        )
        job.run()
        st = _file_state(parent, name, where)
        if st is None or st.st_size != f["size"]:
            raise JobFailed("size", f"{where} is not in place after its download")
        digest = job.digests["sha256"]
        if _settled(st):
            _write_json(work, marker, {"identity": _identity(st), **job.digests})
        return digest, _identity(st)

    def _reuse(
        self, parent: int, work: int, f: dict[str, Any], *, name: str, where: str, marker: str
    ) -> tuple[str, list[int]] | None:
        """An existing file that matches (remembered, else hashed now): its sha256 and
        identity; None when it has to be downloaded."""
        st = _file_state(parent, name, where)
        if st is None or st.st_size != f["size"] or st.st_uid not in TRUSTED_OWNERS:
            return None  # another account's file could change once checked: replaced by a download
        seen = _read_json(work, marker)
        if seen.get("identity") == _identity(st) and self._matches(
            seen.get("sha256"), seen.get("git-sha1"), f
        ):
            return str(seen["sha256"]), _identity(st)
        self.report(True, state="verifying", current=f["path"])
        fd = open_file(parent, name, os.O_RDONLY, where, strict=False)
        try:
            base = self.done_bytes
            hashes = _hash_file(fd, f["size"], lambda done: self.report(bytes_done=base + done))
            now = os.fstat(fd)
        finally:
            os.close(fd)
        if _identity(now) != _identity(st) or not self._matches(hashes.hexdigest(), hashes.git_sha1(), f):
            return None  # downloaded again, and replaced only by a verified copy
        if _settled(now):
            _write_json(
                work,
                marker,
                {"identity": _identity(now), "sha256": hashes.hexdigest(), "git-sha1": hashes.git_sha1()},
            )
        return hashes.hexdigest(), _identity(now)

    @staticmethod
    def _matches(sha256: object, git_sha1: object, f: dict[str, Any]) -> bool:
        if not isinstance(sha256, str) or not _HEX64.fullmatch(sha256):
            return False
        if f["sha256"]:
            return bool(sha256 == f["sha256"])
        return bool(git_sha1 == f["git_sha1"])

    def _write_manifest(self, sha256s: dict[str, str]) -> None:
        """``<commit>.manifest.json``, atomically and durably: a temporary file, synced, then
        renamed over the name, the folder synced."""
        files = [{"path": f["path"], "size": f["size"], "sha256": sha256s[f["path"]]} for f in self.files]
        body = {"format": 1, "repo": self.repo, "commit": self.commit, "files": files}
        text = (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()
        tmp = f".{self.names['manifest']}.{os.getpid()}.tmp"
        _unlink(self.folder, tmp)
        fd = open_file(self.folder, tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, f"{self.shown}/{tmp}")
        try:
            view = memoryview(text)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.names["manifest"], src_dir_fd=self.folder, dst_dir_fd=self.folder)
        os.fsync(self.folder)


def _nonneg(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def snapshot(config: dict[str, Any]) -> None:
    """Start (detached) the job that brings a whole repository at one commit into
    ``<folder>/<commit>/`` and writes ``<commit>.manifest.json`` last. Prints ``present``
    (the manifest is there and every file in place with its size), ``attached`` (another
    job of this snapshot runs: poll it), ``started``, or an error."""
    try:
        where = _snapshot_where(config)
        files = _snapshot_files(config.get("files"), urls=True)
        folder = open_folder(where[0], create=True)
    except (JobFailed, OSError) as exc:
        _snapshot_refused(exc, f"cannot open {config.get('folder')}")
        return
    try:
        _snapshot_in(folder, config, where, files)
    finally:
        os.close(folder)


def _snapshot_in(
    folder: int, config: dict[str, Any], where: tuple[str, str, str], files: list[dict[str, Any]]
) -> None:
    lock = _snapshot_lock(folder, where, files)
    if lock is None:
        return
    try:
        job = _snapshot_job(folder, config, where, files)
    except (JobFailed, OSError) as exc:
        os.close(lock)
        _snapshot_refused(exc, f"cannot prepare the snapshot in {where[0]}")
        return
    if job is None:
        os.close(lock)
        return
    foreground = bool(config.get("foreground"))
    if not foreground and not _detach():
        os.close(lock)
        _emit({"state": "started"})
        return
    job.report(True, pid=os.getpid())
    try:
        job.run()
    except JobFailed as exc:
        job.report(True, state="error", kind=exc.kind, message=str(exc), current=None, finished=time.time())
    except OSError as exc:
        kind = "disk-full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "node"
        job.report(True, state="error", kind=kind, message=str(exc), current=None, finished=time.time())
    except BaseException as exc:  # a bug: say so in the status instead of dying silently
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        job.report(True, state="error", kind="crash", message=last, finished=time.time())
    finally:
        os.close(lock)  # the status says done or error before the lock is free
    if not foreground:
        os._exit(0)


def _snapshot_refused(exc: Exception, doing: str) -> None:
    """Print a snapshot job's refusal: a JobFailed with its own kind, any other error as
    kind ``node``, saying what could not be done."""
    if isinstance(exc, JobFailed):
        _error(exc.kind, str(exc))
    else:
        _error("node", f"{doing}: {exc}")


def _snapshot_present(answer: dict[str, Any]) -> bool:
    if answer["state"] != "complete":
        return False
    _emit({"state": "present", "files": answer["files"], "bytes": answer["bytes"]})
    return True


def _snapshot_lock(folder: int, where: tuple[str, str, str], files: list[dict[str, Any]]) -> int | None:
    """The snapshot's lock, held; None once the answer (present, attached, error) is printed."""
    shown, repo, commit = where
    names = snapshot_names(commit)
    try:
        for key in ("status", "lock", "manifest"):
            _file_state(folder, names[key], f"{shown}/{names[key]}")
        if _snapshot_present(_check_snapshot(folder, shown, repo, commit, files, full=False)):
            return None
        lock = open_file(
            folder, names["lock"], os.O_RDWR | os.O_CREAT, f"{shown}/{names['lock']}", mode=0o600
        )
    except (JobFailed, OSError) as exc:
        _snapshot_refused(exc, f"cannot prepare the snapshot in {shown}")
        return None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock)
        _emit({"state": "attached"})  # another job fetches this snapshot: follow its status
        return None
    return lock


def _snapshot_job(
    folder: int, config: dict[str, Any], where: tuple[str, str, str], files: list[dict[str, Any]]
) -> SnapshotJob | None:
    """The job, its status written; None once ``present`` is printed (done meanwhile)."""
    shown, repo, commit = where
    names = snapshot_names(commit)
    if _snapshot_present(_check_snapshot(folder, shown, repo, commit, files, full=False)):
        return None
    job = SnapshotJob(config, folder, where, files)
    status_fd = open_file(folder, names["status"], os.O_WRONLY | os.O_CREAT, f"{shown}/{names['status']}")
    job.status = _Status(
        status_fd,
        {
            "state": "fetching",
            "pid": os.getpid(),
            "repo": repo,
            "commit": commit,
            "files_done": 0,
            "files_total": len(files),
            "bytes_done": 0,
            "bytes_total": sum(f["size"] for f in files),
            "current": None,
            "started": time.time(),
        },
    )
    job.report(True)  # the first poll must not see an older run's status
    return job


def verify_snapshot(config: dict[str, Any]) -> None:
    """Print whether the snapshot of ``commit`` in ``folder`` is complete: ``complete``
    (its manifest is there and every file listed, and every file of ``files`` when given,
    has its size; with ``full``, its sha256 too), ``incomplete`` (with the missing and
    wrong files named), ``absent`` (neither folder nor manifest), or an error."""
    try:
        shown, repo, commit = _snapshot_where(config)
        files = _snapshot_files(config["files"], urls=False) if config.get("files") is not None else None
        folder = open_folder(shown, create=False)
    except FileNotFoundError:
        _emit(
            {
                "state": "absent",
                "manifest": False,
                "files": 0,
                "bytes": 0,
                "missing_count": 0,
                "missing": [],
                "wrong_count": 0,
                "wrong": [],
            }
        )
        return
    except (JobFailed, OSError) as exc:
        _snapshot_refused(exc, f"cannot open {config.get('folder')}")
        return
    try:
        _emit(_check_snapshot(folder, shown, repo, commit, files, full=bool(config.get("full"))))
    except JobFailed as exc:
        _error(exc.kind, str(exc))
    except OSError as exc:
        _error("node", f"cannot verify the snapshot in {shown}: {exc}")
    finally:
        os.close(folder)


def poll_snapshot(config: dict[str, Any]) -> None:
    """Print ``{"free": <nobody holds the snapshot's lock>, "status": <its status or {}>}``."""
    answer: dict[str, Any] = {"free": True, "status": {}}
    try:
        shown, _, commit = _snapshot_where(config)
        folder = open_folder(shown, create=False)
    except (JobFailed, OSError) as exc:
        _emit({**answer, "error": str(exc)})
        return
    try:
        answer["free"] = not _snapshot_running(folder, shown, commit)
        answer["status"] = _read_json(folder, snapshot_names(commit)["status"])
    except (JobFailed, OSError) as exc:
        answer["error"] = str(exc)
    finally:
        os.close(folder)
    _emit(answer)


def _snapshot_running(folder: int, shown: str, commit: str) -> bool:
    """Whether a job of this snapshot runs on this node: the lock in its repo folder
    ``folder`` (opened without following a link) is held. Raises Unsafe or OSError."""
    name = snapshot_names(commit)["lock"]
    try:
        lock = open_file(folder, name, os.O_RDONLY, f"{shown}/{name}")
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(lock)  # a lock taken here is let go at once
    return False


# --- serve ----------------------------------------------------------------------------
