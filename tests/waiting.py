"""Waiting in tests for something to become true: the one polling loop of the suite.

A test that waits for a process to come up, a log line or a counter asks the same
question again and again until a deadline; ``wait_until`` is that loop, written once.
It is the synchronous twin of ``llmgw_cli/polling.py``'s ``poll_until``.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    check: Callable[[], T],
    *,
    timeout: float,
    what: str | Callable[[], str],
    until: Callable[[T], object] = bool,
    interval: float = 0.05,
    retry_on: tuple[type[Exception], ...] = (),
) -> T:
    """Call ``check()`` every ``interval`` seconds until its value is true (or, with
    ``until``, until ``until(value)`` is), and return that value. ``check`` runs at least
    once, and once more at the deadline.

    An exception in ``retry_on`` means "not yet" (and is the last value seen); any other
    ends the wait, so a check can fail at once (asserting that the process it waits for
    still runs, say). After ``timeout`` seconds the wait fails with an AssertionError
    that says what it waited for (``what``; a callable is asked then, for a log's tail,
    say) and the last value ``check`` gave."""
    deadline = time.monotonic() + timeout
    while True:
        last: object
        try:
            last = value = check()
        except retry_on as exc:
            last = exc
        else:
            if until(value):
                return value
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            said = what() if callable(what) else what
            raise AssertionError(f"waited {timeout:g}s for {said}\nlast seen: {_short(last)}")
        time.sleep(min(interval, remaining))


def connects(host: str, port: int, timeout: float = 0.5) -> bool:
    """Whether a TCP connection to ``host:port`` is accepted now."""
    try:
        socket.create_connection((host, port), timeout).close()
    except OSError:
        return False
    return True


def _short(value: object, limit: int = 2000) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"
