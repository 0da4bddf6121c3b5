"""The node fetcher's footing: its errors, folders reached from ``/`` without following
a link, files opened and checked relative to their folder, status files, and digests
(what a file's sha256 is, and what was remembered of it).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import stat
import sys
import time
from typing import Any

CHUNK = 1 << 20
STATUS_EVERY = 0.5
RETRIES = 5
STATUS_SIZE = 4096
SETTLE_SECONDS = 2.0
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})
NOBODY = 65534
"""The uid root's files get on a root-squashed NFS export (``anonuid``'s default)."""
TRUSTED_OWNERS = frozenset({0, os.geteuid(), NOBODY})
_FILE_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # NONBLOCK: a planted FIFO cannot hang us
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class JobFailed(Exception):
    """The job (fetch, verify, poll, serve) cannot go on; ``kind`` is the failure's name in
    the answer (not-found, auth, disk-full, checksum, size, network, tls, http, unsafe...)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Unsafe(JobFailed):
    """Something in the weights folder (or on the way to it) that others could have planted."""

    def __init__(self, message: str) -> None:
        super().__init__("unsafe", message)


def side_files(target: str) -> dict[str, str]:
    """The files kept beside a target: the partial download and hidden bookkeeping."""
    folder, name = os.path.split(target)
    hidden = os.path.join(folder, "." + name)
    return {
        "part": target + ".part",
        "meta": hidden + ".fetch-meta",
        "status": hidden + ".fetch-status",
        "lock": hidden + ".fetch-lock",
        "verified": hidden + ".fetch-verified",
        "origin": hidden + ".fetch-origin",
    }


def origin_record(folder: int, target: str, url: str | None) -> dict[str, Any] | None:
    """What the origin sent when this node downloaded ``target`` (or what the seed it
    copied from had recorded): ``{"url", "size", "sha256", "etag", "last_modified"}``,
    from the root-owned ``.fetch-origin`` beside it; None when there is none, or it is of
    another URL than ``url`` (when given) or not well formed."""
    record = _read_json(folder, os.path.basename(side_files(target)["origin"]))
    size, digest = record.get("size"), record.get("sha256")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        return None
    if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
        return None
    if url is not None and record.get("url") != url:
        return None
    return record


# --- the weights folder, opened without trusting it -----------------------------------


def _check_folder(st: os.stat_result, where: str) -> None:
    if st.st_uid not in TRUSTED_OWNERS:
        raise Unsafe(
            f"{where} belongs to uid {st.st_uid}: the fetcher (root) writes only under folders that "
            "root, its own account or nobody (root on a root-squashed filer) own; chown it to root"
        )
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise Unsafe(
            f"{where} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}) without the "
            "sticky bit, so another account could swap what the fetcher writes; chmod go-w it"
        )


class _Walk:
    """The folders from ``/`` to where a walk has come, each held open (``..`` goes back
    to the one before, never through a path that could have changed since)."""

    def __init__(self) -> None:
        self.open: list[tuple[int, str]] = []
        self.restart()

    def restart(self) -> None:
        self.close()
        fd = os.open("/", _DIR_FLAGS)
        self.open.append((fd, ""))
        _check_folder(os.fstat(fd), "/")

    def up(self) -> None:
        if len(self.open) > 1:
            os.close(self.open.pop()[0])

    def close(self) -> None:
        while self.open:
            os.close(self.open.pop()[0])

    def take(self) -> int:
        """The current folder's descriptor, now the caller's; the others are closed."""
        fd = self.open.pop()[0]
        self.close()
        return fd

    def down(self, name: str, *, create: bool) -> str | None:
        """Enter ``name``; returns a trusted link's text instead of entering it."""
        fd, shown = self.open[-1]
        where = f"{shown}/{name}"
        st = _stat_or_make(fd, name, create=create)
        if stat.S_ISLNK(st.st_mode):
            if st.st_uid not in TRUSTED_OWNERS:
                raise Unsafe(
                    f"{where} is a symbolic link owned by uid {st.st_uid}: the fetcher (root) does "
                    "not follow links another account can change; make it a folder or a root-owned link"
                )
            return os.readlink(name, dir_fd=fd)
        self.open.append((_open_checked(fd, name, st, where), where))
        return None


def _stat_or_make(fd: int, name: str, *, create: bool) -> os.stat_result:
    """``name`` in folder ``fd``, not followed if a link; made (mode 755) first when it is
    missing and ``create``, else FileNotFoundError."""
    try:
        return os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        if not create:
            raise
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o755, dir_fd=fd)
        return os.stat(name, dir_fd=fd, follow_symlinks=False)


