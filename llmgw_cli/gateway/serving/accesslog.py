"""One JSON line per request, written off the request's path by a thread of its own.

The request's path only appends the line's values (a tuple, in ``FIELDS`` order) to a
bounded queue: no encoding, no lock, no system call. A writer thread wakes every
``interval`` (or as soon as a quarter of the queue is used), encodes what is queued and
writes it in batches of at most 64 KiB. Encoding costs as much CPU as it did on the
request's path (the thread shares the interpreter), but no request waits for it, nor for
the write to stderr (a pipe, or journald's stream socket, that may be slow to drain).

When the queue is full (the writer cannot keep up, or stderr does not drain) a line is
dropped, not waited for: serving matters more than its log. Dropped lines, and lines a
failed write lost, are counted (``dropped``; ``on_drop`` is told of them, from the writer:
the gateway counts them in ``llmgw_access_log_dropped_total``). A crash loses what is
queued; ``close`` (at the gateway's stop) writes everything still queued.

Several workers write to the same stderr: one write of more than ``PIPE_BUF`` bytes may
be interleaved with another process's, which would cut lines. A worker's log
(``chunk=select.PIPE_BUF``) writes whole lines in pieces of at most that size, each in one
system call on the stream's file descriptor: not through the stream's buffer, where the
process's other log lines (written by the event loop's thread meanwhile) could join a
piece into one longer write.

Contract: ``write`` runs on the event loop and never blocks; ``flush`` (the writer's, or
the caller's when no writer runs, as in tests) encodes and writes what is queued, one
flush at a time; ``start`` and ``close`` start and stop the writer.
"""

from __future__ import annotations

import json
import os
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, BinaryIO

LIMIT = 64 * 1024
CAPACITY = 16384  # queued lines (about 6 MiB at most); 80,000 requests/s at INTERVAL
INTERVAL = 0.2

# The values of a line, in order: the request's path passes a tuple of them (``encode``
# writes them in this order).
FIELDS = (
    "ts",
    "request_id",
    "path",
    "key",
    "model",
    "asked",
    "replica",
    "route",
    "status",
    "stream",
    "prompt_tokens",
    "completion_tokens",
    "usage_estimated",
    "attempts",
    "first_byte_ms",
    "cut",
    "ms",
)
_string = json.encoder.encode_basestring_ascii  # as json.dumps writes a str (C, escaped)
_bool = ("false", "true")
_encode = json.JSONEncoder(separators=(",", ":")).encode


def encode(record: tuple[Any, ...] | dict[str, Any]) -> bytes:
    """One line: a tuple of ``FIELDS`` values, or a dict as it is. A tuple is written as
    ``json.dumps`` would write the dict of its fields (times rounded to 3 decimals), in a
    quarter of the time: its strings (names a client sent among them) escaped by json's
    own encoder, its numbers and flags formatted as JSON has them."""
    if not isinstance(record, tuple):
        return _encode(record).encode() + b"\n"
    ts, rid, path, key, model, asked, replica, route, status, stream, prompt, completion = record[:12]
    estimated, attempts, first_byte_ms, cut, ms = record[12:]
    return (
        f'{{"ts":{round(ts, 3)!r},"request_id":{_string(rid)},"path":{_string(path)},'
        f'"key":{_string(key)},"model":{_string(model)},"asked":{_string(asked)},'
        f'"replica":{_string(replica)},"route":{_string(route)},"status":{status:d},'
        f'"stream":{_bool[stream]},"prompt_tokens":{prompt:d},"completion_tokens":{completion:d},'
        f'"usage_estimated":{_bool[estimated]},"attempts":{attempts:d},'
        f'"first_byte_ms":{round(first_byte_ms, 3)!r},"cut":{_bool[cut]},"ms":{round(ms, 3)!r}}}\n'
    ).encode()


class AccessLog:
    def __init__(
        self, stream: BinaryIO, chunk: int = LIMIT, capacity: int = CAPACITY, interval: float = INTERVAL
    ) -> None:
        self.stream = stream
        self.chunk = chunk
        self.capacity = capacity
        self.interval = interval
        self.queue: deque[tuple[Any, ...] | dict[str, Any]] = deque()
        self.dropped = 0  # lines the queue had no room for (counted by ``write`` alone)
        self.lost = 0  # lines a failed write lost (counted by ``flush`` alone)
        self.on_drop: Callable[[int], None] | None = None
        self._reported = 0
        self._wake_at = max(1, capacity // 4)
        self._lock = threading.Lock()  # one flush at a time
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        try:  # written to directly (see the module's docstring); a file object in tests
            self._fd: int | None = stream.fileno()
        except (OSError, ValueError, AttributeError):
            self._fd = None

    def write(self, record: tuple[Any, ...] | dict[str, Any]) -> None:
        """Queue one line (a tuple of ``FIELDS`` values, or a dict); drop it when the queue
        is full. Never blocks."""
        queued = len(self.queue)
        if queued >= self.capacity:
            self.dropped += 1
            return
        self.queue.append(record)
        if queued == self._wake_at:  # filling up: write now rather than at the interval
            self._wake.set()

    def start(self) -> None:
        """Start the writer thread (once)."""
        if self._thread is None:
            self._stop = False
            self._thread = threading.Thread(target=self._run, name="llmgw-access-log", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop the writer and write everything still queued."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop = True
            self._wake.set()
            thread.join()
        self.flush()

    def _run(self) -> None:
        while not self._stop:
            self._wake.wait(self.interval)
            self._wake.clear()
            self.flush()

    def flush(self) -> None:
        """Encode and write what is queued, and report what was dropped since the last time."""
        with self._lock:
            queue = self.queue
            left = len(queue)  # what is queued now: lines queued meanwhile wait for the next
            while left:
                lines: list[bytes] = []
                size = 0
                while left and size < LIMIT:
                    line = encode(queue.popleft())
                    lines.append(line)
                    size += len(line)
                    left -= 1
                try:
                    self._write(lines)
                except (OSError, ValueError):  # stderr closed or broken: those lines are lost
                    self.lost += len(lines)
            self._report()

    def _report(self) -> None:
        gone = self.dropped + self.lost - self._reported
        if gone and self.on_drop is not None:
            self._reported += gone
            self.on_drop(gone)

    def _write(self, lines: list[bytes]) -> None:
        if self.chunk >= LIMIT:
            self._put(b"".join(lines))
            return
        piece: list[bytes] = []
        size = 0
        for line in lines:
            if piece and size + len(line) > self.chunk:
                self._put(b"".join(piece))  # one write system call per piece
                piece, size = [], 0
            piece.append(line)
            size += len(line)
        self._put(b"".join(piece))

    def _put(self, data: bytes) -> None:
        if self._fd is None:
            self.stream.write(data)
            self.stream.flush()
            return
        view = memoryview(data)
        while view:  # a pipe takes a piece of at most PIPE_BUF whole, in one write
            view = view[os.write(self._fd, view) :]
