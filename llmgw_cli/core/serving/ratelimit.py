"""Rate limits and token budgets per API key, shared by every gateway process (pure; the
clock is passed in, the store is called by the shell).

Counters and windows. A key's ``rpm`` counts ``requests`` and its ``tpm`` counts
``tokens`` (prompt and completion), each over a *sliding minute*; its ``budget`` counts
``budget`` tokens over a fixed UTC day or calendar month. The store keeps, per key,
counter and window id, one number: what was used (``s:<slot>``, ``d:YYYY-MM-DD``,
``M:YYYY-MM``, see ``slot_window``, ``day_window``, ``month_window``).

The sliding minute is counted in ``SLOTS`` slots of ``SLOT`` seconds (six of ten): at
``elapsed`` seconds into a slot, the current slot may hold ``limit`` less the five slots
before it and less ``floor(oldest * (1 - elapsed / SLOT))``, ``oldest`` being the slot a
minute back, weighed down as the current slot goes on (the method Cloudflare and others
describe for two minutes, here over ten-second slots). Only the oldest slot is
approximated, as if its traffic had been spread evenly over its ten seconds: any 60 s hold
``limit`` give or take what that assumption misplaces within one slot. The worst case is
a burst at the very end of a slot followed by a steady stream, which can come back up to
ten seconds early (so up to ``limit`` more in the 60 s around it); steady traffic, from
whatever moment it starts, keeps to the limit over every 60 s (a single minute-long
window instead let through about 1.4 times the limit in a minute that began mid-window).

Leases. Asking the store for every request would cost a round trip each; instead each
process leases a share of a window from the store (``lease``: granted only up to the cap it
sends) and takes from it locally (``Allowance``). A lease asks for ``lease_size``: an
eighth of the limit (``LEASES_PER_WINDOW``) divided among the live processes and, for rpm
and tpm, among the six slots of a minute, or more when one request needs more. So:

- *requests never overshoot the cap*: what the store grants in a slot never exceeds it;
- *undershoot*: what a process leased and did not use when the window ends counts as
  used. That is at most one lease per process and window (for rpm and tpm, about an
  eighth of the limit a minute over every process) (a request that asks while a
  batch lease is out asks for exactly what it needs), plus tokens given back by requests
  that used fewer than estimated, and what was leased for a request that another of the
  key's limits then refused (each is used by the next requests while the window runs);
- *tokens overshoot*: a request takes its prompt estimate before it runs; after it, the
  tokens it spent beyond that come from the allowance when it has them, else are added to
  the store unconditionally. So a window may exceed its cap by at most what the requests
  in flight spent beyond their estimates.

Each process keeps one ``Limiter``. ``Limiter.admit`` answers a request with ``Go`` (what
it took, a ``Ticket`` for ``settle``), ``Refused`` (which limit, retry after how long), or a
store call to make first, ``Read`` or ``Lease``; the shell makes it, hands the answer back
(``read``, ``granted``) and asks again::

    while True:
        step = limiter.admit(key.name, limits, tokens, now(), members)
        if isinstance(step, Lease):
            limiter.granted(step, await store.lease(*step.call), now())
        elif isinstance(step, Read):
            limiter.read(step, await store.used(*step.call), now())
        else:
            break

At most one ``Read`` and one ``Lease`` per counter and window, so a few rounds at most.
A key without rpm, tpm or budget gets ``FREE`` at once: no work at all. What a 429 says and
the ``x-ratelimit-*`` headers are in ``core/serving/ratelimit_answer.py``.

Contract (concurrency): the gateway calls these from its event loop only; nothing here
awaits, so the steps of one request interleave with other requests only at the store
calls, and every answer is checked again after them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum

from llmgw_cli.core.serving.limits import MINUTE, SLOT, SLOTS, Limits, Period

LEASES_PER_WINDOW = 8
"""A process leases about ``limit / (LEASES_PER_WINDOW * members)`` at a time: the store
sees about ``LEASES_PER_WINDOW`` leases per window at full use, and a process strands at
most one of them when the window ends."""


class Counter(StrEnum):
    requests = "requests"
    tokens = "tokens"
    budget = "budget"

    @property
    def sliding(self) -> bool:
        """Requests and tokens count over a sliding minute; the budget over a fixed window."""
        return self is not Counter.budget


@dataclass(frozen=True, slots=True)
class Window:
    """A fixed window: its id in the store and its bounds (epoch seconds, UTC)."""

    id: str
    start: float
    end: float

    def resets_in(self, now: float) -> float:
        return max(0.0, self.end - now)


def day_window(now: float) -> Window:
    day = datetime.fromtimestamp(now, UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    start = day.timestamp()
    return Window(f"d:{day:%Y-%m-%d}", start, (day + timedelta(days=1)).timestamp())


def month_window(now: float) -> Window:
    first = datetime.fromtimestamp(now, UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    following = (
        first.replace(year=first.year + 1, month=1)
        if first.month == 12
        else first.replace(month=first.month + 1)
    )
    return Window(f"M:{first:%Y-%m}", first.timestamp(), following.timestamp())


def slot_window(now: float) -> Window:
    """The ``SLOT``-second slot of ``now`` (``s:`` and the slots since the epoch): rpm and
    tpm are counted in these."""
    index = int(now // SLOT)
    return Window(f"s:{index}", index * SLOT, (index + 1) * SLOT)


def earlier_slots(window: Window) -> tuple[str, ...]:
    """The ids of the ``SLOTS`` slots before ``window``, oldest first."""
    index = int(window.start // SLOT)
    return tuple(f"s:{index - n}" for n in range(SLOTS, 0, -1))


def sliding_cap(limit: int, before: tuple[int, ...], elapsed: float) -> int:
    """What the current slot may hold ``elapsed`` seconds into it: ``limit`` less the
    ``SLOTS - 1`` slots before it and the oldest one (``before[0]``, the slot a minute
    back) weighed down as the current slot goes on."""
    weight = 1.0 - min(max(elapsed, 0.0), SLOT) / SLOT
    return max(0, limit - sum(before[1:]) - math.floor(before[0] * weight))


def sliding_wait(limit: int, before: tuple[int, ...], used: int, need: int, elapsed: float) -> float | None:
    """Seconds until the sliding cap admits ``need`` more when the current slot holds
    ``used`` (if nobody else takes any meanwhile), to the millisecond after the exact
    moment; None when ``need`` exceeds ``limit``. Slot by slot: the counts known move one
    slot back at each boundary, later slots holding nothing."""
    if need > limit:
        return None
    elapsed = min(max(elapsed, 0.0), SLOT)
    if sliding_cap(limit, before, elapsed) >= used + need:
        return 0.0
    counts = (*before, used, *([0] * SLOTS))
    for ahead in range(SLOTS + 1):
        prior, here = counts[ahead : ahead + SLOTS], counts[ahead + SLOTS]
        room = limit - sum(prior[1:]) - here - need
        if room < 0:
            continue  # not in this slot, whatever the oldest one weighs
        # floor(oldest * (1 - e/SLOT)) <= room once oldest * (1 - e/SLOT) < room + 1
        oldest = prior[0]
        at = 0.0 if oldest <= room else SLOT * (1.0 - (room + 1) / oldest)
        since = elapsed if ahead == 0 else 0.0
        return ahead * SLOT - elapsed + max(at, since) + _AFTER
    return None  # unreachable: SLOTS + 1 slots on, every count known has gone


_AFTER = 0.001  # the cap admits just after the moment computed
NOTHING_BEFORE = (0,) * SLOTS


def lease_size(limit: int, members: int, windows: int = 1) -> int:
    """What one lease asks for: ``max(1, ceil(limit / (LEASES_PER_WINDOW * members *
    windows)))``; ``windows``: how many windows the limit spans (``SLOTS`` for rpm and
    tpm), so that what every process may strand is an eighth of the limit in all."""
    return max(1, math.ceil(limit / (LEASES_PER_WINDOW * max(1, members) * windows)))


def budget_window(period: Period, now: float) -> Window:
    return month_window(now) if period == "month" else day_window(now)


def window_of(counter: Counter, now: float, limits: Limits) -> Window:
    if counter.sliding:
        return slot_window(now)
    return budget_window(limits.budget.period if limits.budget is not None else "day", now)


# What ``admit`` answers. A call the shell makes (``Read``, ``Lease``) carries the store's
# arguments as ``call``.


@dataclass(frozen=True, slots=True)
class Ticket:
    """What an admitted request took: its token estimate and the windows it was taken in
    (``settle`` gives back or adds the difference once the request's usage is known)."""

    key: str
    tokens: int
    windows: tuple[tuple[Counter, str], ...]


@dataclass(frozen=True, slots=True)
class Go:
    ticket: Ticket | None  # None: nothing was counted (a key without rpm, tpm or budget)


FREE = Go(None)


@dataclass(frozen=True, slots=True)
class Refused:
    """``counter``'s limit refuses the request; ``retry_after`` seconds (an estimate from
    what this process knows), None when the request alone exceeds the limit."""

    counter: Counter
    limit: int
    requested: int
    retry_after: float | None
    period: str = "minute"  # the budget's: "day" or "month"


@dataclass(frozen=True, slots=True)
class Read:
    """Read ``used(key, counter, windows)``: the ``SLOTS`` slots before the current one
    (oldest first) and the current one."""

    key: str
    counter: Counter
    windows: tuple[str, ...]

    @property
    def call(self) -> tuple[str, str, list[str]]:
        return self.key, self.counter.value, list(self.windows)


@dataclass(frozen=True, slots=True)
class Lease:
    """Ask ``lease(key, counter, window, want, cap)``."""

    key: str
    counter: Counter
    window: str
    want: int
    cap: int
    batch: bool  # asks for more than the request needs (one such lease out at a time)

    @property
    def call(self) -> tuple[str, str, str, int, int]:
        return self.key, self.counter.value, self.window, self.want, self.cap


@dataclass(frozen=True, slots=True)
class AddUsed:
    """Add ``n`` (negative: subtract) to the store's count: ``add_used(key, counter, window, n)``."""

    key: str
    counter: Counter
    window: str
    n: int

    @property
    def call(self) -> tuple[str, str, str, int]:
        return self.key, self.counter.value, self.window, self.n


Step = Go | Refused | Read | Lease


class Allowance:
    """One process's share of one key's counter in the current window.

    State: ``window``; ``held``, leased from the store and not taken yet; ``leased``, all
    this process leased in the window; ``floor``, what the store's count of the window is
    known to be at least (what we leased, or the cap a short lease met); ``before``, the
    store's counts of the ``SLOTS`` slots before this one (sliding counters; None until
    read); ``batching``, whether a batch lease is out; ``full``, whether a lease came back short (the store was
    at the cap). A new window resets them all: what was held is dropped
    (it counts as used in the store: the undershoot).
    """

    __slots__ = (
        "batching",
        "before",
        "counter",
        "floor",
        "full",
        "held",
        "leased",
        "limit",
        "period",
        "window",
    )

    def __init__(self, counter: Counter, limit: int, window: Window, period: str = "minute") -> None:
        self.counter = counter
        self.limit = limit
        self.period = period  # "minute", or the budget's "day" or "month"
        self.window = window
        self._reset(window)

    def _reset(self, window: Window) -> None:
        self.window = window
        self.held = 0
        self.leased = 0
        self.floor = 0
        # the counts of the SLOTS slots before this one (sliding counters; None until read)
        self.before: tuple[int, ...] | None = None if self.counter.sliding else ()
        self.batching = False
        self.full = False

    def roll(self, window: Window) -> None:
        if window.id != self.window.id:
            self._reset(window)

    def cap(self, now: float) -> int:
        """What the store may hold for this window now (``before`` read)."""
        if not self.counter.sliding:
            return self.limit
        return sliding_cap(self.limit, self.before or NOTHING_BEFORE, now - self.window.start)

    def need(self, key: str, n: int, now: float, members: int) -> Refused | Read | Lease | None:
        """None when ``n`` can be taken at once; else what to do first, or the refusal."""
        if n <= self.held:
            return None
        if n > self.limit:
            return Refused(self.counter, self.limit, n, None, self.period)
        if self.before is None:
            return Read(key, self.counter, (*earlier_slots(self.window), self.window.id))
        short = n - self.held
        size = lease_size(self.limit, members, SLOTS if self.counter.sliding else 1)
        # Once the store was found full, it is asked again when the cap has grown by a
        # whole lease: in a minute used to its cap the cap grows a unit at a time, and
        # asking at each would cost a store call per request.
        room = max(short, size) if self.full else short
        cap = self.cap(now)
        if cap < self.floor + room:
            return Refused(self.counter, self.limit, n, self.wait(room, now), self.period)
        if self.batching:  # a batch lease is out: ask for just what this request needs
            return Lease(key, self.counter, self.window.id, short, cap, batch=False)
        return Lease(key, self.counter, self.window.id, max(size, short), cap, batch=True)

    def wait(self, short: int, now: float) -> float:
        """Seconds until the store can grant ``short`` more, by what this process knows."""
        if not self.counter.sliding:
            return self.window.resets_in(now)
        elapsed = now - self.window.start
        found = sliding_wait(self.limit, self.before or NOTHING_BEFORE, self.floor, short, elapsed)
        return self.window.resets_in(now) if found is None else found

    def read(self, windows: tuple[str, ...], used: dict[str, int]) -> None:
        if windows[-1] == self.window.id:
            self.before = tuple(max(0, used.get(w, 0)) for w in windows[:-1])
            self.floor = max(self.floor, used.get(windows[-1], 0))

    def granted(self, lease: Lease, got: int) -> None:
        if lease.window != self.window.id:
            return  # leased for a window that has ended: it counts as used there
        if lease.batch:
            self.batching = False
        got = max(0, got)
        self.held += got
        self.leased += got
        self.floor = max(self.floor, self.leased)
        if got < lease.want:
            self.floor = max(self.floor, lease.cap)  # the store holds the cap (or more)
            self.full = True

    def failed(self, lease: Lease) -> None:
        """The lease's store call failed: another batch lease may be asked."""
        if lease.batch and lease.window == self.window.id:
            self.batching = False

    def take(self, n: int) -> None:
        self.held -= n

    def give_back(self, n: int) -> None:
        """Tokens a request took and did not use: for the next requests of this window."""
        self.held += n

    def spend(self, n: int) -> int:
        """``n`` tokens spent beyond what was taken: from what is held, and the rest (the
        return value) to add to the store unconditionally."""
        own = min(self.held, n)
        self.held -= own
        rest = n - own
        self.floor += rest
        return rest

    def spent(self) -> int:
        """What this process knows the key has used in this window."""
        return max(0, self.floor - self.held)

    def remaining(self, now: float) -> int:
        """An estimate of what the key may still use now: the cap less what is known used,
        plus what this process holds."""
        if self.before is None:
            return max(0, self.limit - self.spent())
        return max(0, self.cap(now) - self.floor) + self.held

    def reset_in(self, now: float) -> float:
        """Seconds until what is known used no longer counts: a budget's window end; for a
        sliding counter, a minute after the end of the newest slot that used some."""
        if not self.counter.sliding:
            return self.window.resets_in(now) if self.spent() > 0 else 0.0
        if self.spent() > 0:
            return self.window.resets_in(now) + MINUTE
        before = self.before or ()
        for back, count in enumerate(reversed(before)):  # 0: the slot just before this one
            if count:
                return self.window.resets_in(now) + MINUTE - (back + 1) * SLOT
        return 0.0


_COUNTERS = (Counter.budget, Counter.requests, Counter.tokens)


def _limit_of(limits: Limits, counter: Counter) -> int | None:
    if counter is Counter.requests:
        return limits.rpm
    if counter is Counter.tokens:
        return limits.tpm
    return limits.budget.tokens if limits.budget is not None else None


class Limiter:
    """The allowances of one process, per (key, counter); see the module's docstring."""

    def __init__(self) -> None:
        self.allowances: dict[tuple[str, Counter], Allowance] = {}

    def allowance(self, key: str, counter: Counter, limits: Limits, now: float) -> Allowance | None:
        """The current allowance of ``key``'s ``counter`` (None: no such limit)."""
        limit = _limit_of(limits, counter)
        if limit is None:
            return None
        period = limits.budget.period if counter is Counter.budget and limits.budget else "minute"
        found = self.allowances.get((key, counter))
        if found is not None and found.period == period and found.window.start <= now < found.window.end:
            found.limit = limit  # the window runs: no need to work it out again (the hot path)
            return found
        window = window_of(counter, now, limits)
        if found is None:
            found = self.allowances[key, counter] = Allowance(counter, limit, window, period)
        else:
            found.limit, found.period = limit, period
            found.roll(window)
        return found

    def admit(self, key: str, limits: Limits, tokens: int, now: float, members: int = 1) -> Step:
        """Admit one request of ``key`` estimated at ``tokens`` (its prompt): ``Go`` when
        every counter had enough (and it is taken), else the refusal or the store call to
        make first. A refusal known here wins over a store call, so a request that will be
        refused leases nothing."""
        if not limits.metered:
            return FREE
        tokens = max(0, tokens)
        first: tuple[Read | Lease, Allowance] | None = None
        taking: list[tuple[Allowance, int]] = []
        refused: Refused | None = None
        for counter in _COUNTERS:
            allowance = self.allowance(key, counter, limits, now)
            if allowance is None:
                continue
            n = 1 if counter is Counter.requests else tokens
            step = allowance.need(key, n, now, members)
            if step is None:
                taking.append((allowance, n))
            elif isinstance(step, Refused):
                refused = _longer(refused, step)
            elif first is None:
                first = step, allowance
        if refused is not None:
            return refused
        if first is not None:
            call, allowance = first
            if isinstance(call, Lease) and call.batch:
                allowance.batching = True  # until granted (or failed)
            return call
        windows = []
        for allowance, n in taking:
            allowance.take(n)
            if allowance.counter is not Counter.requests:
                windows.append((allowance.counter, allowance.window.id))
        return Go(Ticket(key, tokens, tuple(windows)))

    def read(self, step: Read, used: dict[str, int], now: float) -> None:
        found = self.allowances.get((step.key, step.counter))
        if found is not None:
            found.read(step.windows, used)

    def granted(self, step: Lease, got: int, now: float) -> None:
        found = self.allowances.get((step.key, step.counter))
        if found is not None:
            found.granted(step, got)

    def failed(self, step: Lease) -> None:
        """The store call of ``step`` failed (the shell refuses or lets the request pass)."""
        found = self.allowances.get((step.key, step.counter))
        if found is not None:
            found.failed(step)

    def settle(self, ticket: Ticket | None, tokens: int, limits: Limits, now: float) -> list[AddUsed]:
        """The request of ``ticket`` used ``tokens`` in all: what it did not use goes back
        to the allowance (when its window still runs); what it used beyond its estimate is
        taken from the allowance, and the rest is returned as store calls to make."""
        if ticket is None:
            return []
        extra = max(0, tokens) - ticket.tokens
        calls: list[AddUsed] = []
        for counter, window in ticket.windows:
            allowance = self.allowance(ticket.key, counter, limits, now)
            if allowance is None:
                continue
            if extra < 0:
                if allowance.window.id == window:
                    allowance.give_back(-extra)
            elif extra > 0:
                rest = allowance.spend(extra)
                if rest:
                    calls.append(AddUsed(ticket.key, counter, allowance.window.id, rest))
        return calls

    def prune(self, now: float) -> None:
        """Forget the allowances of windows that have ended (keys idle since)."""
        stale = [k for k, a in self.allowances.items() if a.window.end <= now]
        for k in stale:
            del self.allowances[k]

    def forget(self, key: str) -> None:
        for counter in _COUNTERS:
            self.allowances.pop((key, counter), None)


def _longer(known: Refused | None, new: Refused) -> Refused:
    """The refusal that lasts longer (a request over the limit itself: the longest)."""
    if known is None:
        return new
    if known.retry_after is None:
        return known
    if new.retry_after is None or new.retry_after > known.retry_after:
        return new
    return known
