"""Rate limits and budgets per key: windows, the sliding cap, leases and their bounds, with
a fake clock and an in-memory stand-in for the store (``Store`` below: the store's
``lease``, ``add_used`` and ``used`` as the shared stores define them)."""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass, field
from datetime import UTC, datetime

import pytest

from llmgw_cli.core.serving.limits import Budget, Limits, parallel_share
from llmgw_cli.core.serving.ratelimit import (
    FREE,
    AddUsed,
    Counter,
    Go,
    Lease,
    Limiter,
    Read,
    Refused,
    Step,
    Ticket,
    day_window,
    earlier_slots,
    lease_size,
    month_window,
    sliding_cap,
    sliding_wait,
    slot_window,
)

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC).timestamp()  # the start of a minute (and a slot)
EMPTY = (0, 0, 0, 0, 0, 0)  # six slots before the current one that hold nothing


def at(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


@dataclass
class Store:
    """The store's three calls, in memory (one shared by every simulated process)."""

    counts: dict[tuple[str, str, str], int] = field(default_factory=dict)
    calls: int = 0

    def lease(self, key: str, counter: str, window: str, want: int, cap: int) -> int:
        self.calls += 1
        used = self.counts.get((key, counter, window), 0)
        granted = max(0, min(want, cap - used))
        self.counts[key, counter, window] = used + granted
        return granted

    def add_used(self, key: str, counter: str, window: str, n: int) -> None:
        self.calls += 1
        self.counts[key, counter, window] = self.counts.get((key, counter, window), 0) + n

    def used(self, key: str, counter: str, windows: list[str]) -> dict[str, int]:
        self.calls += 1
        return {w: self.counts.get((key, counter, w), 0) for w in windows}


@dataclass
class Shell:
    """What the gateway's shell does for one process: the store calls its limiter asks for."""

    limiter: Limiter
    store: Store

    def admit(self, key: str, limits: Limits, tokens: int, now: float, members: int = 1) -> Step:
        for _ in range(10):
            step = self.limiter.admit(key, limits, tokens, now, members)
            if isinstance(step, Lease):
                self.limiter.granted(step, self.store.lease(*step.call), now)
            elif isinstance(step, Read):
                self.limiter.read(step, self.store.used(*step.call), now)
            else:
                return step
        raise AssertionError("the limiter kept asking for store calls")

    def settle(self, ticket: Ticket | None, tokens: int, limits: Limits, now: float) -> None:
        for call in self.limiter.settle(ticket, tokens, limits, now):
            self.store.add_used(*call.call)


# Windows


def test_slots_are_numbered_from_the_epoch() -> None:
    window = slot_window(T0 + 9.999)
    index = int(T0 // 10)
    assert window.id == f"s:{index}" and window.start == T0 and window.end == T0 + 10
    assert slot_window(T0 + 10).id == f"s:{index + 1}"
    assert window.resets_in(T0 + 7.5) == 2.5 and window.resets_in(T0 + 11) == 0
    assert earlier_slots(window) == tuple(f"s:{index - n}" for n in (6, 5, 4, 3, 2, 1))


def test_day_and_month_windows_are_utc_calendar_ones() -> None:
    day = day_window(at("2026-12-31T23:59:59.5"))
    assert day.id == "d:2026-12-31" and day.start == at("2026-12-31T00:00:00")
    assert day.end == at("2027-01-01T00:00:00") and day.resets_in(at("2026-12-31T23:59:59.5")) == 0.5
    assert day_window(at("2027-01-01T00:00:00")).id == "d:2027-01-01"
    december = month_window(at("2026-12-15T08:00:00"))
    assert december.id == "M:2026-12" and december.end == at("2027-01-01T00:00:00")
    february = month_window(at("2028-02-29T23:00:00"))  # a leap year
    assert february.id == "M:2028-02" and february.start == at("2028-02-01T00:00:00")
    assert february.end == at("2028-03-01T00:00:00")


# The sliding cap


def test_sliding_cap_counts_five_slots_and_weighs_the_oldest_down() -> None:
    oldest = (100, 0, 0, 0, 0, 0)  # a full slot a minute back
    assert sliding_cap(100, oldest, 0) == 0
    assert sliding_cap(100, oldest, 5) == 50
    assert sliding_cap(100, oldest, 10) == 100
    assert sliding_cap(100, EMPTY, 0) == 100
    assert sliding_cap(100, (0, 10, 10, 10, 10, 10), 0) == 50  # the five after it count whole
    assert sliding_cap(100, (10, 0, 0, 0, 0, 0), 1) == 91  # floor(10 * 9/10) = 9
    assert sliding_cap(100, (0, 50, 50, 50, 0, 0), 5) == 0  # never negative
    assert sliding_cap(100, oldest, -5) == 0 and sliding_cap(100, oldest, 15) == 100  # clamped


def admits(limit: int, before: tuple[int, ...], used: int, need: int, at: float) -> bool:
    """Whether ``need`` more fit ``at`` seconds from the current slot's start (later slots:
    the counts move back a slot at each boundary, new slots holding nothing)."""
    ahead = int(at // 10)
    counts = (*before, used, *([0] * 7))
    prior, here = counts[ahead : ahead + 6], counts[ahead + 6]
    return sliding_cap(limit, prior, at - ahead * 10) >= here + need


@pytest.mark.parametrize("seed", range(5))
def test_sliding_wait_is_the_first_moment_the_cap_admits(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(400):
        limit = rng.randint(1, 500)
        before = tuple(rng.randint(0, limit // 3) for _ in range(6))
        used, need, elapsed = rng.randint(0, limit), rng.randint(1, limit), rng.uniform(0, 10)
        wait = sliding_wait(limit, before, used, need, elapsed)
        assert wait is not None and wait >= 0
        when = elapsed + wait
        assert admits(limit, before, used, need, when), (limit, before, used, need, elapsed, wait)
        if wait > 0.002:  # and not a little before
            assert not admits(limit, before, used, need, when - 0.002)
    assert sliding_wait(10, EMPTY, 0, 11, 0) is None  # more than the limit: never


def test_lease_size_is_a_share_of_an_eighth_of_the_limit() -> None:
    assert lease_size(100, 1) == 13 and lease_size(100, 4) == 4
    assert lease_size(1, 4) == 1 and lease_size(100_000, 3) == 4167
    # rpm and tpm: a share of each of a minute's six slots
    assert lease_size(100, 1, 6) == 3 and lease_size(100_000, 3, 6) == 695


def test_a_process_share_of_a_parallel_cap() -> None:
    assert [parallel_share(8, n) for n in (1, 2, 3, 4, 8, 16)] == [8, 4, 3, 2, 1, 1]
    assert parallel_share(1, 0) == 1


# One process's allowance


RPM = Limits(rpm=100)


def test_a_key_without_limits_costs_nothing() -> None:
    limiter = Limiter()
    assert limiter.admit("k", Limits(max_parallel=3), 500, T0) is FREE
    assert limiter.allowances == {} and limiter.settle(None, 900, Limits(), T0) == []


def test_the_first_request_reads_the_slots_before_then_leases_a_share() -> None:
    limiter = Limiter()
    now = T0 + 35  # five seconds into the slot from T0 + 30
    step = limiter.admit("k", RPM, 0, now, members=2)
    slot = slot_window(now)
    earlier = earlier_slots(slot)
    assert step == Read("k", Counter.requests, (*earlier, slot.id))
    limiter.read(step, {earlier[0]: 80, earlier[5]: 10, slot.id: 5}, now)
    lease = limiter.admit("k", RPM, 0, now, members=2)
    # cap: 100 - 10 - floor(80 * 0.5) = 50; size: ceil(100 / (8 x 2 x 6)) = 2
    assert lease == Lease("k", Counter.requests, slot.id, 2, 50, batch=True)
    limiter.granted(lease, 2, now)
    for _ in range(2):  # from the allowance: no store call
        assert isinstance(limiter.admit("k", RPM, 0, now + 1, members=2), Go)
    again = limiter.admit("k", RPM, 0, now + 1, members=2)
    assert isinstance(again, Lease) and again.cap == sliding_cap(100, (80, 0, 0, 0, 0, 10), 6)


def test_one_batch_lease_at_a_time_others_ask_for_what_they_need() -> None:
    shell = Shell(Limiter(), Store())
    limiter, store = shell.limiter, shell.store
    assert isinstance(shell.admit("k", Limits(tpm=8000), 10, T0), Go)
    allowance = limiter.allowances["k", Counter.tokens]
    allowance.held = 0
    first = limiter.admit("k", Limits(tpm=8000), 300, T0 + 1)
    second = limiter.admit("k", Limits(tpm=8000), 200, T0 + 1)  # while the first is out
    assert isinstance(first, Lease) and first.batch and first.want == 300  # a lease (167) is less
    assert isinstance(second, Lease) and not second.batch and second.want == 200
    limiter.granted(second, store.lease(*second.call), T0 + 1)
    limiter.granted(first, store.lease(*first.call), T0 + 1)
    third = limiter.admit("k", Limits(tpm=8000), 5000, T0 + 1)
    assert isinstance(third, Lease) and third.batch and third.want == 5000 - 500
    limiter.failed(third)  # the store call failed: another batch may be asked
    assert not allowance.batching


def test_a_short_lease_refuses_until_the_cap_has_grown_by_a_lease() -> None:
    shell = Shell(Limiter(), Store())
    store = shell.store
    store.counts["k", "requests", earlier_slots(slot_window(T0))[0]] = 100  # a full slot a minute back
    now = T0 + 1  # cap: 100 - floor(100 * 0.9) = 10
    passed = [shell.admit("k", RPM, 0, now) for _ in range(12)]
    assert [isinstance(s, Go) for s in passed] == [True] * 10 + [False] * 2
    refused = passed[-1]
    assert isinstance(refused, Refused) and refused.counter is Counter.requests and refused.limit == 100
    # The store holds 10: a lease (3) fits once 100 - floor(100 * (1 - e/10)) >= 13,
    # just after 100 * (1 - e/10) = 88.
    assert refused.retry_after == pytest.approx(10 * (1 - 88 / 100) - 1 + 0.001)
    calls = store.calls
    assert isinstance(shell.admit("k", RPM, 0, T0 + 1.1), Refused)  # cap 11: not asked
    assert store.calls == calls
    assert refused.retry_after is not None
    assert isinstance(shell.admit("k", RPM, 0, now + refused.retry_after), Go)


def test_a_new_window_drops_what_was_held() -> None:
    shell = Shell(Limiter(), Store())
    limiter, store = shell.limiter, shell.store
    assert isinstance(shell.admit("k", RPM, 0, T0 + 9), Go)
    assert limiter.allowances["k", Counter.requests].held == 2  # leased 3, took 1
    step = limiter.admit("k", RPM, 0, T0 + 10)
    assert isinstance(step, Read)  # the new slot: nothing held, the slots before it to read
    assert limiter.allowances["k", Counter.requests].held == 0
    assert store.counts["k", "requests", slot_window(T0).id] == 3  # the 2 count as used
    limiter.read(step, store.used(*step.call), T0 + 10)
    lease = limiter.admit("k", RPM, 0, T0 + 10)
    assert isinstance(lease, Lease) and lease.cap == 100 - 3


def test_a_lease_answered_after_its_window_ended_is_not_used_in_the_next() -> None:
    shell = Shell(Limiter(), Store())
    limiter, store = shell.limiter, shell.store
    shell.admit("k", RPM, 0, T0 + 9)
    limiter.allowances["k", Counter.requests].held = 0
    late = limiter.admit("k", RPM, 0, T0 + 9.9)
    assert isinstance(late, Lease)
    assert isinstance(limiter.admit("k", RPM, 0, T0 + 10.1), Read)  # the window rolled
    limiter.granted(late, store.lease(*late.call), T0 + 10.1)
    assert limiter.allowances["k", Counter.requests].held == 0


def test_a_request_larger_than_the_limit_is_refused_for_good() -> None:
    limiter = Limiter()
    step = limiter.admit("k", Limits(tpm=1000), 1001, T0)
    assert step == Refused(Counter.tokens, 1000, 1001, None)
    budget = limiter.admit("k", Limits(budget=Budget(500, "month")), 501, T0)
    assert budget == Refused(Counter.budget, 500, 501, None, "month")


def test_a_refusal_known_here_wins_over_a_store_call() -> None:
    """No lease is asked for a request another counter refuses, and no batch is left
    marked as out."""
    shell = Shell(Limiter(), Store())
    limiter = shell.limiter
    limits = Limits(rpm=100, tpm=1000)
    assert isinstance(shell.admit("k", limits, 900, T0), Go)
    assert limiter.allowances["k", Counter.tokens].floor == 900  # 200 more would pass the cap
    limiter.allowances["k", Counter.requests].held = 0  # requests would need a lease
    step = limiter.admit("k", limits, 200, T0 + 1)
    assert isinstance(step, Refused) and step.counter is Counter.tokens
    assert not limiter.allowances["k", Counter.requests].batching


def test_budgets_count_in_fixed_windows_and_refuse_until_they_renew() -> None:
    shell = Shell(Limiter(), Store())
    limiter = shell.limiter
    limits = Limits(budget=Budget(1000, "day"))
    now = at("2026-03-01T22:00:00")
    first = limiter.admit("k", limits, 600, now)
    assert first == Lease("k", Counter.budget, "d:2026-03-01", 600, 1000, batch=True)  # no read
    limiter.failed(first)
    assert isinstance(shell.admit("k", limits, 600, now), Go)
    refused = shell.admit("k", limits, 600, now + 60)
    assert refused == Refused(Counter.budget, 1000, 600, 7140.0, "day")
    assert isinstance(shell.admit("k", limits, 600, at("2026-03-02T00:00:00")), Go)


def test_budget_and_minute_limits_together() -> None:
    shell = Shell(Limiter(), Store())
    limits = Limits(rpm=10, tpm=10_000, budget=Budget(3000, "month"))
    now = at("2026-03-31T23:59:00")
    steps = [shell.admit("k", limits, 1000, now + i) for i in range(4)]
    assert [isinstance(s, Go) for s in steps] == [True, True, True, False]
    refused = steps[3]
    assert isinstance(refused, Refused) and refused.counter is Counter.budget and refused.period == "month"
    assert refused.retry_after == pytest.approx(57)  # to 1 April, 00:00 UTC
    go = steps[0]
    assert isinstance(go, Go) and go.ticket is not None
    assert go.ticket.windows == ((Counter.budget, "M:2026-03"), (Counter.tokens, slot_window(now).id))


# Settling a request's tokens


def test_settle_gives_back_what_was_not_used_and_adds_what_was() -> None:
    shell = Shell(Limiter(), Store())
    limiter, store = shell.limiter, shell.store
    limits = Limits(tpm=480_000)  # leases of 10,000 (480,000 / 8 / 6)
    go = shell.admit("k", limits, 1000, T0)
    assert isinstance(go, Go)
    tokens = limiter.allowances["k", Counter.tokens]
    assert tokens.held == 9000
    shell.settle(go.ticket, 400, limits, T0 + 1)  # used fewer: 600 back
    assert tokens.held == 9600
    go = shell.admit("k", limits, 1000, T0 + 2)
    assert isinstance(go, Go)
    shell.settle(go.ticket, 9000, limits, T0 + 3)  # 8,000 more, all held
    assert tokens.held == 600 and store.counts["k", "tokens", slot_window(T0).id] == 10_000
    go = shell.admit("k", limits, 600, T0 + 4)
    assert isinstance(go, Go) and tokens.held == 0
    calls = limiter.settle(go.ticket, 2600, limits, T0 + 5)  # 2,000 beyond: to the store
    assert calls == [AddUsed("k", Counter.tokens, slot_window(T0).id, 2000)]
    assert tokens.floor == 12_000  # the store's count is known to include them


def test_settle_after_the_window_ended() -> None:
    shell = Shell(Limiter(), Store())
    limiter = shell.limiter
    limits = Limits(tpm=480_000, budget=Budget(10**6, "day"))  # leases of 10,000 and 125,000
    one, two = (shell.admit("k", limits, 1000, T0 + 59) for _ in range(2))
    assert isinstance(one, Go) and isinstance(two, Go)
    budget = limiter.allowances["k", Counter.budget]
    assert budget.held == 123_000
    # Fewer tokens than taken: nothing goes back to a slot that has ended (the day runs).
    assert limiter.settle(one.ticket, 0, limits, T0 + 61) == []
    assert limiter.allowances["k", Counter.tokens].held == 0 and budget.held == 124_000
    # More: counted in the window where they are known; the budget's from its allowance.
    calls = limiter.settle(two.ticket, 1500, limits, T0 + 62)
    assert calls == [AddUsed("k", Counter.tokens, slot_window(T0 + 62).id, 500)]
    assert budget.held == 123_500


def test_prune_and_forget() -> None:
    shell = Shell(Limiter(), Store())
    limiter = shell.limiter
    shell.admit("a", RPM, 0, T0)
    shell.admit("b", Limits(budget=Budget(100, "day")), 1, T0)
    limiter.prune(T0 + 61)
    assert list(limiter.allowances) == [("b", Counter.budget)]
    limiter.forget("b")
    assert limiter.allowances == {}


# Many processes sharing the store


def simulate(
    limits: Limits, members: int, per_minute: float, minutes: float, seed: int, *, even: bool = False
) -> tuple[list[float], Store]:
    """``members`` processes, requests arriving at ``per_minute`` (Poisson, or evenly) each
    to a random process; the times of the requests that passed."""
    rng = random.Random(seed)
    store = Store()
    limiters = [Limiter() for _ in range(members)]
    passed: list[float] = []
    now = T0 + 0.001
    while now < T0 + minutes * 60:
        step = Shell(limiters[rng.randrange(members)], store).admit("k", limits, 0, now, members)
        if isinstance(step, Go):
            passed.append(now)
        now += 60 / per_minute if even else rng.expovariate(per_minute / 60)
    return passed, store


def per_sliding_minute(times: list[float], since: float) -> tuple[int, int]:
    """The most and (from ``since`` on) the fewest passed in the 60 s before a pass."""
    most, fewest = 0, 10**9
    for i, t in enumerate(times):
        count = i + 1 - bisect.bisect_right(times, t - 60)
        most = max(most, count)
        if t >= since:
            fewest = min(fewest, count)
    return most, fewest


def bounds(limit: int, members: int) -> tuple[int, int]:
    """The documented bounds of what any 60 s pass under steady demand above the limit:
    below, what every process may strand (a lease per slot); above, the oldest slot's
    approximation (a sixth of the limit) and a lease per process."""
    lease = lease_size(limit, members, 6)
    return limit - 6 * members * lease, limit + -(-limit // 6) + members * lease


@pytest.mark.parametrize(("seed", "even"), [(1, False), (2, False), (3, True)])
def test_four_processes_keep_to_the_limit_over_every_sliding_minute(seed: int, even: bool) -> None:
    """200 requests a minute for 5 minutes against rpm 100, over four processes: every
    60 s passes the limit within the documented bounds, no slot is granted more than the
    limit, and refusals are mostly answered without the store."""
    limit, members = 100, 4
    passed, store = simulate(Limits(rpm=limit), members, 200, 5, seed, even=even)
    low, high = bounds(limit, members)
    most, fewest = per_sliding_minute(passed, since=T0 + 120)
    assert low <= fewest and most <= high, (fewest, most)
    assert max(store.counts.values()) <= limit
    assert len(passed) >= 5 * low
    assert store.calls < 1000  # fewer calls than requests seen


@pytest.mark.parametrize("phase", [0.0, 3.3, 7.7, 25.0, 47.0, 59.0])
def test_steady_demand_starting_at_any_moment_keeps_to_the_limit(phase: float) -> None:
    """A key unused until then, driven at 200 requests a minute against rpm 60 from any
    moment of a minute, over four processes: its first 60 s pass about 60, and so does
    every 60 s after. (One minute-long window let about 83 through here.)"""
    limit, members = 60, 4
    rng = random.Random(5)
    store, limiters = Store(), [Limiter() for _ in range(members)]
    start = now = T0 + phase
    passed: list[float] = []
    while now < start + 180:
        if isinstance(
            Shell(limiters[rng.randrange(members)], store).admit("k", Limits(rpm=limit), 0, now, members), Go
        ):
            passed.append(now)
        now += 0.3
    low, high = bounds(limit, members)
    first = sum(1 for t in passed if t < start + 60)
    most, fewest = per_sliding_minute(passed, since=start + 60)
    assert limit <= first <= high and most <= high and fewest >= low, (first, most, fewest)


def test_four_processes_under_the_limit_pass_everything() -> None:
    passed, store = simulate(Limits(rpm=400), 4, 200, 3, seed=4, even=True)
    assert len(passed) == 600
    assert store.calls < 0.6 * 600  # leases of 3 (400 / (8 x 4 x 6)), a read per process and slot


def test_tokens_overshoot_at_most_what_requests_in_flight_spent_beyond_estimates() -> None:
    """Requests of 100 prompt tokens spending up to 300 more, each in flight 3 s, at 200 a
    minute over four processes against tpm 20,000: each fixed minute's count exceeds the
    limit by no more than what the requests in flight spent beyond their estimates, and
    every token used is counted."""
    tpm, members, extra = 20_000, 4, 300
    limits = Limits(tpm=tpm)
    rng = random.Random(7)
    store = Store()
    limiters = [Limiter() for _ in range(members)]
    running: list[tuple[float, int, Ticket | None, int]] = []  # ends, process, ticket, tokens
    used, most_in_flight = 0, 0
    now = T0 + 0.001
    while now < T0 + 300:
        for done in [r for r in running if r[0] <= now]:
            running.remove(done)
            Shell(limiters[done[1]], store).settle(done[2], done[3], limits, done[0])
            used += done[3]
        process = rng.randrange(members)
        step = Shell(limiters[process], store).admit("k", limits, 100, now, members)
        if isinstance(step, Go):
            running.append((now + 3, process, step.ticket, 100 + rng.randint(0, extra)))
            most_in_flight = max(most_in_flight, len(running))
        now += rng.expovariate(200 / 60)
    slots = sorted((int(w[2:]), n) for (_, counter, w), n in store.counts.items() if counter == "tokens")
    by_slot = dict(slots)
    minutes = [sum(by_slot.get(i + n, 0) for n in range(6)) for i, _ in slots]  # six slots from each
    _, high = bounds(tpm, members)
    assert max(minutes) <= high + most_in_flight * extra
    assert max(minutes) > tpm  # the bound is reached for, not idle
    assert sum(n for _, n in slots) >= used  # nothing used goes uncounted


def test_a_burst_at_the_end_of_a_slot_is_the_approximations_worst_case() -> None:
    """The documented limit of the method: the oldest slot's count is assumed spread
    evenly over its ten seconds, so a full burst in its last instant, then a steady
    stream, passes nearly twice the limit in the 60 s around it; no slot passes more than
    the limit."""
    shell = Shell(Limiter(), Store())
    limits = Limits(rpm=60)
    passed = [T0 - 0.1 for _ in range(60) if isinstance(shell.admit("k", limits, 0, T0 - 0.1), Go)]
    assert len(passed) == 60  # the previous minute was empty: its cap is the limit
    now = T0
    while now < T0 + 60:
        if isinstance(shell.admit("k", limits, 0, now), Go):
            passed.append(now)
        now += 0.1
    in_window = [t for t in passed if T0 - 0.1 <= t < T0 + 59.9]
    assert 110 < len(in_window) <= 2 * 60
    assert max(shell.store.counts.values()) == 60
