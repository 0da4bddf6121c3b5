"""Progress flows up as values: ``Events`` keeps every report in order, and the CLI's
renderer (``cli/rendering.py``) draws them all before the work's result or error."""

from __future__ import annotations

import asyncio

import pytest

from llmgw_cli.cli.rendering import rendered, to_report
from llmgw_cli.progress import Event, Events, Note, Phase


def test_events_keep_every_report_and_note_in_the_order_told() -> None:
    async def told() -> list[Event | Note]:
        events = Events()
        read: list[Event | Note] = []

        async def reader() -> None:
            async for item in events:
                read.append(item)

        task = asyncio.create_task(reader())
        for i in range(50):
            events(f"node{i % 3}", f"step {i}")
            if i % 7 == 0:
                events.note(f"note {i}")
                await asyncio.sleep(0)  # the reader runs in between, as it does in apply
        events("m#0", "ready", Phase.done)
        events.close()
        await task
        return read

    read = asyncio.run(told())
    expected: list[Event | Note] = []
    for i in range(50):
        expected.append(Event(f"node{i % 3}", f"step {i}"))
        if i % 7 == 0:
            expected.append(Note(f"note {i}"))
    expected.append(Event("m#0", "ready", Phase.done))
    assert read == expected


def test_a_closed_events_ends_every_reading() -> None:
    async def twice() -> tuple[list[Event | Note], list[Event | Note]]:
        events = Events()
        events("a", "one")
        events.close()
        return [e async for e in events], [e async for e in events]

    assert asyncio.run(twice()) == ([Event("a", "one")], [])


def test_rendered_draws_every_event_before_the_work_returns_or_raises() -> None:
    shown: list[tuple[str, str, Phase]] = []

    def report(subject: str, message: str, phase: Phase = Phase.working, /) -> None:
        shown.append((subject, message, phase))

    async def work(events: Events) -> str:
        events("a", "connecting")
        events.note("not a row")
        events("a", "done", Phase.done)
        return "result"

    assert asyncio.run(rendered(work, to_report(report))) == "result"
    assert shown == [("a", "connecting", Phase.working), ("a", "done", Phase.done)]

    shown.clear()

    async def failing(events: Events) -> str:
        events("b", "failed: exited 1", Phase.failed)
        raise RuntimeError("stopped")

    with pytest.raises(RuntimeError, match="stopped"):
        asyncio.run(rendered(failing, to_report(report)))
    assert shown == [("b", "failed: exited 1", Phase.failed)]
