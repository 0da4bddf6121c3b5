"""How the CLI shows the progress of work below it: it reads the work's events.

The CLI hands the work an ``Events`` (``llmgw_cli/progress.py``) and reads it in a task of
its own, which draws each event as it comes (a table row, a line, a progress bar); the
work only queues values and never calls the CLI's code. Every event is drawn before
``rendered`` returns or raises, in the order the work told them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from llmgw_cli.progress import Event, Events, Note, Report

T = TypeVar("T")
Show = Callable[[Event | Note], None]


async def rendered(work: Callable[[Events], Awaitable[T]], show: Show) -> T:
    """``work(events)``, each of its events shown by ``show`` in the CLI's own task."""
    events = Events()

    async def render() -> None:
        async for item in events:
            show(item)

    renderer = asyncio.create_task(render())
    try:
        return await work(events)
    finally:
        events.close()
        await renderer


def to_report(report: Report) -> Show:
    """``show`` for a renderer drawn as a ``Report`` (the node progress bar); a note has no
    subject there and is not shown."""

    def show(item: Event | Note) -> None:
        if isinstance(item, Event):
            report(item.subject, item.message, item.phase)

    return show
