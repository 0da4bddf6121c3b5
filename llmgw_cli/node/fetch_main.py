"""Runs ON A NODE, not on the control host: download one file, or serve one to peers.

Standard library only (the node has python3 and nothing of llmgw). Its input is data, a
JSON job: the control host pipes this file to ``python3 -`` with one more line,
``main(<job>)``; installed on a node it runs as ``python3 nodefetch.py < job.json``. Either
way the job (a token included) travels on stdin, never on a command line.

``fetch``: the file is written beside its target as ``<target>.part`` and renamed only
when its size and sha256 check out, so a partial file is never visible under the final
name. An interruption resumes with ``Range`` + ``If-Range`` (206 appends, 200 restarts
from zero, 416 finishes or restarts); a resumed file is hashed whole before the rename.
A ``flock`` on a hidden lock file beside the target makes concurrent fetches of one file
on one node one download: the second caller attaches to the first one's status instead of
downloading again. An existing target is accepted only once it matches the pinned
sha256 (a file never checked is hashed by the detached job first, state ``verifying``);
one that does not is downloaded again and replaced only by a verified copy.

The download runs in a detached process (double fork), so it survives the control host
going away; its progress is a small JSON status file beside the target, rewritten twice a
second, which the control host polls (``poll``). Hidden files (``.name.*``) are ignored by
the weights scan.

``verify``: whether an existing target matches a sha256 (``quick``: only from what was
remembered). Hashing a large file takes minutes, so a hashed file is remembered in
``.name.fetch-verified`` together with its inode, size, mtime and ctime; no account but
root can set a ctime back, so a changed file is always hashed again.

``serve``: a read-only HTTP server on an ephemeral port of the job's ``bind`` address
(the node's address on its fabric; never every interface) that answers only
``/<secret>/<name>`` (a secret of at least 32 characters) with that one file (HEAD, GET, single ranges, If-Range), and exits
after ``idle`` seconds without a request, or when killed. Peers copy from it.

``snapshot`` (a whole Hugging Face repository at one commit; not used by ``llmgw fetch``
or ``apply`` yet): the files of the job go into ``<folder>/<commit>/<path>``, each through
the ``fetch`` machinery (partial file, resume, size, sha256 or git blob id, rename), one
after the other in one detached job with one status file; the manifest
``<folder>/<commit>.manifest.json`` is written last, atomically, once every file is in
place and checked, so a snapshot without it is incomplete. The partial files and the
record of what was hashed live in a hidden work folder beside the snapshot folder, which
holds only the repository's names. Every path is checked again here (``check_snapshot_path``)
and every folder of it is entered without following a link. ``verify-snapshot`` says
whether the manifest is there and every file in place (``full``: hashed too);
``poll-snapshot`` reads the job's status as ``poll`` does a file's. With ``peer``, the
job's URLs are another node's ``serve-snapshot``: a 503 there means "not there yet" and is
asked again (``waiting`` in the status) for as long as it lasts; a 404, or a peer that
cannot be reached, fails the job with kind ``peer``. No token goes to a peer.

``serve-snapshot``: ``serve`` for a snapshot's files, ``/<secret>/<quoted repo path>``,
each as soon as it is in place, so peers copy a file while the rest is still coming; a file
not there yet answers 503 with ``Retry-After`` while this node's job of the snapshot runs
(its lock is held), 404 once it does not.

Trust: this runs as root, in folders that other accounts (the engines' account, other
clients of a shared filer) may be able to write. Everything found there is hostile:

- The folder is reached from ``/`` one component at a time (``openat``), never through a
  symbolic link that an account other than root (or the fetcher's own) owns, and every
  folder on the way must be owned by root, the fetcher's account or ``nobody`` (what root
  is mapped to on a root-squashed NFS export) and not writable by group or others unless
  sticky. Anything else is refused with the path and what to change; nothing is written.
- Every file in the folder is opened relative to that folder's descriptor with
  ``O_NOFOLLOW`` (a planted symbolic link fails with ELOOP) and checked after opening:
  a regular file, owned by one of those accounts, with one link (a planted hard link to a
  root file has two). A file is never truncated before that check.
- Renames (``rename(2)``) replace the name itself, never a file a planted link points to.
- A token goes only over https, and only to the scheme, host and port it was given for;
  a redirect to plain http is refused, whatever host it names. A snapshot's token goes to
  its ``token_origin`` (the Hub endpoint) only, over https, or plain http to this node's
  own loopback (a local mirror); the Hub's redirects to its CDN never carry it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import hmac
import http.client
import ipaddress
import json
import os
import re
import socket
import ssl
import stat
import sys
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import IO, Any
from urllib.parse import unquote, urljoin, urlsplit

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


def _connection(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urlsplit(url)
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    host = parts.hostname or ""
    if parts.scheme == "https":
        context = ssl.create_default_context()
        return http.client.HTTPSConnection(host, parts.port, timeout=timeout, context=context), path
    if parts.scheme != "http":
        raise JobFailed("http", f"{url}: only https (and plain http between peers) is fetched")
    return http.client.HTTPConnection(host, parts.port, timeout=timeout), path


def _origin(url: str) -> tuple[str, str, int]:
    parts = urlsplit(url)
    default = 443 if parts.scheme == "https" else 80
    return parts.scheme, (parts.hostname or "").lower(), parts.port or default


def may_carry_token(first: str, url: str) -> bool:
    """A token given for ``first`` goes to ``url`` only over https, to the same scheme,
    host and port. Stricter than the clients people use: huggingface_hub removes the
    Authorization header when the download URL's netloc (host:port) differs from the
    resolve URL's (its CDN redirect); ``requests`` strips it on a redirect to another
    host, port or scheme."""
    return urlsplit(url).scheme == "https" and _origin(first) == _origin(url)


def may_carry_token_to(origin: str, url: str) -> bool:
    """A token given for ``origin`` (a snapshot job's Hub endpoint) goes to ``url`` only on
    that scheme, host and port, and only over https, or plain http when that origin is this
    node's own loopback (a local mirror, a test's stand-in: the token never crosses a
    network in clear). A redirect to the Hub's CDN, another origin, never carries it."""
    if _origin(origin) != _origin(url):
        return False
    scheme, host, _ = _origin(url)
    return scheme == "https" or (scheme == "http" and host in LOOPBACK_HOSTS)


