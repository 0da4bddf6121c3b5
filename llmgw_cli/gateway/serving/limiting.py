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

import json
import logging
import time
from typing import TYPE_CHECKING

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
    ``settle``) or the refusal."""
    limiter, limits, members = gw.limiter, key.limits, max(1, gw.controller.members)
    for _ in range(ROUNDS):
        step = limiter.admit(key.name, limits, tokens, time.time(), members)
        if isinstance(step, Lease):
            try:
                got = await gw.store.lease(*step.call)
            except Exception as exc:
                limiter.failed(step)
                _unreachable(gw, exc)
                return FREE
            limiter.granted(step, got, time.time())
        elif isinstance(step, Read):
            try:
                used = await gw.store.used(*step.call)
            except Exception as exc:
                _unreachable(gw, exc)
                return FREE
            limiter.read(step, used, time.time())
        else:
            return step
    log.warning("key %s: no decision on its limits after %d store calls; let through", key.name, ROUNDS)
    return FREE


def settle(gw: Gateway, key: ApiKey, ticket: Ticket, tokens: int) -> None:
    """The request of ``ticket`` used ``tokens`` in all (prompt and completion)."""
    for call in gw.limiter.settle(ticket, tokens, key.limits, time.time()):
        gw.spawn(_add_used(gw, call.call))


async def _add_used(gw: Gateway, call: tuple[str, str, str, int]) -> None:
    try:
        await gw.store.add_used(*call)
    except Exception as exc:
        _unreachable(gw, exc)


def _unreachable(gw: Gateway, exc: Exception) -> None:
    now = time.monotonic()
    if now - gw.limits_warned >= WARN_EVERY:
        gw.limits_warned = now
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
    return limit_headers(gw.limiter, key.name, limits, time.time())


async def add_rate_headers(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: every answer to a limited key carries its headers, the
    streams' and the errors' too."""
    headers = request.get(RATE_HEADERS)
    if headers:
        for name, value in headers.items():
            response.headers.setdefault(name, value)
