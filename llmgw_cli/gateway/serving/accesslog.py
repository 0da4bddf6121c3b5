"""One JSON line per request, written in batches.

The ``logging`` module costs tens of microseconds per record and flushes every line (a
write system call per request); at thousands of requests per second that is a good part
of the gateway's CPU. Lines are instead collected and written every ``interval`` or
every 64 KiB, whichever comes first. A crash loses at most that much log.

Several workers write to the same stderr (a pipe, or journald's stream socket): one
write of more than ``PIPE_BUF`` bytes may be interleaved with another process's, which
would cut lines. A worker's log (``chunk=select.PIPE_BUF``) writes whole lines in pieces
of at most that size.

Contract: ``write`` runs on the event loop and never blocks on I/O except when the buffer
is full; ``flush`` writes to the stream (a pipe or file: fast, but blocking).
"""

from __future__ import annotations

import json
from typing import Any, BinaryIO

LIMIT = 64 * 1024


class AccessLog:
    def __init__(self, stream: BinaryIO, chunk: int = LIMIT) -> None:
        self.stream = stream
        self.chunk = chunk
        self.lines: list[bytes] = []
        self.size = 0

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":")).encode() + b"\n"
        self.lines.append(line)
        self.size += len(line)
        if self.size >= LIMIT:
            self.flush()

    def flush(self) -> None:
        if not self.lines:
            return
        lines, self.lines, self.size = self.lines, [], 0
        if self.chunk >= LIMIT:
            self.stream.write(b"".join(lines))
            self.stream.flush()
            return
        piece: list[bytes] = []
        size = 0
        for line in lines:
            if piece and size + len(line) > self.chunk:
                self.stream.write(b"".join(piece))
                self.stream.flush()  # one write system call per piece
                piece, size = [], 0
            piece.append(line)
            size += len(line)
        self.stream.write(b"".join(piece))
        self.stream.flush()
