"""A load generator: streaming chat completions through the gateway with the official
``openai`` client, at a set concurrency, while something else happens.

``Load`` runs ``concurrency`` workers; each sends one streaming request after another
until the load is stopped (or its ``seconds`` are up) and records what the client saw of
each (``Request``). Every request ends as exactly one of:

- completed: a chunk with a ``finish_reason`` arrived;
- refused: it failed before its first chunk (an HTTP error status, a connection refused
  or reset, a timeout): its status (None without one) and message are kept;
- cut: chunks arrived, then the stream raised or ended without its final chunk.

Two ways to run it:

- ``with running_load(...) as load:`` runs it in a thread of its own (its own event
  loop) while the block runs (``apply`` in a subprocess, say); leaving the block stops
  new requests and waits for those in flight to end, so the figures are complete.
- ``await load.run(until=...)`` inside an event loop, next to other coroutines (the
  soak's kill loop: tests/integration/soak.py).

``totals()`` is one line of figures, ``failures()`` the detail of each failure, for a
failing assertion's message. ``access_log`` reads the gateway's JSON access lines.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai

from tests.waiting import wait_until

MESSAGES = [{"role": "user", "content": "Tell me a short story."}]


@dataclass
class Request:
    """One request as the client saw it (wall times)."""

    started: float
    ended: float = 0.0
    opened: bool = False  # the answer's head arrived (create() returned)
    chunks: int = 0  # chunks of the stream received
    complete: bool = False  # a chunk with a finish_reason arrived
    status: int | None = None  # the HTTP status of a refusal (None: no status, a connection error)
    error: str = ""

    @property
    def done(self) -> bool:
        return self.ended > 0

    @property
    def refused(self) -> bool:
        return self.done and not self.complete and self.chunks == 0

    @property
    def cut(self) -> bool:
        return self.done and not self.complete and self.chunks > 0

    def describe(self, t0: float) -> str:
        """``+12.3s..+14.0s refused 503: ...`` (times from ``t0``)."""
        kind = (
            "completed" if self.complete else "refused" if self.refused else f"cut after {self.chunks} chunks"
        )
        status = f" {self.status}" if self.status is not None else ""
        error = f": {self.error}" if self.error else ""
        return f"+{self.started - t0:.1f}s..+{self.ended - t0:.1f}s {kind}{status}{error}"


def _message(exc: Exception) -> str:
    """A failure's text: the gateway's OpenAI error message when it sent one."""
    if isinstance(exc, openai.APIStatusError):
        try:
            error = exc.response.json()["error"]
            return f"{error.get('code') or ''} {error.get('message') or ''}".strip()[:500]
        except (ValueError, KeyError, TypeError, AttributeError, httpx.ResponseNotRead):
            pass
    return f"{type(exc).__name__}: {exc}"[:500]


class Load:
    """Streaming requests for ``model`` at ``concurrency`` through ``base_url`` (…/v1)."""

    def __init__(
        self,
        base_url: str,
        key: str,
        model: str,
        *,
        concurrency: int,
        messages: list[dict[str, str]] | None = None,
        max_tokens: int | None = None,
        timeout: float = 60,
    ) -> None:
        self.base_url = base_url
        self.key = key
        self.model = model
        self.concurrency = concurrency
        self.messages = messages or MESSAGES
        self.max_tokens = max_tokens
        self.timeout = timeout
        self.requests: list[Request] = []
        self.t0 = time.time()
        self.halt = threading.Event()  # set: no new request starts

    # --- the figures --------------------------------------------------------------------

    @property
    def finished(self) -> list[Request]:
        return [r for r in list(self.requests) if r.done]

    @property
    def completed(self) -> list[Request]:
        return [r for r in self.finished if r.complete]

    @property
    def refused(self) -> list[Request]:
        return [r for r in self.finished if r.refused]

    @property
    def cut(self) -> list[Request]:
        return [r for r in self.finished if r.cut]

    def totals(self) -> str:
        refused = Counter(r.status for r in self.refused)
        by_status = ", ".join(
            f"{s if s is not None else 'no status'}: {n}" for s, n in sorted(refused.items(), key=str)
        )
        return (
            f"{self.model} at concurrency {self.concurrency}: {len(self.finished)} requests, "
            f"{len(self.completed)} completed, {len(self.refused)} refused"
            + (f" ({by_status})" if by_status else "")
            + f", {len(self.cut)} cut"
        )

    def failures(self, limit: int = 20) -> str:
        """The totals and each failure (the first ``limit``), one a line."""
        failed = [r for r in self.finished if not r.complete]
        lines = [self.totals()] + [f"  {r.describe(self.t0)}" for r in failed[:limit]]
        if len(failed) > limit:
            lines.append(f"  ... {len(failed) - limit} more")
        return "\n".join(lines)

    # --- running ------------------------------------------------------------------------

    async def _one(self, client: openai.AsyncOpenAI) -> None:
        request = Request(time.time())
        self.requests.append(request)
        extra: dict[str, Any] = {} if self.max_tokens is None else {"max_tokens": self.max_tokens}
        try:
            answer = await client.chat.completions.create(
                model=self.model,
                messages=self.messages,  # type: ignore[arg-type]
                stream=True,
                **extra,
            )
            request.opened = True
            async for chunk in answer:
                request.chunks += 1
                if chunk.choices and chunk.choices[0].finish_reason is not None:
                    request.complete = True
            if not request.complete:
                request.error = "the stream ended without a finish_reason"
        except Exception as exc:  # every failure is counted, whatever its kind
            if isinstance(exc, openai.APIStatusError):
                request.status = exc.status_code
            request.error = _message(exc)
        request.ended = time.time()

    async def _worker(self, client: openai.AsyncOpenAI, until: float | None) -> None:
        while not self.halt.is_set() and (until is None or time.monotonic() < until):
            await self._one(client)

    async def run(self, until: float | None = None) -> None:
        """Send requests until ``halt`` is set or ``until`` (a ``time.monotonic()``)
        passes; returns once the requests in flight have ended."""
        client = openai.AsyncOpenAI(
            base_url=self.base_url,
            api_key=self.key,
            max_retries=0,  # a failure must show, not be hidden by the client's own retries
            timeout=self.timeout,
            http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=self.concurrency * 2)),
        )
        self.t0 = time.time()
        try:
            await asyncio.gather(*(self._worker(client, until) for _ in range(self.concurrency)))
        finally:
            await client.close()


@contextmanager
def running_load(
    base_url: str,
    key: str,
    model: str,
    *,
    concurrency: int,
    warm: int | None = None,
    seconds: float | None = None,
    **options: Any,
) -> Iterator[Load]:
    """Run a ``Load`` in a thread while the block runs. Before the block: ``warm``
    requests have completed (default ``concurrency``: the load flows). After it: no new
    request starts, the ones in flight end (each within the client's timeout)."""
    load = Load(base_url, key, model, concurrency=concurrency, **options)
    until = None if seconds is None else time.monotonic() + seconds
    raised: list[BaseException] = []

    def main() -> None:
        try:
            asyncio.run(load.run(until))
        except BaseException as exc:  # reported to the block's thread
            raised.append(exc)

    thread = threading.Thread(target=main, name=f"load-{model}", daemon=True)
    thread.start()
    try:
        count = concurrency if warm is None else warm

        def flowing() -> bool:
            if raised:
                raise raised[0]
            return len(load.completed) >= count

        wait_until(
            flowing, timeout=60, interval=0.1, what=lambda: f"{count} requests completed: {load.failures(5)}"
        )
        yield load
    finally:
        load.halt.set()
        thread.join(load.timeout + 30)
        assert not thread.is_alive(), f"the load did not stop: {load.failures(5)}"
    if raised:
        raise raised[0]


def access_log(log: Path, model: str) -> list[dict[str, Any]]:
    """The gateway's access log lines (JSON, one a line, in its output) of ``model``."""
    lines = [json.loads(x) for x in log.read_text(errors="replace").splitlines() if x.startswith("{")]
    return [x for x in lines if x.get("model") == model]