def _open_checked(fd: int, name: str, st: os.stat_result, where: str) -> int:
    """A descriptor of the folder ``name`` in ``fd`` that ``st`` (its lstat) described:
    the same folder once open (not swapped in between), and passing ``_check_folder``.
    Raises Unsafe, with nothing left open."""
    if not stat.S_ISDIR(st.st_mode):
        raise Unsafe(f"{where} is not a folder")
    sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
    try:
        now = os.fstat(sub)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise Unsafe(f"{where} was replaced while the fetcher opened it")
        _check_folder(now, where)
    except BaseException:
        os.close(sub)
        raise
    return sub


def open_folder(path: str, *, create: bool) -> int:
    """A descriptor of folder ``path``, reached from ``/`` one component at a time without
    following a symbolic link that an untrusted account owns. Raises Unsafe or OSError."""
    if not path.startswith("/"):
        raise Unsafe(f"{path!r} is not an absolute path")
    parts = [p for p in path.split("/") if p]
    walk = _Walk()
    hops = 0
    try:
        while parts:
            name = parts.pop(0)
            if name == "..":
                walk.up()
            elif name != ".":
                link = walk.down(name, create=create)
                if link is not None:
                    hops += 1
                    if hops > 40:
                        raise Unsafe(f"{path}: too many symbolic links")
                    if link.startswith("/"):
                        walk.restart()
                    parts[:0] = [p for p in link.split("/") if p]
        return walk.take()
    finally:
        walk.close()


def open_file(
    folder: int, name: str, flags: int, where: str, *, strict: bool = True, mode: int = 0o644
) -> int:
    """Open ``name`` in the folder descriptor ``folder`` without following a link. ``strict``
    (files the fetcher writes): owned by a trusted account and with one link. Else (a file
    it only reads): a regular file, and one link unless a trusted account owns it."""
    try:
        fd = os.open(name, flags | _FILE_FLAGS, mode, dir_fd=folder)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Unsafe(
                f"{where} is a symbolic link: the fetcher (root) never writes or reads through one; "
                "remove it (and find out who planted it)"
            ) from None
        raise
    try:
        st = os.fstat(fd)
        trusted = st.st_uid in TRUSTED_OWNERS
        if not stat.S_ISREG(st.st_mode):
            raise Unsafe(f"{where} is not a regular file; remove it")
        if strict and not trusted:
            raise Unsafe(f"{where} belongs to uid {st.st_uid}, not to the fetcher; remove it")
        if st.st_nlink != 1 and (strict or not trusted):
            raise Unsafe(f"{where} has {st.st_nlink} hard links: it may be another file's; remove it")
        if flags & os.O_NONBLOCK == 0:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _lstat(folder: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=folder, follow_symlinks=False)
    except FileNotFoundError:
        return None


def inspect(folder: int, target: str) -> None:
    """Refuse (before anything is written) a target or side file that is a link, not a
    regular file, or (side files) someone else's."""
    name = os.path.basename(target)
    for key, path in {"target": target, **side_files(target)}.items():
        st = _lstat(folder, os.path.basename(path))
        if st is None:
            continue
        if stat.S_ISLNK(st.st_mode):
            raise Unsafe(
                f"{path} is a symbolic link: the fetcher (root) never writes or reads through one; "
                "remove it (and find out who planted it)"
            )
        if not stat.S_ISREG(st.st_mode):
            raise Unsafe(f"{path} is not a regular file; remove it")
        if key == "target":
            if st.st_nlink != 1 and st.st_uid not in TRUSTED_OWNERS:
                raise Unsafe(f"{path} has {st.st_nlink} hard links and belongs to uid {st.st_uid}; remove it")
        elif st.st_uid not in TRUSTED_OWNERS or st.st_nlink != 1:
            raise Unsafe(
                f"{path} belongs to uid {st.st_uid} with {st.st_nlink} link(s): not the fetcher's own "
                f"bookkeeping of {name}; remove it"
            )


def _write_json(folder: int, name: str, data: dict[str, Any]) -> None:
    """Replace ``name`` atomically: a fresh temporary file (O_EXCL) renamed over it."""
    tmp = f"{name}.{os.getpid()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp, dir_fd=folder)  # the name only, even when it is a link
    fd = open_file(folder, tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, tmp, mode=0o644)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)  # replaces a link, never follows it


