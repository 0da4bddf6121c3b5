"""The engines' answers read as bytes, for metering and for the client: no I/O, no asyncio.

Hot path: a stream is written to the client once per upstream read (never re-split into
SSE events), and its usage is read from the tail of the stream at its end, so no chunk is
parsed on the way. A whole JSON answer's usage is found at its end by a regular
expression, not by parsing it (an embeddings answer can be megabytes of floats).

Streams are what vLLM, SGLang and llama-server send: ``data: {...}`` events, each ended
by a blank line (``\\n\\n``), the include_usage event (empty ``choices`` and a ``usage``
object) near the end, then ``data: [DONE]``. ``StreamRelay`` gives the same bytes to the
client and the same usage however the stream is split into reads.
"""

from __future__ import annotations

import json
import re
from collections import deque
from dataclasses import dataclass
from typing import Any

TAIL_BYTES = 64 * 1024  # the end of a stream kept to find the usage event in it
USAGE_KEY = b'"usage"'
_DATA_LINE = b"\ndata:"
_USAGE_FIELD = re.compile(rb'"(prompt|completion)_tokens"\s*:\s*(\d+)')
_EMPTY_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')


def _usage_from(data: Any) -> tuple[int, int]:
    usage = data.get("usage") if isinstance(data, dict) else None
    if not isinstance(usage, dict):
        return 0, 0
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    return (prompt if isinstance(prompt, int) else 0, completion if isinstance(completion, int) else 0)


def body_usage(data: bytes) -> tuple[int, int]:
    """Usage of a whole JSON answer without parsing it: an embeddings answer can be
    megabytes of floats, and ``usage`` sits at its end (vLLM, SGLang, llama-server)."""
    at = data.rfind(USAGE_KEY)
    if at < 0:
        return 0, 0
    found = {m.group(1): int(m.group(2)) for m in _USAGE_FIELD.finditer(data, at, at + 400)}
    return found.get(b"prompt", 0), found.get(b"completion", 0)


def _event_around(data: bytes, at: int) -> tuple[int, int]:
    """Start and end (after its blank line, or -1 when there is none) of the SSE event
    holding offset ``at``."""
    start = data.rfind(b"\n\n", 0, at)
    end = data.find(b"\n\n", at)
    return (0 if start < 0 else start + 2), (-1 if end < 0 else end + 2)


def stream_usage(tail: bytes) -> tuple[int, int]:
    """Usage from the last ``data:`` event that carries one (the include_usage chunk).
    Only events around a ``"usage"`` key are looked at: a tail can hold a whole stream."""
    before = len(tail)
    while (at := tail.rfind(USAGE_KEY, 0, before)) >= 0:
        start, end = _event_around(tail, at)
        line = tail[start : None if end < 0 else end].strip()
        if line.startswith(b"data: {"):
            try:
                found = _usage_from(json.loads(line[6:]))
            except ValueError:
                found = (0, 0)
            if found != (0, 0):
                return found
        before = start
    return 0, 0


def without_usage_event(chunk: bytes) -> bytes:
    """``chunk`` without the include_usage event (empty ``choices``, a ``usage`` object).
    Only whole events are recognised (``StreamRelay`` hands over whole events only)."""
    at = chunk.find(USAGE_KEY)
    while at >= 0:
        start, end = _event_around(chunk, at)
        if end < 0:  # not a whole event
            return chunk
        event = chunk[start:end]
        if event.lstrip().startswith(b"data: {") and _EMPTY_CHOICES.search(event):
            chunk = chunk[:start] + chunk[end:]
            end = start
        at = chunk.find(USAGE_KEY, end)
    return chunk


@dataclass(frozen=True)
class StreamUsage:
    prompt: int
    completion: int
    estimated: bool  # the engine never said: counted from its events and the body's size
    done: bool  # the stream reached ``data: [DONE]``: the client got the whole answer


class StreamRelay:
    """One stream, read by read: ``feed`` gives the bytes to send the client now, ``rest``
    what is left at the end, ``usage`` what the stream used.

    ``hide_usage``: take out the include_usage event that the gateway asked for on the
    client's behalf (a client that did not ask may read ``choices[0]`` of every chunk).
    Then an event split across reads is held until the read that completes it, so it is
    recognised wherever the reads split it. That delays nothing a client could use: an SSE
    client acts on an event at its blank line. A stream whose lines end with CRLF (no
    ``\\n\\n``) passes through as it comes; only its first line is held until it is whole.
    """

    def __init__(self, *, hide_usage: bool) -> None:
        self.hide_usage = hide_usage
        self.events = 0  # `data:` events the engine sent: its tokens, if it never says its usage
        self._tail: deque[bytes] = deque()  # the last reads, at least TAIL_BYTES of them
        self._tail_bytes = 0
        self._before = b"\n"  # the last 5 bytes before this read (the stream starts a line)
        self._held = b""  # the part of an event not whole yet
        self._framed: bool | None = None  # events end with \n\n; None: no line end seen yet

    def feed(self, chunk: bytes) -> bytes:
        """The bytes for the client out of this read."""
        self._tail.append(chunk)
        self._tail_bytes += len(chunk)
        while self._tail_bytes - len(self._tail[0]) >= TAIL_BYTES:
            self._tail_bytes -= len(self._tail.popleft())
        # `data:` lines (content never holds a raw newline): those wholly in this read, and
        # one split across reads (its 6 bytes: at most 5 before this read, at most 5 in it)
        self.events += chunk.count(_DATA_LINE) + (self._before + chunk[:5]).count(_DATA_LINE)
        self._before = chunk[-5:] if len(chunk) >= 5 else (self._before + chunk)[-5:]
        if not self.hide_usage:
            return chunk
        data = self._held + chunk if self._held else chunk
        if self._framed is None:
            newline = data.find(b"\n")
            if newline < 0:  # the first line is not whole yet
                self._held = data
                return b""
            self._framed = data[newline - 1 : newline] != b"\r"
        if not self._framed:
            self._held = b""
            return data
        cut = data.rfind(b"\n\n")
        end = 0 if cut < 0 else cut + 2  # after the last whole event
        if end == len(data):  # the usual read: whole events
            whole, self._held = data, b""
        else:
            whole, self._held = data[:end], data[end:]
        return without_usage_event(whole) if USAGE_KEY in whole else whole

    def rest(self) -> bytes:
        """What is held at the end of the stream (an event without its blank line)."""
        held, self._held = self._held, b""
        return held

    def usage(self, prompt_estimate: int) -> StreamUsage:
        """Usage from the engine's usage event. A stream that ended before it (the client
        hung up, which closes the engine's connection and stops the generation; or a cut)
        is metered from what the engine sent: one completion token per event (engines send
        one token per event unless told to batch them, so this is a floor), and the prompt
        estimated from the body's size (``prompt_estimate``), as the gateway cannot
        tokenize it."""
        data = b"".join(self._tail)
        done = data.rstrip().endswith(b"data: [DONE]")
        prompt, completion = stream_usage(data)
        if prompt or completion:
            return StreamUsage(prompt, completion, estimated=False, done=done)
        return StreamUsage(prompt_estimate, max(0, self.events - done), estimated=True, done=done)