def _request(
    method: str,
    url: str,
    headers: dict[str, str],
    auth: dict[str, str],
    *,
    follow: bool = True,
    token_origin: str | None = None,
) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse, str]:
    """One request, following redirects by hand so the token goes only where
    ``may_carry_token`` (or, given ``token_origin``, ``may_carry_token_to``) allows; a
    redirect from https to plain http is refused."""
    first = url
    for _ in range(8):
        conn, path = _connection(url, 60.0)
        sent = dict(headers)
        if may_carry_token_to(token_origin, url) if token_origin else may_carry_token(first, url):
            sent.update(auth)
        conn.request(method, path, headers=sent)
        resp = conn.getresponse()
        location = resp.getheader("Location")
        if not follow or resp.status not in (301, 302, 303, 307, 308) or not location:
            return conn, resp, url
        resp.read()
        conn.close()
        target = urljoin(url, location)
        if urlsplit(url).scheme == "https" and urlsplit(target).scheme != "https":
            raise JobFailed(
                "http",
                f"{url} redirected to {urlsplit(target).scheme}://{urlsplit(target).netloc}/...: a "
                "download that starts on https never continues without TLS",
            )
        url = target
    raise JobFailed("http", "too many redirects")


def _http_error(status: int, url: str, reason: str) -> JobFailed:
    if status == 404:
        return JobFailed("not-found", f"{url} answered 404 Not Found")
    if status in (401, 403):
        return JobFailed("auth", f"{url} answered {status} {reason}")
    return JobFailed("http", f"{url} answered {status} {reason}")


def _resolve(
    url: str, auth: dict[str, str], token_origin: str | None = None
) -> tuple[str, str | None, int | None]:
    """(URL to download, sha256 announced by the origin, size announced by the origin).

    A HEAD without following redirects, as huggingface_hub does: a Hugging Face resolve
    answers 302 with ``X-Linked-Etag`` (the sha256 of an LFS file) and ``X-Linked-Size``.
    """
    try:
        conn, resp, _ = _request(
            "HEAD", url, {"Accept-Encoding": "identity"}, auth, follow=False, token_origin=token_origin
        )
    except (OSError, http.client.HTTPException):
        return url, None, None  # the GET below reports the network problem, with retries
    resp.read()
    conn.close()
    if resp.status in (401, 403, 404):
        raise _http_error(resp.status, url, resp.reason)
    etag = (resp.getheader("X-Linked-Etag") or "").strip('"').lower()
    size = resp.getheader("X-Linked-Size")
    return (
        url,
        etag if re.fullmatch(r"[0-9a-f]{64}", etag) else None,
        int(size) if size and size.isdigit() else None,
    )


def _validator(resp: http.client.HTTPResponse) -> str | None:
    """A strong ETag, else Last-Modified: what If-Range may carry (weak ETags may not)."""
    etag = resp.getheader("ETag")
    if etag and not etag.startswith("W/"):
        return etag
    return resp.getheader("Last-Modified")


def _with_validators(meta: dict[str, Any], resp: http.client.HTTPResponse, total: int) -> dict[str, Any]:
    """``meta`` updated with what the origin said of its file: the validator a resume's
    If-Range carries, and the ETag and Last-Modified its origin record keeps."""
    etag, modified = resp.getheader("ETag"), resp.getheader("Last-Modified")
    meta.update(validator=_validator(resp), total=total, etag=etag, last_modified=modified)
    return meta


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


