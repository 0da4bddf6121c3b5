"""The node fetcher's single files: HTTP requests (the token kept to its origin), one
file's download with resume (``Range`` + ``If-Range``) and its modes ``fetch``,
``verify`` and ``poll``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import http.client
import json
import os
import re
import ssl
import time
import traceback
from typing import IO, Any
from urllib.parse import urljoin, urlsplit

from llmgw_cli.node.fetch_disk import (
    CHUNK,
    LOOPBACK_HOSTS,
    RETRIES,
    STATUS_EVERY,
    STATUS_SIZE,
    Digests,
    JobFailed,
    _detach,
    _emit,
    _error,
    _hash_file,
    _read_json,
    _remember,
    _size,
    _unlink,
    _write_json,
    hash_target,
    inspect,
    open_file,
    open_folder,
    origin_record,
    remembered,
    side_files,
)

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
