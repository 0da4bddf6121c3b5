"""How long-running work tells its caller what it is doing: the progress callbacks.

Three shapes, because the callers show three different things:

- ``LineReport``: one line of text about the whole job; the lab's ``up`` and ``down``
  report this way, and the CLI prints each line as it comes.
- ``Report``, the common one: ``(subject, message, phase)``, where the subject is what
  the message is about: a node, ``model#replica``, ``model@node`` or the gateway, and the
  phase says whether that subject is still being worked on, done, or failed. Probes,
  apply's executor, engine keys, the gateway's install and the node set-up report this
  way, so the CLI can keep one line per subject, coloured by its phase and timed from
  its first report to its last, without reading the message (which may quote a node).
- ``FetchReport``: a ``FetchEvent`` with the bytes fetched and the total, so the CLI
  can draw one progress bar per model and node.

``Events`` is the ``Report`` the CLI hands down: each report becomes an ``Event`` in a
queue, which the CLI's renderer reads in a task of its own (``async for event in
events``). Progress thus flows up as values; the work below never calls the CLI's code.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol


class Phase(StrEnum):
    """Where one subject of a ``Report`` stands."""

    working = "working"  # more reports about this subject will follow
    done = "done"  # finished as asked (ready, in place, written)
    failed = "failed"  # finished without doing what was asked; the message says why


class Report(Protocol):
    def __call__(self, subject: str, message: str, phase: Phase = Phase.working, /) -> None: ...


@dataclass(frozen=True)
class FetchEvent:
    """Where one node's fetch of one model stands, as the fetcher tells it."""

    model: str
    node: str
    state: str  # waiting, fetching, present, done, failed
    source: str  # "origin" or the name of the peer copied from
    bytes: int = 0
    total: int | None = None
    message: str = ""  # a remark (a peer that failed and why), not the progress
    files: int | None = None  # a snapshot's files done; None for a single file
    files_total: int | None = None  # and how many it has


@dataclass(frozen=True)
class Event:
    """One ``Report``, as a value."""

    subject: str
    message: str
    phase: Phase = Phase.working


@dataclass(frozen=True)
class Note:
    """A line said once about the whole job (who holds the cluster lock apply waits for)."""

    text: str


class Events:
    """A ``Report`` (and a ``LineReport``, ``note``) that queues what it is told, in order,
    for one reader: ``async for item in events`` gives each ``Event`` and ``Note`` until
    ``close()``. Telling never waits and never runs the reader's code, so the layers below
    the CLI report without calling up into it."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[Event | Note | None] = asyncio.Queue()

    def __call__(self, subject: str, message: str, phase: Phase = Phase.working, /) -> None:
        self._queue.put_nowait(Event(subject, message, phase))

    def note(self, text: str) -> None:
        self._queue.put_nowait(Note(text))

    def close(self) -> None:
        """No more events: the reader's loop ends once it has read those before."""
        self._queue.put_nowait(None)

    def __aiter__(self) -> Events:
        return self

    async def __anext__(self) -> Event | Note:
        item = await self._queue.get()
        if item is None:
            self._queue.put_nowait(None)  # a second reading ends at once too
            raise StopAsyncIteration
        return item


LineReport = Callable[[str], None]
FetchReport = Callable[[FetchEvent], None]


def quiet(_: str) -> None:
    """A ``LineReport`` that shows nothing: the default where nobody watches."""


def silent(_subject: str, _message: str, _phase: Phase = Phase.working, /) -> None:
    """A ``Report`` that shows nothing."""


@dataclass(frozen=True)
class Row:
    """The latest report about one subject, and since when the subject has been reported."""

    message: str
    phase: Phase
    started: float  # monotonic time of the subject's first report
    changed: float  # monotonic time of its latest report

    def elapsed(self, now: float) -> float:
        """How long the subject has taken: up to now while it is worked on, up to its
        last report once it is done or failed."""
        return (now if self.phase is Phase.working else self.changed) - self.started


class Board:
    """A ``Report`` that keeps one row per subject, in the order subjects first reported,
    for a view that shows each subject's state, phase and elapsed time."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.rows: dict[str, Row] = {}

    def __call__(self, subject: str, message: str, phase: Phase = Phase.working, /) -> None:
        now = self.clock()
        before = self.rows.get(subject)
        self.rows[subject] = Row(message, phase, before.started if before else now, now)
