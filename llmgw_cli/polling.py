"""Waiting for something to become true: the one polling loop of llmgw.

Every readiness wait (an engine after ``apply`` starts it, the gateway after its install,
a replica the gateway started on demand, a request waiting for a loading model) is the
same loop: ask, and if there is no answer yet, sleep a little and ask again until a
deadline. The question differs; the loop's timing is written here once, as ``attempts``,
which the waiting code iterates so that it asks its question itself.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class Attempts:
    """The turns of a wait that the caller drives: ``async for _ in attempts(timeout,
    interval): if await ready(): break``. The first turn comes at once; each next one
    ``interval`` seconds later, and the last one at the deadline, so a condition that
    becomes true while the loop sleeps its last interval is still seen; then the loop
    ends (its ``else`` runs: the time ran out). The caller asks its own question in its
    own body, so nothing here calls back into the layer that waits."""

    def __init__(
        self, timeout: float, interval: float, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval = interval
        self.clock = clock
        self.deadline = clock() + timeout
        self.started = False

    def __aiter__(self) -> Attempts:
        return self

    async def __anext__(self) -> None:
        if not self.started:
            self.started = True
            return
        remaining = self.deadline - self.clock()
        if remaining <= 0:
            raise StopAsyncIteration
        await asyncio.sleep(min(self.interval, remaining))


def attempts(timeout: float, interval: float, *, clock: Callable[[], float] = time.monotonic) -> Attempts:
    """The turns of a wait of ``timeout`` seconds, ``interval`` apart (``Attempts``)."""
    return Attempts(timeout, interval, clock=clock)


async def poll_until(
    step: Callable[[], Awaitable[T | None]],
    *,
    timeout: float,
    interval: float,
    clock: Callable[[], float] = time.monotonic,
) -> T | None:
    """Await ``step()`` on each of ``attempts`` and return its first answer that is not
    None; None once the time ran out. For waits whose question is a callable already (the
    tests'); llmgw's own waits drive ``attempts`` themselves."""
    async for _ in attempts(timeout, interval, clock=clock):
        result = await step()
        if result is not None:
            return result
    return None


async def wait_event(event: asyncio.Event, seconds: float) -> bool:
    """Wait for ``event`` at most ``seconds``; True when it is set.

    A cancellation always goes through. ``asyncio.wait_for`` on Python 3.11 swallows one
    that arrives while the inner wait has just finished (it returns the result instead), so
    a background loop cancelled at that moment went round again and its ``stop()`` never
    returned; ``asyncio.timeout`` tells its own expiry from a cancellation. llmgw uses it,
    never ``wait_for``.
    """
    try:
        async with asyncio.timeout(seconds):
            await event.wait()
    except TimeoutError:
        return False
    return True
