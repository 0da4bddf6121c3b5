"""Read one replica's own /metrics for the router: its engine's queue and KV cache.

Each gateway process scrapes for itself (``Gateway.poll_signals``, every
``gateway.signals_interval`` give or take a fifth): the signals feed its own pool. A
scrape is bounded in time (``signals_timeout``) and in size (``MAX_BYTES``), and anything
short of a 200 with a page that gives at least one signal counts as no scrape: the
replica's last signals then age until the router ignores them and routes it by its own
in-flight count. Nothing here ever raises to the caller or holds a request up.
"""

from __future__ import annotations

import asyncio
import random

import aiohttp

from llmgw_cli.core.serving.engine_signals import Signals, wanted_names
from llmgw_cli.gateway.serving.engine_scrape import parse_signals

MAX_BYTES = 1024 * 1024  # a vLLM page is about 50 kB; a larger one is not an engine's
JITTER = 0.2  # each round waits the interval times 1 ± this, so processes do not scrape in step


def next_wait(interval: float) -> float:
    """Seconds until the next round of scrapes."""
    return interval * random.uniform(1 - JITTER, 1 + JITTER)


async def scrape_signals(
    session: aiohttp.ClientSession,
    address: str,
    engine: str,
    keys: tuple[str, ...],
    timeout: float,
) -> Signals | None:
    """The signals the replica at ``address`` reports now, or None: an engine kind whose
    metrics are not known (no request is made), a failure, a timeout, a refusal, an
    oversized page or one that gives no signal. ``keys``: the node's engine keys, the
    current one first; an engine still on the previous key answers 401 to the first."""
    if not wanted_names(engine):
        return None
    try:
        async with asyncio.timeout(timeout):
            for key in keys or ("",):
                text = await _get(session, address, key)
                if text is not None:
                    found = parse_signals(engine, text)
                    return None if found == Signals() else found
    except (aiohttp.ClientError, TimeoutError, OSError, UnicodeError, ValueError):
        return None
    return None


async def _get(session: aiohttp.ClientSession, address: str, key: str) -> str | None:
    """The page's text; None after a 401 (try the next key). Raises on any other failure."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with session.get(f"http://{address}/metrics", headers=headers, allow_redirects=False) as resp:
        if resp.status == 401:
            return None
        if resp.status != 200:
            raise ValueError(f"/metrics answered {resp.status}")
        data = bytearray()
        async for chunk in resp.content.iter_chunked(64 * 1024):
            data += chunk
            if len(data) > MAX_BYTES:
                raise ValueError("/metrics page too large")
        return data.decode("utf-8")
