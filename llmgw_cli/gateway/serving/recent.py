"""The gateway's last hour of use, in memory: requests and tokens per (key, model) in
minute buckets. The dashboard's hour columns (``totals``) and its per-model charts
(``per_model``) read it; the stored per-day usage is the store's (``gateway/store/usage.py``).

The clock is a parameter: callers pass ``time.monotonic()`` (minutes are counted on it,
not on the wall clock, so a clock step neither loses nor doubles a minute), tests any
number. A bucket older than the window is dropped when a new minute begins, so memory
holds at most ``MINUTES`` buckets of (key, model) counts.

Contract (concurrency): only the event loop calls it (``Metrics.observe`` and the admin
pages); nothing awaits inside, so no lock. Each worker process has its own; the admin
pages are worker 0's, so with several workers they show worker 0's last hour.
"""

from __future__ import annotations

from typing import NamedTuple

WINDOW = 3600.0  # seconds of use kept (the dashboard's "last hour")
MINUTES = int(WINDOW // 60)


class PerMinute(NamedTuple):
    """A model's counts per minute, ``MINUTES`` each, oldest first; the last one is the
    minute now is in, so far."""

    requests: tuple[int, ...]
    tokens: tuple[int, ...]


class RecentUse:
    """Requests and tokens per (key, model) in minute buckets over the last hour."""

    def __init__(self) -> None:
        self.minutes: dict[int, dict[tuple[str, str], list[int]]] = {}

    def add(self, key: str, model: str, tokens: int, now: float) -> None:
        """One answered request of ``key`` for ``model`` that used ``tokens``."""
        minute = int(now // 60)
        bucket = self.minutes.get(minute)
        if bucket is None:
            bucket = self.minutes[minute] = {}
            for old in [m for m in self.minutes if m <= minute - MINUTES]:
                del self.minutes[old]
        counts = bucket.get((key, model))
        if counts is None:
            counts = bucket[(key, model)] = [0, 0]
        counts[0] += 1
        counts[1] += tokens

    def _window(self, now: float) -> tuple[int, int]:
        current = int(now // 60)
        return current - MINUTES + 1, current

    def totals(self, now: float) -> dict[tuple[str, str], tuple[int, int]]:
        """(requests, tokens) by (key, model) over the last hour."""
        first, last = self._window(now)
        out: dict[tuple[str, str], tuple[int, int]] = {}
        for minute, bucket in self.minutes.items():
            if not first <= minute <= last:
                continue
            for k, (requests, tokens) in bucket.items():
                r, t = out.get(k, (0, 0))
                out[k] = (r + requests, t + tokens)
        return out

    def per_model(self, now: float) -> dict[str, PerMinute]:
        """Each model's requests and tokens (every key's) per minute of the last hour;
        a model nobody used within it is absent."""
        first, last = self._window(now)
        requests: dict[str, list[int]] = {}
        tokens: dict[str, list[int]] = {}
        for minute, bucket in self.minutes.items():
            if not first <= minute <= last:
                continue
            for (_, model), (r, t) in bucket.items():
                if model not in requests:
                    requests[model], tokens[model] = [0] * MINUTES, [0] * MINUTES
                requests[model][minute - first] += r
                tokens[model][minute - first] += t
        return {m: PerMinute(tuple(requests[m]), tuple(tokens[m])) for m in sorted(requests)}