class Download:
    """One file's download into ``folder`` (a descriptor). Its partial file and bookkeeping
    lie beside the target, or in ``work`` (a descriptor) under the names of ``work_path``
    when given: a snapshot keeps them out of the folder the repository's files fill.

    Optional in ``config``: ``size`` (bytes the file must have: an origin announcing or
    sending another count is refused, and never more than it is written), ``git_sha1``
    (the git blob id the content must have, checked before the rename like ``sha256``),
    ``token_origin`` (the token goes to that origin only: ``may_carry_token_to``), ``peer``
    (the URL is a peer's ``serve-snapshot``: its 503 means "not there yet", asked again
    for as long as it lasts, with ``waiting`` in the status; a refusal or a peer that
    cannot be reached fails with kind ``peer``)."""

    def __init__(
        self, config: dict[str, Any], folder: int, work: int | None = None, work_path: str | None = None
    ) -> None:
        self.url: str = config["url"]
        self.target: str = config["target"]
        self.folder = folder
        self.work = folder if work is None else work
        self.remember = work is None  # a snapshot keeps its own record of what was checked
        self.name = os.path.basename(self.target)
        self.expected_git: str | None = config.get("git_sha1")
        # A peer's copy must be what the seed's origin download recorded, bytes and size.
        self.seed: str | None = config.get("seed")
        origin = config.get("origin")
        self.origin: dict[str, Any] | None = origin if isinstance(origin, dict) else None
        self.expected_sha: str | None = config.get("sha256") or (self.origin or {}).get("sha256")
        size = (self.origin or {}).get("size", config.get("size"))
        self.size: int | None = size if isinstance(size, int) and not isinstance(size, bool) else None
        self.keep_sha: str | None = config.get("keep_sha256") or self.expected_sha
        self.check = bool(config.get("check")) and bool(self.keep_sha)
        token = config.get("token")
        self.auth = {"Authorization": "Bearer " + token} if token else {}
        self.token_origin: str | None = config.get("token_origin")
        self.peer = bool(config.get("peer"))
        self.files = side_files(self.target if work_path is None else work_path)
        self.names = {k: os.path.basename(v) for k, v in self.files.items()}
        self.digests: dict[str, str] = {}  # after run(): sha256, and git-sha1 when asked for
        self.status: dict[str, Any] = {
            "state": "running",
            "pid": os.getpid(),
            "url": config.get("display_url", self.url),
            "bytes": _size(self.work, self.names["part"]),
            "total": None,
            "started": time.time(),
        }
        self._status_fd: int | None = None
        self._last_status = 0.0
        self._hash: Digests | None = None  # of the partial file so far, kept while writing

    def open_status(self) -> None:
        """Open the status file once (checked); every report rewrites it through this fd."""
        self._status_fd = open_file(
            self.work, self.names["status"], os.O_WRONLY | os.O_CREAT, self.files["status"]
        )

    def report(self, force: bool = False, **changes: Any) -> None:
        self.status.update(changes)
        now = time.monotonic()
        if force or now - self._last_status >= STATUS_EVERY:
            self._last_status = now
            self._write_status()

    def _write_status(self) -> None:
        """Rewrite the status in place, padded to a fixed size: once its block exists, a
        full disk cannot stop the job from saying how it ended. A reader may see a torn
        write; the control host reads it again."""
        if self._status_fd is None:
            return
        text = json.dumps(self.status).encode()
        text += b" " * (STATUS_SIZE - len(text)) if len(text) < STATUS_SIZE else b""
        os.pwrite(self._status_fd, text, 0)
        os.ftruncate(self._status_fd, len(text))  # drop what a longer earlier status left behind

    def kept(self) -> bool:
        """Whether the existing target matches the pinned sha256 (hashed here, in the
        detached job, with progress); if not, the download replaces it."""
        size = _size(self.folder, self.name)
        self.report(True, state="verifying", bytes=0, total=size)
        digest = hash_target(self.folder, self.target, lambda done: self.report(bytes=done))
        if digest == self.keep_sha:
            record = origin_record(self.folder, self.target, None)
            self.report(
                True,
                state="present",
                bytes=size,
                total=size,
                sha256=digest,
                finished=time.time(),
                **({"origin": record} if record else {}),
            )
            return True
        pinned = "the pinned" if self.expected_sha else "what the origin sent,"
        why = f"{self.target} has sha256 {digest}, not {pinned} {self.keep_sha}: downloading it again"
        self.report(
            True, state="running", bytes=_size(self.work, self.names["part"]), total=None, replacing=why
        )
        return False

    def run(self) -> None:
        if self.check and self.kept():
            return
        if self.peer:  # a peer announces nothing the job does not know already
            url, linked_sha, linked_size = self.url, None, None
        else:
            url, linked_sha, linked_size = _resolve(self.url, self.auth, self.token_origin)
        expected = self.expected_sha or linked_sha
        meta = _read_json(self.work, self.names["meta"])
        if meta.get("url") != self.url:
            self._discard()
            meta = {"url": self.url}
        total = self._transfer_retried(url, meta)
        fd = open_file(self.work, self.names["part"], os.O_RDONLY, self.files["part"])
        try:
            have = os.fstat(fd).st_size
            if linked_size is not None and linked_size != total:
                raise JobFailed("size", f"the origin announced {linked_size} bytes but served {total}")
            if self.size is not None and total != self.size:
                why = f"the origin served {total} bytes, expected {self.size}; refused"
                raise self._refused_copy("size", why, f"{total} bytes")
            if have != total:
                raise JobFailed(
                    "size", f"got {have} of {total} bytes; the partial file was kept for a resume"
                )
            # The digest covers the whole file: a resume's kept prefix was read back from
            # disk, the rest hashed as written; a file finished earlier is hashed here.
            hashes = self._hash if self._hash is not None else _hash_file(fd, self._git_size(total))
            digest = hashes.hexdigest()
            if expected and digest != expected:
                why = f"sha256 of the download is {digest}, expected {expected}; the partial file was removed"
                raise self._refused_copy("checksum", why, f"sha256 {digest}")
            git = hashes.git_sha1()
            if self.expected_git and git != self.expected_git:
                self._discard()
                raise JobFailed(
                    "checksum",
                    f"git blob id of the download is {git}, expected {self.expected_git}; "
                    "the partial file was removed",
                )
            self.digests = {"sha256": digest, **({"git-sha1": git} if git else {})}
            os.fsync(fd)
        finally:
            os.close(fd)
        record = self.origin or {
            "url": self.url,
            "size": total,
            "sha256": digest,
            "etag": meta.get("etag"),
            "last_modified": meta.get("last_modified"),
        }
        if self.remember:  # before the rename: a target in place always has its record
            _write_json(self.folder, self.names["origin"], record)
        os.replace(self.names["part"], self.name, src_dir_fd=self.work, dst_dir_fd=self.folder)
        os.fsync(self.folder)
        _unlink(self.work, self.names["meta"])
        if self.remember:
            with contextlib.suppress(OSError):
                _remember(self.folder, self.target, digest)  # the next run's check is then cheap
        done = {"sha256": digest, **({"origin": record} if self.remember else {})}
        self.report(True, state="done", bytes=total, total=total, finished=time.time(), **done)

    def _refused_copy(self, kind: str, message: str, differs: str) -> JobFailed:
        """A download that is not the file expected, its partial file removed. From a peer
        (``seed``): the seed's file is not what its origin download recorded (or the pin),
        said with what differed (``differs``, e.g. ``sha256 <hex>``)."""
        self._discard()
        if self.seed is None:
            return JobFailed(kind, message)
        o = self.origin or {}
        came = (
            f"{o.get('url')} sent {o.get('size')} bytes with sha256 {o.get('sha256')} when it was downloaded"
        )
        if not self.origin:
            came = f"the pinned sha256 is {self.expected_sha}"
        return JobFailed(
            "seed-changed",
            f"{self.target}: the copy from {self.seed} has {differs}, but {came}: the file on "
            f"{self.seed} changed since; refused, nothing was kept; find out who can write "
            f"{self.seed}'s weights folder",
        )

    def _transfer_retried(self, url: str, meta: dict[str, Any]) -> int:
        """``_transfer``, tried again after a network failure (``RETRIES`` times in a row,
        waiting longer each time) and, from a peer, after each 503 (not there yet)."""
        failures = 0
        while True:
            try:
                return self._transfer(url, meta)
            except _NotYet as wait:
                failures = 0  # the peer answers: only the file is not there yet
                self.report(True, waiting=f"{url}: not there yet, asked again in {wait.seconds:g} s")
                time.sleep(wait.seconds)
            except (OSError, http.client.HTTPException) as exc:
                if isinstance(exc, ssl.SSLCertVerificationError):
                    raise JobFailed("tls", f"{url}: {exc}") from None
                if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise self._disk_full() from None
                if failures == RETRIES:
                    if self.peer:
                        raise JobFailed("peer", f"the peer {url} cannot be reached: {exc}") from None
                    raise JobFailed("network", f"{url}: {exc}") from None
                self.report(True, retrying=f"{type(exc).__name__}: {exc}")
                time.sleep(min(2**failures, 10))
                failures += 1

    def _refused(self, resp: http.client.HTTPResponse, url: str) -> Exception:
        """What an answer that is no file means: from a peer, 503 is "not yet", anything
        else a peer failure (kind ``peer``: the control host copies from elsewhere)."""
        if not self.peer:
            return _http_error(resp.status, url, resp.reason)
        if resp.status == 503:
            return _NotYet(retry_after(resp.getheader("Retry-After")))
        if resp.status == 404:
            return JobFailed(
                "peer", f"the peer {url} answered 404: it does not have the file, and no job there brings it"
            )
        return JobFailed("peer", f"the peer {url} answered {resp.status} {resp.reason}")

    def _open_part(self, append: bool) -> int:
        flags = os.O_RDWR | os.O_CREAT | (os.O_APPEND if append else 0)  # read: the resumed prefix is hashed
        fd = open_file(self.work, self.names["part"], flags, self.files["part"])
        if not append:
            os.ftruncate(fd, 0)  # only now: a file that failed the checks was never truncated
        return fd

    def _transfer(self, url: str, meta: dict[str, Any]) -> int:
        """Bring the partial file to the whole representation; return its total size."""
        have = _size(self.work, self.names["part"])
        if self.size is not None and have > self.size:
            have = 0  # longer than the file can be: not a prefix of it
        headers = {"Accept-Encoding": "identity"}
        if have and meta.get("validator"):
            headers["Range"] = f"bytes={have}-"
            headers["If-Range"] = str(meta["validator"])
        elif have:
            have = 0  # nothing proves the partial is a prefix of what the origin has now
        conn, resp, _ = _request("GET", url, headers, self.auth, token_origin=self.token_origin)
        try:
            if resp.status == 416:
                total = _total_from_range(resp.getheader("Content-Range"))
                if total is not None and have == total:
                    self._hash = None  # complete already: hashed from the file below
                    return total
                self._truncate()
                raise http.client.HTTPException("416 for a partial that is not the file's prefix; restarting")
            if resp.status == 206:
                start, total = _parse_content_range(resp.getheader("Content-Range"))
                if start != have:
                    self._truncate()
                    raise http.client.HTTPException(f"206 from byte {start}, asked for {have}; restarting")
                append = True
            elif resp.status == 200:
                length = resp.getheader("Content-Length")
                total = int(length) if length and length.isdigit() else -1
                have, append = 0, False
            else:
                raise self._refused(resp, url)
            if self.size is not None and total not in (-1, self.size):
                why = f"{url} announced {total} bytes, expected {self.size}; refused"
                raise self._refused_copy("size", why, f"{total} bytes")
            _write_json(self.work, self.names["meta"], _with_validators(meta, resp, total))
            self._check_space(total - have if total >= 0 else 0)
            self.status.pop("waiting", None)
            self.report(True, bytes=have, total=total if total >= 0 else None, resumed_from=have)
            fd = self._open_part(append)
            self._hash = Digests(self._git_size(total if total >= 0 else None))
            if append:
                _hash_prefix(fd, self._hash, have)  # the kept prefix, read back from disk
            with os.fdopen(fd, "ab" if append else "wb") as out:
                self._copy(resp, out, have)
            got = _size(self.work, self.names["part"])
            whole = total if total >= 0 else self.size
            if whole is not None and got < whole:
                # http.client ends a body cut short without an error: a connection that
                # closed early is a network failure, retried and resumed with Range, not a
                # file of the wrong size.
                raise http.client.IncompleteRead(b"", whole - got)
            return total if total >= 0 else got
        finally:
            conn.close()

    def _git_size(self, total: int | None) -> int | None:
        """The size git's blob header names, when the git blob id is to be checked."""
        if not self.expected_git:
            return None
        return self.size if self.size is not None else total

    def _copy(self, resp: http.client.HTTPResponse, out: IO[bytes], have: int) -> None:
        assert self._hash is not None
        while True:
            chunk = resp.read(CHUNK)
            if not chunk:
                break
            if self.size is not None and have + len(chunk) > self.size:
                out.close()
                why = f"{self.url} sent more than the {self.size} bytes expected; refused"
                raise self._refused_copy("size", why, f"more than {self.size} bytes")
            out.write(chunk)
            self._hash.update(chunk)  # hashing while writing spares reading the file again
            have += len(chunk)
            self.report(bytes=have)
        out.flush()

    def _check_space(self, needed: int) -> None:
        st = os.statvfs(self.folder)
        free = st.f_bavail * st.f_frsize
        if needed > free:
            raise JobFailed(
                "disk-full",
                f"needs {needed} more bytes in {os.path.dirname(self.target)}, {free} free" + self._kept(),
            )

    def _disk_full(self) -> JobFailed:
        return JobFailed("disk-full", f"no space left in {os.path.dirname(self.target)}" + self._kept())

    def _kept(self) -> str:
        have = _size(self.work, self.names["part"])
        return f"; the partial file ({have} bytes) was kept for a resume" if have else ""

    def _truncate(self) -> None:
        os.close(self._open_part(append=False))

    def _discard(self) -> None:
        _unlink(self.work, self.names["part"])
        _unlink(self.work, self.names["meta"])


