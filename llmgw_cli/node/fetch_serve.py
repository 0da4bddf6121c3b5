"""The node fetcher's servers: ``serve`` (one file) and ``serve-snapshot`` (a snapshot's
files as they arrive), read-only, on this node's fabric address, behind a secret.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import IO, Any
from urllib.parse import unquote

from llmgw_cli.node.fetch_disk import (
    JobFailed,
    _detach,
    _emit,
    _error,
    inspect,
    open_file,
    open_folder,
    origin_record,
)
from llmgw_cli.node.fetch_snapshot import (
    _enter,
    _parent,
    _snapshot_refused,
    _snapshot_running,
    _snapshot_where,
    check_snapshot_path,
)

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
