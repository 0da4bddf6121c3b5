"""Waiting for something to become true: the one polling loop of llmgw.

Every readiness wait (an engine after ``apply`` starts it, the gateway after its install,
a replica the gateway started on demand, a request waiting for a loading model) is the
same loop: ask, and if there is no answer yet, sleep a little and ask again until a
deadline. The question differs; the loop is written here once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def poll_until(
    step: Callable[[], Awaitable[T | None]],
    *,
    timeout: float,
    interval: float,
    clock: Callable[[], float] = time.monotonic,
) -> T | None:
    """Await ``step()`` every ``interval`` seconds until it returns something other than
    None, and return that; return None once ``timeout`` seconds have passed. ``step`` runs
    at least once, and once more at the deadline, so a condition that becomes true while
    the loop sleeps its last interval is still seen. A step ends the wait early by
    returning a value that says so (a failure, say) or by raising."""
    deadline = clock() + timeout
    while True:
        result = await step()
        if result is not None:
            return result
        remaining = deadline - clock()
        if remaining <= 0:
            return None
        await asyncio.sleep(min(interval, remaining))


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