class _NotYet(Exception):
    """A peer's 503: the file is not there yet; ask again in ``seconds``."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"not there yet, ask again in {seconds:g} s")
        self.seconds = seconds


RETRY_AFTER_AT_MOST = 5.0


def retry_after(value: str | None) -> float:
    """The seconds a 503's ``Retry-After`` asks to wait: 1 when it says nothing usable (an
    HTTP date included), at least half a second (0 would ask again at once, in a loop),
    at most ``RETRY_AFTER_AT_MOST``."""
    if value is None or not value.strip().isdigit():
        return 1.0
    return min(max(float(value.strip()), 0.5), RETRY_AFTER_AT_MOST)


def _hash_prefix(fd: int, h: Any, length: int) -> None:
    """Feed the first ``length`` bytes of the open partial file to ``h`` (a resume)."""
    offset = 0
    while offset < length:
        block = os.pread(fd, min(CHUNK * 4, length - offset), offset)
        if not block:
            raise http.client.HTTPException("the partial file shrank while resuming; restarting")
        h.update(block)
        offset += len(block)


def _parse_content_range(value: str | None) -> tuple[int, int]:
    match = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+)", (value or "").strip())
    if not match:
        raise http.client.HTTPException(f"unusable Content-Range {value!r}")
    return int(match.group(1)), int(match.group(3))


def _total_from_range(value: str | None) -> int | None:
    match = re.fullmatch(r"bytes \*/(\d+)", (value or "").strip())
    return int(match.group(1)) if match else None


def _present(folder: int, config: dict[str, Any]) -> dict[str, Any] | None:
    """What to answer at once when the target exists and may be kept; None when a job must
    run: the target is absent or empty, its remembered sha256 is not the one it must have
    (a verified download replaces it), or it was never hashed (``config["check"]``: the
    detached job hashes it first, as that may take longer than a command may run).

    The sha256 it must have is the pinned one, else the one its origin record says the
    origin sent (``keep_sha256``); a file without either (put there by hand, or fetched
    before records were kept) or of another size than the record's is downloaded again."""
    target = config["target"]
    size = _size(folder, os.path.basename(target))
    if size <= 0:
        return None
    expected, why = _must_have(folder, target, config, size)
    if expected is None:
        config["replacing"] = why
        return None
    config["keep_sha256"] = expected
    known = remembered(folder, target)
    if known is None:
        config["check"] = True
        return None
    if known != expected:
        config["replacing"] = f"{target} has sha256 {known}, not {why} {expected}: downloading it again"
        return None
    record = origin_record(folder, target, None)
    return {"state": "present", "bytes": size, "sha256": known, "verified": True} | (
        {"origin": record} if record else {}
    )


