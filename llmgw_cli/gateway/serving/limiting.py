"""Per-key limits on the request path: the store calls the pure ``Limiter`` asks for
(``core/serving/ratelimit.py``), the 429 of a refusal and the ``x-ratelimit-*`` headers.

A request of a key with rpm, tpm or a budget is admitted (``admit``) before it queues for
a slot of its model: the process's ``Limiter`` answers from its own allowance, or asks for
a store call first (read the previous minute's count, lease a share of the window), which
is made here and handed back; a few rounds at most. Once the request's usage is known,
``settle`` gives back what it did not spend or counts what it spent beyond its estimate
(a store write, in the background: the answer has gone already).

When the store cannot be reached, a limited key's requests pass uncounted and the
process logs it (at most once a minute): the gateway keeps serving through a store
outage, as it does for keys and replicas, and the limits hold again once it answers.

Contract (concurrency): called on the gateway's event loop; the Limiter's state changes
only between awaits, and every answer is asked again after a store call.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from aiohttp import web

from llmgw_cli.core.serving.keys import ApiKey
from llmgw_cli.core.serving.ratelimit import FREE, Go, Lease, Read, Refused, Ticket
from llmgw_cli.core.serving.ratelimit_answer import limit_headers, refusal

if TYPE_CHECKING:
    from llmgw_cli.gateway.control.state import Gateway

log = logging.getLogger("llmgw.gateway")


ROUNDS = 10  # store calls one admission may make (two per counter is the most expected)
RATE_HEADERS = "llmgw_rate_headers"  # the request's x-ratelimit-* headers, for the answer
WARN_EVERY = 60.0  # seconds between two warnings of an unreachable store


async def admit(gw: Gateway, key: ApiKey, tokens: int) -> Go | Refused:
    """Admit a request of ``key`` estimated at ``tokens``: ``Go`` (its ticket for
    ``settle``) or the refusal.

    Store calls are shared: while one request reads a slot's earlier counts or takes a
    batch lease, the others of that key and counter wait for it and ask again, rather
    than each making a call of its own (at the start of every slot, a busy key's requests
    in flight would otherwise all read, and all lease, at once)."""
    limiter, limits, members = gw.limits.limiter, key.limits, max(1, gw.controller.members)
    for _ in range(ROUNDS):
        step = limiter.admit(key.name, limits, tokens, time.time(), members)
        if isinstance(step, Read):
            if not await _shared(gw, ("read", step.key, step.counter, step.windows[-1]), _read(gw, step)):
                return FREE
        elif isinstance(step, Lease):
            slot = ("lease", step.key, step.counter, step.window)
            if step.batch:
                if not await _shared(gw, slot, _lease(gw, step)):
                    return FREE
            elif slot in gw.limits.calls:  # a batch lease is out: wait for it, then ask again
                await asyncio.shield(gw.limits.calls[slot])
            elif not await _lease(gw, step):
                return FREE
        else:
            return step
    log.warning("key %s: no decision on its limits after %d store calls; let through", key.name, ROUNDS)
    return FREE


async def _shared(gw: Gateway, call: tuple[str, str, str, str], work: Coroutine[Any, Any, bool]) -> bool:
    """``work``, unless the same call is under way: then wait for that one (``work`` is
    not run). False: the store could not be reached."""
    running = gw.limits.calls.get(call)
    if running is not None:
        work.close()
        return await asyncio.shield(running)
    task = gw.limits.calls[call] = asyncio.ensure_future(work)
    task.add_done_callback(lambda _: gw.limits.calls.pop(call, None))
    return await asyncio.shield(task)


async def _read(gw: Gateway, step: Read) -> bool:
    try:
        used = await gw.store.used(*step.call)
    except Exception as exc:
        _unreachable(gw, exc)
        return False
    gw.limits.limiter.read(step, used, time.time())
    return True


async def _lease(gw: Gateway, step: Lease) -> bool:
    try:
        got = await gw.store.lease(*step.call)
    except Exception as exc:
        gw.limits.limiter.failed(step)
        _unreachable(gw, exc)
        return False
    gw.limits.limiter.granted(step, got, time.time())
    return True


def settle(gw: Gateway, key: ApiKey, ticket: Ticket, tokens: int) -> None:
    """The request of ``ticket`` used ``tokens`` in all (prompt and completion)."""
    for call in gw.limits.limiter.settle(ticket, tokens, key.limits, time.time()):
        gw.spawn(_add_used(gw, call.call))


async def _add_used(gw: Gateway, call: tuple[str, str, str, int]) -> None:
    try:
        await gw.store.add_used(*call)
    except Exception as exc:
        _unreachable(gw, exc)


def _unreachable(gw: Gateway, exc: Exception) -> None:
    now = time.monotonic()
    if now - gw.limits.warned >= WARN_EVERY:
        gw.limits.warned = now
        log.warning("gateway store: cannot count against key limits, requests pass uncounted: %s", exc)


def refused(refusal_of: Refused, headers: dict[str, str]) -> web.Response:
    """The 429 of a refusal, with the key's ``x-ratelimit-*`` headers."""
    status, body, retry = refusal(refusal_of)
    return web.Response(
        status=status, text=json.dumps(body), content_type="application/json", headers={**headers, **retry}
    )


def headers_for(gw: Gateway, key: ApiKey) -> dict[str, str]:
    """The ``x-ratelimit-*`` headers of ``key`` now (none without rpm or tpm)."""
    limits = key.limits
    if limits.rpm is None and limits.tpm is None:
        return {}
    return limit_headers(gw.limits.limiter, key.name, limits, time.time())


async def add_rate_headers(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: every answer to a limited key carries its headers, the
    streams' and the errors' too."""
    headers = request.get(RATE_HEADERS)
    if headers:
        for name, value in headers.items():
            response.headers.setdefault(name, value)
