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

from dataclasses import dataclass, replace
from datetime import UTC, datetime
from enum import StrEnum
from typing import Literal

from llmgw_cli.errors import LimitError

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


# --- options as typed (`llmgw keys create|set`) ------------------------------------------

NONE = "none"  # the word that removes a limit in `llmgw keys set`
_UNITS = {"k": 1_000, "m": 1_000_000}  # 100k, 5M (either case)
MOST = 10**15  # far beyond any real limit; keeps every value a 64-bit integer in the stores

FIELDS = ("rpm", "tpm", "max_parallel", "budget", "priority")
OPTIONS = {f: "--" + f.replace("_", "-") for f in FIELDS}  # rpm -> --rpm, max_parallel -> --max-parallel
EXAMPLES = {"rpm": "60", "tpm": "100000 or 100k", "max_parallel": "4"}


def _count(text: str) -> int | None:
    """A positive whole number, ``100k`` or ``5M`` allowed; None when it is not one."""
    body = text.strip()
    if len(body) > 20:
        return None
    scale = _UNITS.get(body[-1:].lower(), 1) if body else 1
    if scale != 1:
        body = body[:-1]
    if not body.isascii() or not body.isdigit():
        return None
    value = int(body) * scale
    return value if 0 < value <= MOST else None


def parse_count(field: str, text: str) -> int:
    """``--rpm``, ``--tpm`` or ``--max-parallel``: a positive whole number."""
    value = _count(text)
    if value is None:
        raise LimitError(f"{OPTIONS[field]} {text!r}: give a positive whole number, e.g. {EXAMPLES[field]}")
    return value


def parse_budget(text: str) -> Budget:
    """``100000/day``, ``5000000/month``, ``100k/day``, ``5M/month``."""
    amount, slash, period = text.partition("/")
    tokens = _count(amount)
    if not slash or tokens is None or period.strip().lower() not in ("day", "month"):
        raise LimitError(
            f"--budget {text!r}: give TOKENS/day or TOKENS/month (a positive number of tokens),"
            " e.g. 100000/day or 5M/month"
        )
    return Budget(tokens, "day" if period.strip().lower() == "day" else "month")


def parse_priority(text: str) -> Priority:
    try:
        return Priority(text.strip().lower())
    except ValueError:
        raise LimitError(f"--priority {text!r}: give high, normal or low") from None


def parse_changes(given: dict[str, str | None]) -> dict[str, object]:
    """The limits an operator typed, by field (``rpm``, ``tpm``, ``max_parallel``,
    ``budget``, ``priority``; None: not given), parsed: only the fields given, each with
    its new value; ``none`` removes a limit (None; ``normal`` for the priority)."""
    changes: dict[str, object] = {}
    for field, text in given.items():
        if field not in FIELDS:
            raise KeyError(field)
        if text is None:
            continue
        if text.strip().lower() == NONE:
            changes[field] = Priority.normal if field == "priority" else None
        elif field == "budget":
            changes[field] = parse_budget(text)
        elif field == "priority":
            changes[field] = parse_priority(text)
        else:
            changes[field] = parse_count(field, text)
    return changes


def changed(limits: Limits, changes: dict[str, object]) -> Limits:
    """``limits`` with ``changes`` (``parse_changes``'s) made; the other fields kept."""
    return replace(limits, **changes)  # type: ignore[arg-type]


def option_args(changes: dict[str, object]) -> list[str]:
    """``changes`` as the options that give them again (``--rpm=60``, ``--budget=none``):
    what a command forwarded to another machine passes on."""
    return [
        f"{OPTIONS[field]}={NONE if value is None else value}"
        for field, value in changes.items()
        if field in FIELDS
    ]


def describe(limits: Limits) -> str:
    """One line for people: ``rpm 60, tpm 100000, parallel 4, budget 100000/day, priority high``."""
    parts = [
        *([f"rpm {limits.rpm}"] if limits.rpm is not None else []),
        *([f"tpm {limits.tpm}"] if limits.tpm is not None else []),
        *([f"parallel {limits.max_parallel}"] if limits.max_parallel is not None else []),
        *([f"budget {limits.budget}"] if limits.budget is not None else []),
        *([f"priority {limits.priority}"] if limits.priority is not Priority.normal else []),
    ]
    return ", ".join(parts) or "none"


# --- as stored and exchanged: plain values, read back as hostile data ---------------------


def as_dict(limits: Limits) -> dict[str, object]:
    """JSON-ready: every field, None where there is no limit."""
    return {
        "rpm": limits.rpm,
        "tpm": limits.tpm,
        "max_parallel": limits.max_parallel,
        "budget": str(limits.budget) if limits.budget is not None else None,
        "priority": str(limits.priority),
    }


def _stored_count(value: object, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MOST:
        raise ValueError(name)
    return value


def from_dict(data: object) -> Limits:
    """``as_dict``'s output, from a store or another machine: ValueError (naming the
    field) unless every field has its shape."""
    if not isinstance(data, dict):
        raise ValueError("limits")
    budget = data.get("budget")
    priority = data.get("priority", "normal")
    if budget is not None and not isinstance(budget, str):
        raise ValueError("budget")
    if not isinstance(priority, str) or priority not in Priority.__members__:
        raise ValueError("priority")
    try:
        parsed = parse_budget(budget) if budget is not None else None
    except LimitError:
        raise ValueError("budget") from None
    return Limits(
        rpm=_stored_count(data.get("rpm"), "rpm"),
        tpm=_stored_count(data.get("tpm"), "tpm"),
        max_parallel=_stored_count(data.get("max_parallel"), "max_parallel"),
        budget=parsed,
        priority=Priority(priority),
    )


# --- counter windows: the ids the stores' counters are kept under (``m:MINUTE``,
# ``d:YYYY-MM-DD``, ``M:YYYY-MM``, UTC), made by core/serving/ratelimit.py -------------------

MINUTE = 60.0
SLOT = 10.0  # seconds: rpm and tpm count in slots this long, six to a sliding minute
SLOTS = 6


def window_end(window: str) -> float:
    """When the window ``window`` ends (Unix time); ValueError for a form not made here."""
    kind, _, rest = window.partition(":")
    if kind in ("m", "s") and rest.isascii() and rest.isdigit() and len(rest) <= 12:
        return (int(rest) + 1) * (MINUTE if kind == "m" else SLOT)
    if kind == "d" and len(rest) == 10:
        return datetime.strptime(rest, "%Y-%m-%d").replace(tzinfo=UTC).timestamp() + 86400
    if kind == "M" and len(rest) == 7:
        first = datetime.strptime(rest, "%Y-%m").replace(tzinfo=UTC)
        following = (
            first.replace(year=first.year + 1, month=1)
            if first.month == 12
            else first.replace(month=first.month + 1)
        )
        return following.timestamp()
    raise ValueError(f"counter window {window!r}: not s:SLOT, m:MINUTE, d:YYYY-MM-DD or M:YYYY-MM")


def parallel_share(max_parallel: int, members: int) -> int:
    """One gateway process's share of a key's ``max_parallel``: ``ceil(max_parallel /
    members)``, at least 1. Every process together therefore allows ``max_parallel``
    when it divides evenly, and up to one request per process when there are more
    processes than ``max_parallel``."""
    return max(1, -(-max_parallel // max(1, members)))