def _must_have(folder: int, target: str, config: dict[str, Any], size: int) -> tuple[str | None, str]:
    """(the sha256 an existing target must have, what it is); (None, why the target is to
    be downloaded again) when nothing says which content it should be."""
    if config.get("sha256"):
        return config["sha256"], "the pinned"
    origin = config.get("origin")
    url = origin.get("url") if isinstance(origin, dict) else config.get("url")
    record = origin_record(folder, target, url)
    if record is None:
        return None, (
            f"{target} has no pinned sha256 and no record of an origin download of {url}: "
            "downloading it again"
        )
    if record["size"] != size:
        return None, (
            f"{target} has {size} bytes, but {url} sent {record['size']} when it was fetched: "
            "downloading it again"
        )
    return record["sha256"], "what the origin sent,"


def _error(kind: str, message: str) -> None:
    _emit({"state": "error", "kind": kind, "message": message})


def _target_folder(target: str, *, create: bool, missing: dict[str, Any] | None = None) -> int | None:
    """A descriptor of the target's folder (``open_folder``), or None once the reason it
    cannot be opened is printed; a folder that does not exist prints ``missing`` when given."""
    try:
        return open_folder(os.path.dirname(target), create=create)
    except JobFailed as exc:
        _error(exc.kind, str(exc))
    except OSError as exc:
        if missing is not None and isinstance(exc, FileNotFoundError):
            _emit(missing)
        else:
            _error("node", f"cannot open {os.path.dirname(target)}: {exc}")
    return None


def fetch(config: dict[str, Any]) -> None:
    target = config["target"]
    folder = _target_folder(target, create=True)
    if folder is None:
        return
    try:
        _fetch_in(folder, config)
    finally:
        os.close(folder)


def _fetch_in(folder: int, config: dict[str, Any]) -> None:
    lock = _lock(folder, config)
    if lock is None:
        return
    job = _job(folder, config, lock)
    if job is None:
        return
    foreground = bool(config.get("foreground"))
    if not foreground and not _detach():
        _emit({"state": "started"})
        return
    job.status["pid"] = os.getpid()
    try:
        job.run()
    except JobFailed as exc:
        job.report(True, state="error", kind=exc.kind, message=str(exc))
    except BaseException as exc:  # a bug: say so in the status instead of dying silently
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        job.report(True, state="error", kind="crash", message=last)
    finally:
        os.close(lock)  # the status says done or error before the lock is free
    if not foreground:
        os._exit(0)


def _lock(folder: int, config: dict[str, Any]) -> int | None:
    """The job's lock, held; None once the answer (present, attached, error) is printed."""
    target = config["target"]
    lock_path = side_files(target)["lock"]
    try:
        inspect(folder, target)
        present = _present(folder, config)
        if present:
            _emit(present)
            return None
        lock = open_file(folder, os.path.basename(lock_path), os.O_RDWR | os.O_CREAT, lock_path, mode=0o600)
    except JobFailed as exc:
        _error(exc.kind, str(exc))
        return None
    except OSError as exc:
        _error("node", f"cannot check {target}: {exc}")
        return None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock)
        _emit({"state": "attached"})  # another fetch of this file runs: follow its status
        return None
    return lock


