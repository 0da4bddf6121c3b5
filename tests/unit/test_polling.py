from __future__ import annotations

import ast
import asyncio
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

import llmgw_cli
from llmgw_cli.polling import attempts, poll_until, wait_event


def test_returns_the_first_answer_that_is_not_none() -> None:
    calls: list[int] = []

    async def step() -> str | None:
        calls.append(1)
        return "ready" if len(calls) == 3 else None

    assert asyncio.run(poll_until(step, timeout=5, interval=0.001)) == "ready"
    assert len(calls) == 3


def test_gives_none_at_the_deadline_after_asking_at_least_once_and_once_at_the_end() -> None:
    now = [0.0]
    asked_at: list[float] = []

    async def step() -> str | None:
        asked_at.append(now[0])
        now[0] += 0.4  # each question takes 0.4 s of the fake clock
        return None

    assert asyncio.run(poll_until(step, timeout=1.0, interval=0.0, clock=lambda: now[0])) is None
    assert asked_at[0] == 0.0
    assert asked_at[-1] >= 0.8  # asked again close to the deadline, not given up early
    assert len(asked_at) == 3


def test_a_step_that_raises_ends_the_wait() -> None:
    async def step() -> str | None:
        raise RuntimeError("unit failed")

    with pytest.raises(RuntimeError, match="unit failed"):
        asyncio.run(poll_until(step, timeout=5, interval=0.001))


def _cancel_at_each_moment_after_a_set(wait: Callable[[asyncio.Event], Awaitable[object]]) -> list[int]:
    """Cancel a task waiting on an event 0, 1, ... loop turns after the event is set; the
    turns after which a cancellation the task took (it had not ended) was lost: the task
    ended as if nothing had been asked."""

    async def one(turns: int) -> bool:
        event = asyncio.Event()
        task = asyncio.create_task(wait(event))
        for _ in range(3):
            await asyncio.sleep(0)  # the task is waiting
        event.set()
        for _ in range(turns):
            await asyncio.sleep(0)
        if not task.cancel():
            return True  # it had ended already: nothing to lose
        done, _ = await asyncio.wait([task], timeout=5)
        assert done, "the waiting task never ended"
        return task.cancelled()

    async def all_turns() -> list[int]:
        return [turns for turns in range(8) if not await one(turns)]

    return asyncio.run(all_turns())


def test_a_cancellation_that_meets_a_set_event_goes_through() -> None:
    """A background loop waits on an event with a timeout and is cancelled by stop(): the
    cancellation must not be lost when the event was set a moment before, or the loop goes
    round again and stop() waits for ever."""
    lost = _cancel_at_each_moment_after_a_set(lambda event: wait_event(event, 10))
    assert lost == [], f"cancellations lost after {lost} loop turns"


def test_the_check_above_can_fail() -> None:
    """asyncio.wait_for loses such a cancellation on Python 3.11 (later versions build it on
    asyncio.timeout and do not): the moment the test above cancels at is the right one."""
    lost = _cancel_at_each_moment_after_a_set(lambda event: asyncio.wait_for(event.wait(), 10))
    if sys.version_info < (3, 12):
        assert lost, "wait_for kept every cancellation: the test above no longer tests the race"
    else:
        assert lost == []


def test_llmgw_never_uses_asyncio_wait_for() -> None:
    """Every timed wait in llmgw is asyncio.timeout or wait_event (see wait_event)."""
    root = Path(llmgw_cli.__file__).parent
    found = [
        f"{path.relative_to(root.parent)}:{node.lineno}"
        for path in sorted(root.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Attribute) and node.attr == "wait_for"
    ]
    assert found == [], f"asyncio.wait_for loses cancellations on Python 3.11: {found}"


def test_attempts_end_at_the_deadline_after_a_first_turn_at_once_and_a_last_at_the_end() -> None:
    now = [0.0]
    turns_at: list[float] = []

    async def count() -> None:
        async for _ in attempts(1.0, 0.3, clock=lambda: now[0]):
            turns_at.append(now[0])
            now[0] += 0.4  # each question takes 0.4 s of the fake clock

    asyncio.run(count())
    assert turns_at[0] == 0.0
    assert turns_at[-1] >= 0.8
    assert len(turns_at) == 3


def test_attempts_sleep_the_interval_and_never_past_the_deadline() -> None:
    async def timed() -> tuple[int, float]:
        loop = asyncio.get_running_loop()
        began = loop.time()
        turns = 0
        async for _ in attempts(0.25, 0.1):
            turns += 1
        return turns, loop.time() - began

    turns, took = asyncio.run(timed())
    assert 3 <= turns <= 4  # at 0, 0.1, 0.2, and the deadline
    assert 0.25 <= took < 0.6


def test_a_zero_timeout_still_gives_one_turn() -> None:
    async def count() -> int:
        return len([_ async for _ in attempts(0.0, 0.5)])

    assert asyncio.run(count()) == 1
