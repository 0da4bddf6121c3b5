"""The event loop the gateway tests run on: asyncio's own, or uvloop with
``LLMGW_TEST_LOOP=uvloop`` (``scripts/test`` runs tests/gateway both ways, since
`llmgw gateway run` uses uvloop wherever it is installed).

Both the loops of the tests themselves (``asyncio.run`` and ``asyncio.Runner`` follow the
event loop policy) and the gateway processes they start (``LLMGW_EVENT_LOOP``, read by
`llmgw gateway run`) use it, for the tests of this package only.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import pytest

LOOPS = ("asyncio", "uvloop")
LOOP = os.environ.get("LLMGW_TEST_LOOP", "asyncio")


@pytest.fixture(scope="package", autouse=True)
def event_loop_choice() -> Iterator[str]:
    if LOOP not in LOOPS:
        raise pytest.UsageError(f"LLMGW_TEST_LOOP={LOOP!r}: one of {', '.join(LOOPS)}")
    policy = asyncio.get_event_loop_policy()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LLMGW_EVENT_LOOP", LOOP)
        if LOOP == "uvloop":
            import uvloop  # noqa: PLC0415 (a test dependency, needed only here)

            asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        try:
            yield LOOP
        finally:
            asyncio.set_event_loop_policy(policy)