def _job(folder: int, config: dict[str, Any], lock: int) -> Download | None:
    """The download, its status written; None (lock released) once the answer is printed."""
    target = config["target"]
    try:
        present = _present(folder, config)  # finished while we took the lock?
        if present:
            os.close(lock)
            _emit(present)
            return None
        job = Download(config, folder)
        if config.get("replacing"):
            job.status["replacing"] = config["replacing"]
        job.open_status()
        job.report(True)  # the control host's first poll must not see an older run's status
    except JobFailed as exc:
        os.close(lock)
        _error(exc.kind, str(exc))
        return None
    except OSError as exc:
        os.close(lock)
        kind = "disk-full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "node"
        have = _size(folder, os.path.basename(side_files(target)["part"]))
        kept = f"; the partial file ({have} bytes) was kept for a resume" if have else ""
        _error(kind, f"cannot write beside {target}: {exc}{kept}")
        return None
    return job


def verify(config: dict[str, Any]) -> None:
    """Print whether the target exists and matches ``sha256`` (without one: the size and
    sha256 its origin record gives, for ``url``): ``verified``, ``mismatch`` (with the
    sha256 found, or why it cannot be checked), ``absent``, or an error (a link, someone
    else's bookkeeping). With ``quick``, a file that would have to be hashed (never
    checked, or changed since) is ``unchecked`` instead."""
    target = config["target"]
    folder = _target_folder(target, create=False, missing={"state": "absent"})
    if folder is None:
        return
    try:
        inspect(folder, target)
        if _size(folder, os.path.basename(target)) <= 0:
            _emit({"state": "absent"})
            return
        expected, why = _must_have(folder, target, config, _size(folder, os.path.basename(target)))
        if expected is None:
            _emit({"state": "mismatch", "message": why})  # a fetch job downloads it again
            return
        digest = remembered(folder, target)
        if digest is None and config.get("quick"):
            _emit({"state": "unchecked"})  # never hashed, or changed since: a fetch job hashes it
            return
        digest = digest or hash_target(folder, target)
        record = origin_record(folder, target, None)
        state = "verified" if digest == expected else "mismatch"
        _emit({"state": state, "sha256": digest} | ({"origin": record} if record else {}))
    except JobFailed as exc:
        _error(exc.kind, str(exc))
    except OSError as exc:
        _error("node", f"cannot verify {target}: {exc}")
    finally:
        os.close(folder)


def poll(config: dict[str, Any]) -> None:
    """Print ``{"free": <nobody holds the job's lock>, "status": <its status or {}>}``,
    reading both without following links (what ``flock``/``cat`` on the paths would do)."""
    target = config["target"]
    files = side_files(target)
    answer: dict[str, Any] = {"free": True, "status": {}}
    try:
        folder = open_folder(os.path.dirname(target), create=False)
    except (JobFailed, OSError) as exc:
        _emit({**answer, "error": str(exc)})
        return
    try:
        try:
            lock = open_file(folder, os.path.basename(files["lock"]), os.O_RDONLY, files["lock"])
        except FileNotFoundError:
            lock = -1
        if lock >= 0:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                answer["free"] = False
            finally:
                os.close(lock)
        answer["status"] = _read_json(folder, os.path.basename(files["status"]))
    except (JobFailed, OSError) as exc:
        answer["error"] = str(exc)
    finally:
        os.close(folder)
    _emit(answer)


# --- snapshot: a whole repository at one commit ---------------------------------------

SNAPSHOT_MAX_FILES = 100_000
"""Most files a snapshot job may name (``MAX_FILES`` of the control host's snapshot rules)."""
SNAPSHOT_MAX_BYTES = 1 << 42
"""Most bytes a snapshot job may name, 4 TiB (``MAX_SNAPSHOT_BYTES`` there)."""
SNAPSHOT_MAX_PATH_CHARS = 1024
SNAPSHOT_MAX_COMPONENT_BYTES = 255
SNAPSHOT_MAX_MANIFEST_BYTES = 64 << 20
LISTED_AT_MOST = 100
"""Names of missing or wrong files an answer lists (their counts are always given)."""
_REPO_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
_REPO_ID = re.compile(rf"{_REPO_PART}/{_REPO_PART}")
_HEX40 = re.compile(r"[0-9a-f]{40}")
_HEX64 = re.compile(r"[0-9a-f]{64}")


def check_snapshot_path(path: object) -> str:
    """``path`` if it may name a file inside a snapshot folder, else Unsafe with why: the
    Hub chose it, so it is checked here again whatever the control host checked. Relative,
    ``/``-separated, no empty, ``.`` or ``..`` component, no backslash, no NUL or other
    control character (nor U+2028/U+2029), valid Unicode, at most 1024 characters and 255
    bytes a name."""
    if not isinstance(path, str) or not path:
        raise Unsafe(f"{path!r}: a repository path is a non-empty string")
    shown = repr(path[:200])
    if len(path) > SNAPSHOT_MAX_PATH_CHARS:
        raise Unsafe(f"{shown}...: {len(path)} characters, at most {SNAPSHOT_MAX_PATH_CHARS}")
    if path.startswith("/") or "\\" in path:
        raise Unsafe(f"{shown}: absolute, or holds a backslash; a repository path is relative")
    if any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F or c in "\u2028\u2029" for c in path):
        raise Unsafe(f"{shown}: holds a control character or a line separator")
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise Unsafe(f"{shown}: not valid Unicode (a lone surrogate)") from None
    for component in path.split("/"):
        if component in {"", ".", ".."}:
            raise Unsafe(f"{shown}: has an empty, '.' or '..' component")
        if len(component.encode("utf-8")) > SNAPSHOT_MAX_COMPONENT_BYTES:
            raise Unsafe(f"{shown}: a name longer than {SNAPSHOT_MAX_COMPONENT_BYTES} bytes")
    return path


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


