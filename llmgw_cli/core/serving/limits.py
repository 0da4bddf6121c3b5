"""What one API key may use, as values (pure): rate limits, a token budget, a cap on its
requests in flight and its priority in a model's queue.

- ``rpm`` / ``tpm``: requests and tokens (prompt + completion) per minute, over a sliding
  minute (``core/serving/ratelimit.py``);
- ``budget``: tokens per UTC day or calendar month (UTC), a fixed window: it resets at
  00:00 UTC, or on the first of the month;
- ``max_parallel``: requests in flight at once (every gateway process together);
- ``priority``: ``high`` keys are served before ``normal`` ones, and those before
  ``low`` ones, when a model's queue forms.

Every field None (``normal`` priority) is a key without limits: the request path then
does no limit work at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

Period = Literal["day", "month"]


class Priority(StrEnum):
    high = "high"
    normal = "normal"
    low = "low"

    @property
    def rank(self) -> int:
        """0 is served first."""
        return _RANKS[self]


_RANKS = {Priority.high: 0, Priority.normal: 1, Priority.low: 2}


@dataclass(frozen=True)
class Budget:
    """``tokens`` per ``period`` (``100000/day``, ``5000000/month``)."""

    tokens: int
    period: Period

    def __str__(self) -> str:
        return f"{self.tokens}/{self.period}"


@dataclass(frozen=True)
class Limits:
    rpm: int | None = None
    tpm: int | None = None
    max_parallel: int | None = None
    budget: Budget | None = None
    priority: Priority = Priority.normal

    @property
    def metered(self) -> bool:
        """Whether any counter applies (rpm, tpm or a budget): the request path counts."""
        return self.rpm is not None or self.tpm is not None or self.budget is not None

    @property
    def none(self) -> bool:
        return not self.metered and self.max_parallel is None and self.priority is Priority.normal


NO_LIMITS = Limits()


def parallel_share(max_parallel: int, members: int) -> int:
    """One gateway process's share of a key's ``max_parallel``: ``ceil(max_parallel /
    members)``, at least 1. Every process together therefore allows ``max_parallel``
    when it divides evenly, and up to one request per process when there are more
    processes than ``max_parallel``."""
    return max(1, -(-max_parallel // max(1, members)))
