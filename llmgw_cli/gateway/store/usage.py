"""Usage totals per (day, key, model), counted in memory and written in batches.

Contract: ``record`` runs on the event loop for every request and only adds to a dict;
``batch`` hands the pending totals to the flusher as one batch with a unique id and starts
counting the next. A batch whose write failed is handed out again, with the SAME id and
rows, until ``sent`` says it was written: the store applies a batch id once, so a write
that committed but whose answer was lost is not counted twice, and nothing is lost while
the process lives. What is pending when the process is killed (not stopped) is lost.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime

from llmgw_cli.gateway.store.sqlite import Usage


@dataclass
class _Counts:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    errors: int = 0
    latency_ms: float = 0.0


class Meter:
    def __init__(self) -> None:
        self._pending: dict[tuple[str, str, str], _Counts] = {}
        self._unsent: tuple[str, list[Usage]] | None = None  # the batch handed out, not yet written
        self._day, self._day_from, self._day_to = "", 0.0, 0.0  # the UTC day of `now`, cached

    def record(
        self,
        key: str,
        model: str,
        *,
        prompt: int,
        completion: int,
        error: bool,
        latency_ms: float,
        now: float,
    ) -> None:
        if not self._day_from <= now < self._day_to:
            self._day = datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%d")
            self._day_from = now - now % 86400  # POSIX time: every UTC day is 86,400 s
            self._day_to = self._day_from + 86400
        day = self._day
        counts = self._pending.get((day, key, model))
        if counts is None:
            counts = self._pending[(day, key, model)] = _Counts()
        counts.requests += 1
        counts.prompt_tokens += prompt
        counts.completion_tokens += completion
        counts.errors += error
        counts.latency_ms += latency_ms

    def take(self) -> list[Usage]:
        pending, self._pending = self._pending, {}
        return [
            Usage(d, k, m, c.requests, c.prompt_tokens, c.completion_tokens, c.errors, c.latency_ms)
            for (d, k, m), c in pending.items()
        ]

    def batch(self) -> tuple[str, list[Usage]] | None:
        """The batch to write next: the one handed out and not yet ``sent`` (same id, same
        rows), else the pending totals under a new id; None when there is nothing to write."""
        if self._unsent is None:
            rows = self.take()
            if rows:
                self._unsent = (uuid.uuid4().hex, rows)
        return self._unsent

    def sent(self, batch: str) -> None:
        """The store has the batch ``batch``: it is never handed out again."""
        if self._unsent is not None and self._unsent[0] == batch:
            self._unsent = None

    def pending(self) -> list[Usage]:
        """Not yet written totals (the admin API adds them to the stored ones): the batch
        being written, then the totals counted since."""
        return [
            *(self._unsent[1] if self._unsent is not None else []),
            *(
                Usage(d, k, m, c.requests, c.prompt_tokens, c.completion_tokens, c.errors, c.latency_ms)
                for (d, k, m), c in self._pending.items()
            ),
        ]


def merged(stored: list[Usage], pending: list[Usage]) -> list[Usage]:
    """Stored totals plus the pending ones, one row per (day, key, model)."""
    by: dict[tuple[str, str, str], Usage] = {}
    for u in [*stored, *pending]:
        old = by.get((u.day, u.key, u.model))
        by[(u.day, u.key, u.model)] = (
            u
            if old is None
            else Usage(
                u.day,
                u.key,
                u.model,
                old.requests + u.requests,
                old.prompt_tokens + u.prompt_tokens,
                old.completion_tokens + u.completion_tokens,
                old.errors + u.errors,
                old.latency_ms + u.latency_ms,
            )
        )
    return [by[k] for k in sorted(by)]