class _Activity:
    """When the server last did something, and how many answers are being sent."""

    def __init__(self) -> None:
        self.last = time.monotonic()
        self.active = 0
        self.lock = threading.Lock()

    def idle_for(self) -> float:
        with self.lock:
            return 0.0 if self.active else time.monotonic() - self.last

    def begin(self) -> None:
        with self.lock:
            self.active += 1
            self.last = time.monotonic()

    def end(self) -> None:
        with self.lock:
            self.active -= 1
            self.last = time.monotonic()


class _FileHandler(BaseHTTPRequestHandler):
    """What both serving modes answer alike: HEAD and GET, each counted in ``activity``
    (set on the subclass), and a file sent whole or as the one range asked for (``_send``).
    A subclass says which file a request names (``_answer``)."""

    protocol_version = "HTTP/1.1"
    activity: _Activity

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_HEAD(self) -> None:
        self._guarded(body=False)

    def do_GET(self) -> None:
        self._guarded(body=True)

    def _guarded(self, body: bool) -> None:
        self.activity.begin()
        try:
            self._answer(body)
        finally:
            self.activity.end()

    def _answer(self, body: bool) -> None:
        raise NotImplementedError

    def _send(self, f: IO[bytes], body: bool) -> None:
        """The open file ``f``: 200, or 206 for a single ``Range`` (unless ``If-Range``
        names another version than its ETag, size and mtime), 416 past its end."""
        st = os.fstat(f.fileno())
        size, etag = st.st_size, f'"{st.st_size:x}-{st.st_mtime_ns:x}"'
        start, end = 0, size - 1
        wanted = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if_range = self.headers.get("If-Range")
        partial = wanted is not None and (if_range is None or if_range == etag)
        if partial and wanted is not None:
            start = int(wanted.group(1))
            end = min(int(wanted.group(2)), size - 1) if wanted.group(2) else size - 1
            if start >= size:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
        self.send_response(206 if partial else 200)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", etag)
        self.send_header("Content-Length", str(end - start + 1))
        if partial:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        if body:
            self.connection.sendfile(f, start, end - start + 1)


def _handler(path: str, folder: int, secret: str, activity: _Activity) -> type[_FileHandler]:
    name = os.path.basename(path)
    route = "/" + secret + "/" + name

    class Handler(_FileHandler):
        def _answer(self, body: bool) -> None:
            if self.path != route:
                self.send_error(404)
                return
            try:  # the name, opened again per request without following a link
                fd = open_file(folder, name, os.O_RDONLY, path, strict=False)
            except (JobFailed, OSError):
                self.send_error(404)
                return
            with os.fdopen(fd, "rb") as f:
                self._send(f, body)

    Handler.activity = activity
    return Handler


SECRET = re.compile(r"[A-Za-z0-9_-]{32,256}")
"""A peer server's secret: what ``secrets.token_urlsafe(24)`` makes (32 characters) or
longer. An empty or short one would let anyone who reaches the port guess the route."""


def check_secret(value: object) -> str:
    """``value`` when it may be a peer server's secret, else JobFailed (kind ``job``)."""
    if not isinstance(value, str) or not SECRET.fullmatch(value):
        raise JobFailed("job", "the secret must be 32 to 256 characters of A-Z a-z 0-9 _ -")
    return value


def check_bind(value: object) -> str:
    """The address a peer server listens on: the node's own address on its fabric, never
    every interface (``0.0.0.0``, ``::``, empty), else JobFailed (kind ``job``)."""
    if (
        not isinstance(value, str)
        or not value
        or len(value) > 253
        or not re.fullmatch(r"[A-Za-z0-9.:_-]+", value)
    ):
        raise JobFailed("job", f"bind {value!r}: the job must name the address peers reach this node at")
    try:
        unspecified = ipaddress.ip_address(value).is_unspecified
    except ValueError:
        unspecified = False  # a host name: resolved by bind(2) to one address
    if unspecified:
        raise JobFailed("job", f"bind {value!r}: a peer server never listens on every interface")
    return value


def serve(config: dict[str, Any]) -> None:
    """Serve one file until idle; prints ``{"state": "serving", "port": N, "pid": P,
    "origin": <its origin record, when it has one>}``."""
    path = config.get("file")
    try:
        if not isinstance(path, str):
            raise JobFailed("job", "file is not a path")
        check_secret(config.get("secret"))
        check_bind(config.get("bind"))
        folder = open_folder(os.path.dirname(path), create=False)
        inspect(folder, path)
        os.close(open_file(folder, os.path.basename(path), os.O_RDONLY, path, strict=False))
    except JobFailed as exc:
        _error(exc.kind, str(exc))
        return
    except OSError as exc:
        _error("node", f"cannot serve {path}: {exc}")
        return
    activity = _Activity()
    record = origin_record(folder, path, None)  # what the origin sent: the peers check their copy against it
    handler = _handler(path, folder, config["secret"], activity)
    _run_server(handler, activity, config, {"origin": record} if record else {})


