"""Runs ON A NODE, not on the control host: download one file, or serve one to peers.

Standard library only (the node has python3 and nothing of llmgw). The control host reads
this file as text and pipes it to ``python3 -`` with one more line, ``main(<config>)``,
so the configuration (a token included) travels on stdin, never on a command line.

``fetch``: the file is written beside its target as ``<target>.part`` and renamed only
when its size and sha256 check out, so a partial file is never visible under the final
name. An interruption resumes with ``Range`` + ``If-Range`` (206 appends, 200 restarts
from zero, 416 finishes or restarts; REFERENCE.md section 7). A ``flock`` on a hidden lock
file beside the target makes concurrent fetches of one file on one node one download:
the second caller attaches to the first one's status instead of downloading again.

The download runs in a detached process (double fork), so it survives the control host
going away; its progress is a small JSON status file beside the target, rewritten
atomically twice a second, which the control host polls. Hidden files (``.name.*``) are
ignored by the weights scan.

``serve``: a read-only HTTP server on an ephemeral port that answers only
``/<secret>/<name>`` with that one file (HEAD, GET, single ranges, If-Range), and exits
after ``idle`` seconds without a request, or when killed. Peers copy from it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import http.client
import json
import os
import re
import ssl
import sys
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import IO, Any
from urllib.parse import urljoin, urlsplit

CHUNK = 1 << 20
STATUS_EVERY = 0.5
RETRIES = 5
STATUS_SIZE = 4096


class FetchFailed(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def side_files(target: str) -> dict[str, str]:
    """The files kept beside a target: the partial download and hidden bookkeeping."""
    folder, name = os.path.split(target)
    hidden = os.path.join(folder, "." + name)
    return {
        "part": target + ".part",
        "meta": hidden + ".fetch-meta",
        "status": hidden + ".fetch-status",
        "lock": hidden + ".fetch-lock",
    }


def _write_json(path: str, data: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def _write_status(path: str, data: dict[str, Any]) -> None:
    """Rewrite the status in place, padded to a fixed size: once its block exists, a
    full disk cannot stop the job from saying how it ended. A reader may see a torn
    write; the control host reads it again."""
    text = json.dumps(data).encode()
    text += b" " * (STATUS_SIZE - len(text)) if len(text) < STATUS_SIZE else b""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, text, 0)
        os.ftruncate(fd, len(text))  # drop what a longer earlier status left behind
    finally:
        os.close(fd)


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _emit(data: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(data) + "\n")
    sys.stdout.flush()


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


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
    return http.client.HTTPConnection(host, parts.port, timeout=timeout), path


def _request(
    method: str, url: str, headers: dict[str, str], auth: dict[str, str], *, follow: bool = True
) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse, str]:
    """One request, following redirects by hand so the token goes only to the host it
    was given for (huggingface_hub drops it on the CDN redirect too)."""
    auth_host = urlsplit(url).hostname
    for _ in range(8):
        conn, path = _connection(url, 60.0)
        sent = dict(headers)
        if urlsplit(url).hostname == auth_host:
            sent.update(auth)
        conn.request(method, path, headers=sent)
        resp = conn.getresponse()
        location = resp.getheader("Location")
        if not follow or resp.status not in (301, 302, 303, 307, 308) or not location:
            return conn, resp, url
        resp.read()
        conn.close()
        url = urljoin(url, location)
    raise FetchFailed("http", "too many redirects")


def _http_error(status: int, url: str, reason: str) -> FetchFailed:
    if status == 404:
        return FetchFailed("not-found", f"{url} answered 404 Not Found")
    if status in (401, 403):
        return FetchFailed("auth", f"{url} answered {status} {reason}")
    return FetchFailed("http", f"{url} answered {status} {reason}")


def _resolve(url: str, auth: dict[str, str]) -> tuple[str, str | None, int | None]:
    """(URL to download, sha256 announced by the origin, size announced by the origin).

    A HEAD without following redirects, as huggingface_hub does: a Hugging Face resolve
    answers 302 with ``X-Linked-Etag`` (the sha256 of an LFS file) and ``X-Linked-Size``.
    """
    try:
        conn, resp, _ = _request("HEAD", url, {"Accept-Encoding": "identity"}, auth, follow=False)
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


# --- fetch ----------------------------------------------------------------------------


class Download:
    def __init__(self, config: dict[str, Any]) -> None:
        self.url: str = config["url"]
        self.target: str = config["target"]
        self.expected_sha: str | None = config.get("sha256")
        token = config.get("token")
        self.auth = {"Authorization": "Bearer " + token} if token else {}
        self.files = side_files(self.target)
        self.status: dict[str, Any] = {
            "state": "running",
            "pid": os.getpid(),
            "url": config.get("display_url", self.url),
            "bytes": _size(self.files["part"]),
            "total": None,
            "started": time.time(),
        }
        self._last_status = 0.0
        self._hash: Any = None  # sha256 of the partial file so far, kept while writing

    def report(self, force: bool = False, **changes: Any) -> None:
        self.status.update(changes)
        now = time.monotonic()
        if force or now - self._last_status >= STATUS_EVERY:
            self._last_status = now
            _write_status(self.files["status"], self.status)

    def run(self) -> None:
        url, linked_sha, linked_size = _resolve(self.url, self.auth)
        expected = self.expected_sha or linked_sha
        meta = _read_json(self.files["meta"])
        if meta.get("url") != self.url:
            self._discard()
            meta = {"url": self.url}
        for attempt in range(RETRIES + 1):
            try:
                total = self._transfer(url, meta)
                break
            except (OSError, http.client.HTTPException) as exc:
                if isinstance(exc, ssl.SSLCertVerificationError):
                    raise FetchFailed("tls", f"{url}: {exc}") from None
                if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise self._disk_full() from None
                if attempt == RETRIES:
                    raise FetchFailed("network", f"{url}: {exc}") from None
                self.report(True, retrying=f"{type(exc).__name__}: {exc}")
                time.sleep(min(2**attempt, 10))
        have = _size(self.files["part"])
        if linked_size is not None and linked_size != total:
            raise FetchFailed("size", f"the origin announced {linked_size} bytes but served {total}")
        if have != total:
            raise FetchFailed("size", f"got {have} of {total} bytes; the partial file was kept for a resume")
        digest = self._hash.hexdigest() if self._hash is not None else self._sha256()
        if expected and digest != expected:
            self._discard()
            raise FetchFailed(
                "checksum",
                f"sha256 of the download is {digest}, expected {expected}; the partial file was removed",
            )
        with open(self.files["part"], "rb") as f:
            os.fsync(f.fileno())
        os.replace(self.files["part"], self.target)
        _fsync_dir(os.path.dirname(self.target))
        _unlink(self.files["meta"])
        self.report(True, state="done", bytes=total, total=total, sha256=digest, finished=time.time())

    def _transfer(self, url: str, meta: dict[str, Any]) -> int:
        """Bring the partial file to the whole representation; return its total size."""
        part = self.files["part"]
        have = _size(part)
        headers = {"Accept-Encoding": "identity"}
        if have and meta.get("validator"):
            headers["Range"] = f"bytes={have}-"
            headers["If-Range"] = meta["validator"]
        elif have:
            have = 0  # nothing proves the partial is a prefix of what the origin has now
        conn, resp, _ = _request("GET", url, headers, self.auth)
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
                mode = "ab"
            elif resp.status == 200:
                length = resp.getheader("Content-Length")
                total = int(length) if length and length.isdigit() else -1
                have, mode = 0, "wb"
            else:
                raise _http_error(resp.status, url, resp.reason)
            meta.update(validator=_validator(resp), total=total)
            _write_json(self.files["meta"], meta)
            self._check_space(total - have if total >= 0 else 0)
            self.report(True, bytes=have, total=total if total >= 0 else None, resumed_from=have)
            self._hash = self._sha256_object() if mode == "ab" else hashlib.sha256()
            with open(part, mode) as out:
                self._copy(resp, out, have)
            return total if total >= 0 else _size(part)
        finally:
            conn.close()

    def _copy(self, resp: http.client.HTTPResponse, out: IO[bytes], have: int) -> None:
        while True:
            chunk = resp.read(CHUNK)
            if not chunk:
                break
            out.write(chunk)
            self._hash.update(chunk)  # hashing while writing spares reading the file again
            have += len(chunk)
            self.report(bytes=have)
        out.flush()

    def _check_space(self, needed: int) -> None:
        st = os.statvfs(os.path.dirname(self.target))
        free = st.f_bavail * st.f_frsize
        if needed > free:
            raise FetchFailed(
                "disk-full",
                f"needs {needed} more bytes in {os.path.dirname(self.target)}, {free} free" + self._kept(),
            )

    def _disk_full(self) -> FetchFailed:
        return FetchFailed("disk-full", f"no space left in {os.path.dirname(self.target)}" + self._kept())

    def _kept(self) -> str:
        have = _size(self.files["part"])
        return f"; the partial file ({have} bytes) was kept for a resume" if have else ""

    def _sha256(self) -> str:
        return str(self._sha256_object().hexdigest())

    def _sha256_object(self) -> Any:
        h = hashlib.sha256()
        with open(self.files["part"], "rb") as f:
            while True:
                block = f.read(CHUNK * 4)
                if not block:
                    return h
                h.update(block)

    def _truncate(self) -> None:
        with open(self.files["part"], "wb"):
            pass

    def _discard(self) -> None:
        _unlink(self.files["part"])
        _unlink(self.files["meta"])


def _parse_content_range(value: str | None) -> tuple[int, int]:
    match = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+)", (value or "").strip())
    if not match:
        raise http.client.HTTPException(f"unusable Content-Range {value!r}")
    return int(match.group(1)), int(match.group(3))


def _total_from_range(value: str | None) -> int | None:
    match = re.fullmatch(r"bytes \*/(\d+)", (value or "").strip())
    return int(match.group(1)) if match else None


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fetch(config: dict[str, Any]) -> None:
    target = config["target"]
    files = side_files(target)
    if os.path.isfile(target) and _size(target) > 0:
        _emit({"state": "present", "bytes": _size(target)})
        return
    os.makedirs(os.path.dirname(target), exist_ok=True)
    lock = os.open(files["lock"], os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        _emit({"state": "attached"})  # another fetch of this file runs: follow its status
        return
    if os.path.isfile(target) and _size(target) > 0:  # finished while we took the lock
        _emit({"state": "present", "bytes": _size(target)})
        return
    job = Download(config)
    try:
        job.report(True)  # the control host's first poll must not see an older run's status
    except OSError as exc:
        kind = "disk-full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "node"
        _emit(
            {"state": "error", "kind": kind, "message": f"cannot write beside {target}: {exc}" + job._kept()}
        )
        return
    foreground = bool(config.get("foreground"))
    if not foreground and not _detach():
        _emit({"state": "started"})
        return
    job.status["pid"] = os.getpid()
    try:
        job.run()
    except FetchFailed as exc:
        job.report(True, state="error", kind=exc.kind, message=str(exc))
    except BaseException as exc:  # a bug: say so in the status instead of dying silently
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        job.report(True, state="error", kind="crash", message=last)
    finally:
        os.close(lock)  # the status says done or error before the lock is free
    if not foreground:
        os._exit(0)


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


def _handler(path: str, secret: str, activity: _Activity) -> type[BaseHTTPRequestHandler]:
    route = "/" + secret + "/" + os.path.basename(path)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_HEAD(self) -> None:
            self._guarded(body=False)

        def do_GET(self) -> None:
            self._guarded(body=True)

        def _guarded(self, body: bool) -> None:
            activity.begin()
            try:
                self._answer(body)
            finally:
                activity.end()

        def _answer(self, body: bool) -> None:
            if self.path != route:
                self.send_error(404)
                return
            st = os.stat(path)
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
                with open(path, "rb") as f:
                    self.connection.sendfile(f, start, end - start + 1)

    return Handler


def serve(config: dict[str, Any]) -> None:
    """Serve one file until idle; prints ``{"state": "serving", "port": N, "pid": P}``."""
    activity = _Activity()
    server = ThreadingHTTPServer(("0.0.0.0", 0), _handler(config["file"], config["secret"], activity))
    server.daemon_threads = True
    port = server.server_address[1]
    idle = float(config.get("idle", 120))
    foreground = bool(config.get("foreground"))
    read_end, write_end = os.pipe()
    if not foreground and not _detach():
        os.close(write_end)
        with os.fdopen(read_end) as pipe:
            pid = int(pipe.read().strip() or 0)  # the detached server's pid, once it is up
        _emit({"state": "serving", "port": port, "pid": pid})
        return
    os.close(read_end)
    os.write(write_end, str(os.getpid()).encode())
    os.close(write_end)
    if foreground:
        _emit({"state": "serving", "port": port, "pid": os.getpid()})

    def watchdog() -> None:
        while activity.idle_for() < idle:
            time.sleep(0.5)
        server.shutdown()

    threading.Thread(target=watchdog, daemon=True).start()
    server.serve_forever()
    if not foreground:
        os._exit(0)


def main(config: dict[str, Any]) -> None:
    if config["mode"] == "fetch":
        fetch(config)
    elif config["mode"] == "serve":
        serve(config)
    else:
        raise SystemExit(f"unknown mode {config['mode']!r}")