def _read_json(folder: int, name: str) -> dict[str, Any]:
    """A bookkeeping file's JSON, {} when absent or unreadable. Raises Unsafe."""
    try:
        fd = open_file(folder, name, os.O_RDONLY, name)
    except FileNotFoundError:
        return {}
    try:
        with os.fdopen(fd) as f:
            data = json.loads(f.read(1 << 16))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _emit(data: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(data) + "\n")
    sys.stdout.flush()


def _error(kind: str, message: str) -> None:
    _emit({"state": "error", "kind": kind, "message": message})


def _size(folder: int, name: str) -> int:
    st = _lstat(folder, name)
    return st.st_size if st is not None and stat.S_ISREG(st.st_mode) else 0


def _unlink(folder: int, name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=folder)


def _detach() -> bool:
    """Double fork; True in the detached grandchild. The caller's parent returns at once."""
    if os.fork():
        return False
    os.setsid()
    if os.fork():
        os._exit(0)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    return True


# --- HTTP -----------------------------------------------------------------------------


# --- verify ---------------------------------------------------------------------------


class Digests:
    """A file's sha256 and, given its size, its git blob id, fed the bytes once."""

    def __init__(self, git_size: int | None = None) -> None:
        self.sha256 = hashlib.sha256()
        self.sha1 = hashlib.sha1(b"blob %d\0" % git_size) if git_size is not None else None

    def update(self, block: bytes) -> None:
        self.sha256.update(block)
        if self.sha1 is not None:
            self.sha1.update(block)

    def hexdigest(self) -> str:
        return self.sha256.hexdigest()

    def git_sha1(self) -> str | None:
        return self.sha1.hexdigest() if self.sha1 is not None else None


def _hash_file(fd: int, git_size: int | None = None, progress: Any = None) -> Digests:
    h = Digests(git_size)
    os.lseek(fd, 0, os.SEEK_SET)
    done = 0
    while True:
        block = os.read(fd, CHUNK * 4)
        if not block:
            return h
        h.update(block)
        done += len(block)
        if progress is not None:
            progress(done)


def _hash_fd(fd: int) -> str:
    return _hash_file(fd).hexdigest()


def _identity(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _settled(st: os.stat_result) -> bool:
    """Whether any later change by an untrusted account would give the file another
    ctime. File times tick coarsely (a few ms): a write in the tick a file was hashed in
    could keep its ctime. Only trusted accounts can write a file they own that is not
    group- or world-writable; any other file changed in the last seconds is not
    remembered (git's "racy" rule)."""
    if st.st_uid in TRUSTED_OWNERS and not st.st_mode & 0o022:
        return True
    return time.time() - st.st_ctime > SETTLE_SECONDS


def remembered(folder: int, target: str) -> str | None:
    """The sha256 the verified marker gives ``target``, when it names this very inode,
    size, mtime and ctime; else None (never hashed, or changed since)."""
    fd = open_file(folder, os.path.basename(target), os.O_RDONLY, target, strict=False)
    try:
        identity = _identity(os.fstat(fd))
    finally:
        os.close(fd)
    seen = _read_json(folder, os.path.basename(side_files(target)["verified"]))
    known = seen.get("sha256")
    return known if seen.get("identity") == identity and isinstance(known, str) else None


def hash_target(folder: int, target: str, progress: Any = None) -> str:
    """Hash ``target`` (``progress(bytes)`` on the way) and remember the result."""
    fd = open_file(folder, os.path.basename(target), os.O_RDONLY, target, strict=False)
    try:
        before = _identity(os.fstat(fd))
        h, done = hashlib.sha256(), 0
        while True:
            block = os.read(fd, CHUNK * 4)
            if not block:
                break
            h.update(block)
            done += len(block)
            if progress is not None:
                progress(done)
        digest = h.hexdigest()
        now = os.fstat(fd)
        if _identity(now) == before and _settled(now):  # not changed while it was hashed
            marker = os.path.basename(side_files(target)["verified"])
            _write_json(folder, marker, {"sha256": digest, "identity": before})
        return digest
    finally:
        os.close(fd)


def _remember(folder: int, target: str, digest: str) -> None:
    fd = open_file(folder, os.path.basename(target), os.O_RDONLY, target, strict=False)
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    identity = _identity(st)
    if not _settled(st):
        return
    _write_json(
        folder, os.path.basename(side_files(target)["verified"]), {"sha256": digest, "identity": identity}
    )


# --- fetch ----------------------------------------------------------------------------