class _Server6(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def _run_server(
    handler: type[_FileHandler],
    activity: _Activity,
    config: dict[str, Any],
    said: dict[str, Any] | None = None,
) -> None:
    """Serve on an ephemeral port of the job's ``bind`` address (checked: ``check_bind``)
    until ``idle`` seconds (default 120) pass without a request; detached unless
    ``foreground``. Prints ``{"state": "serving", "port": N, "pid": P}`` (and ``said``)
    once the server listens (P: the process to kill to stop it)."""
    bind = check_bind(config.get("bind"))
    server = (_Server6 if ":" in bind else ThreadingHTTPServer)((bind, 0), handler)
    server.daemon_threads = True
    port = server.server_address[1]
    idle = float(config.get("idle", 120))
    foreground = bool(config.get("foreground"))
    if foreground:
        _emit({"state": "serving", "port": port, "pid": os.getpid(), **(said or {})})
    else:
        read_end, write_end = os.pipe()
        if not _detach():
            os.close(write_end)
            with os.fdopen(read_end) as pipe:
                pid = int(pipe.read().strip() or 0)  # the detached server's pid, once it is up
            _emit({"state": "serving", "port": port, "pid": pid, **(said or {})})
            return
        os.close(read_end)
        os.write(write_end, str(os.getpid()).encode())
        os.close(write_end)

    def watchdog() -> None:
        while activity.idle_for() < idle:
            time.sleep(0.5)
        server.shutdown()

    threading.Thread(target=watchdog, daemon=True).start()
    server.serve_forever()
    if not foreground:
        os._exit(0)


# --- serve-snapshot: a snapshot's files to peers, each as soon as it is in place -------

RETRY_AFTER = 1
"""Seconds ``serve-snapshot`` asks a peer to wait before it asks again for a file not there yet."""


def serve_snapshot(config: dict[str, Any]) -> None:
    """Serve the files of the snapshot of ``commit`` in ``folder`` (``W/hf/<org>--<name>``)
    to peers until idle: ``GET``/``HEAD /<secret>/<path quoted>`` answers the file at
    ``<folder>/<commit>/<path>`` as ``serve`` does (ranges, If-Range); a file not there
    yet ``503`` with ``Retry-After`` while this node's job of the snapshot runs, ``404``
    once it does not; anything else ``404``. Prints ``{"state": "serving", "port": N,
    "pid": P}`` like ``serve``, or an error.

    A file is served once it is at its final name, where the job puts it only once
    checked. A file put there some other way may be wrong: whoever copies it checks its
    digest, as it would an origin's."""
    secret = config.get("secret")
    try:
        where = _snapshot_where(config)
        secret = check_secret(secret)
        check_bind(config.get("bind"))
        folder = open_folder(where[0], create=False)
    except (JobFailed, OSError) as exc:
        _snapshot_refused(exc, f"cannot open {config.get('folder')}")
        return
    shown, _, commit = where
    try:  # a planted link is refused now, not only request by request
        os.close(_enter(folder, commit, f"{shown}/{commit}", create=False))
    except FileNotFoundError:
        pass  # not made yet: its job makes it, and files are served as they come
    except (JobFailed, OSError) as exc:
        os.close(folder)
        _snapshot_refused(exc, f"cannot prepare the snapshot in {shown}")
        return
    activity = _Activity()
    _run_server(_snapshot_handler(folder, where, secret, activity), activity, config)


def _requested_path(raw: str, secret: str) -> str | None:
    """The repository path ``/<secret>/<quoted path>`` names (``check_snapshot_path``:
    ``%2F`` is one more ``/``, ``..`` refused however it is spelled), or None."""
    parts = raw.split("/", 2)
    if len(parts) != 3 or parts[0] or not hmac.compare_digest(parts[1].encode(), secret.encode()):
        return None
    if "?" in parts[2] or "#" in parts[2]:
        return None
    try:
        return check_snapshot_path(unquote(parts[2], errors="strict"))
    except (UnicodeDecodeError, JobFailed):
        return None


def _open_snapshot_file(folder: int, shown: str, commit: str, path: str) -> int:
    """``<commit>/<path>`` in the repo folder ``folder``, opened for reading, every folder
    entered and the file opened without following a link; a regular file only.
    FileNotFoundError when it (or a folder of it) is not there; Unsafe or OSError."""
    snap_shown = f"{shown}/{commit}"
    root = _enter(folder, commit, snap_shown, create=False)
    try:
        parent = _parent(root, snap_shown, path, create=False)
    finally:
        os.close(root)
    try:
        return open_file(parent, path.rsplit("/", 1)[-1], os.O_RDONLY, f"{snap_shown}/{path}", strict=False)
    finally:
        os.close(parent)


def _snapshot_handler(
    folder: int, where: tuple[str, str, str], secret: str, activity: _Activity
) -> type[_FileHandler]:
    shown, _, commit = where

    class Handler(_FileHandler):
        def _answer(self, body: bool) -> None:
            path = _requested_path(self.path, secret)
            if path is None:
                self.send_error(404)
                return
            found, fd = self._open(path)
            if found == "missing" and self._running():
                self._not_yet()
                return
            if found == "missing":  # the job may have put it in place and ended in between
                found, fd = self._open(path)
            if found != "open":
                self.send_error(404)
                return
            with os.fdopen(fd, "rb") as f:
                self._send(f, body)

        def _open(self, path: str) -> tuple[str, int]:
            """``("open", fd)``, ``("missing", -1)`` (it or a folder of it is not there),
            or ``("refused", -1)`` (a link, not a regular file, a file where a folder is)."""
            try:
                return "open", _open_snapshot_file(folder, shown, commit, path)
            except FileNotFoundError:
                return "missing", -1
            except (JobFailed, OSError):
                return "refused", -1

        def _running(self) -> bool:
            try:
                return _snapshot_running(folder, shown, commit)
            except (JobFailed, OSError):
                return False

        def _not_yet(self) -> None:
            self.send_response(503)
            self.send_header("Retry-After", str(RETRY_AFTER))
            self.send_header("Content-Length", "0")
            self.end_headers()

    Handler.activity = activity
    return Handler


MODES = {
    "fetch": fetch,
    "verify": verify,
    "poll": poll,
    "serve": serve,
    "snapshot": snapshot,
    "verify-snapshot": verify_snapshot,
    "poll-snapshot": poll_snapshot,
    "serve-snapshot": serve_snapshot,
}


def main(config: dict[str, Any]) -> None:
    mode = MODES.get(str(config.get("mode")))
    if mode is None:
        raise SystemExit(f"unknown mode {config.get('mode')!r}; one of {', '.join(MODES)}")
    mode(config)


if __name__ == "__main__" and sys.argv[0] != "-":  # piped as `python3 -`, a main() line follows
    main(json.load(sys.stdin))
