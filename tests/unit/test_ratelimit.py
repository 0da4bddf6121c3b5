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
    lease_size,
    minute_window,
    month_window,
    previous_minute,
    sliding_cap,
    sliding_wait,
)

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC).timestamp()  # the start of a minute


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


def test_minute_windows_are_numbered_from_the_epoch() -> None:
    window = minute_window(T0 + 59.999)
    assert window.id == f"m:{int(T0 // 60)}" and window.start == T0 and window.end == T0 + 60
    assert minute_window(T0 + 60).id == f"m:{int(T0 // 60) + 1}"
    assert window.resets_in(T0 + 45) == 15 and window.resets_in(T0 + 61) == 0
    assert previous_minute(window).id == f"m:{int(T0 // 60) - 1}"


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


def test_sliding_cap_weighs_the_previous_minute_down_as_this_one_goes_on() -> None:
    assert sliding_cap(100, 100, 0) == 0
    assert sliding_cap(100, 100, 30) == 50
    assert sliding_cap(100, 100, 60) == 100
    assert sliding_cap(100, 0, 0) == 100
    assert sliding_cap(100, 10, 1) == 91  # floor(10 * 59/60) = 9
    assert sliding_cap(100, 300, 30) == 0  # never negative
    assert sliding_cap(100, 100, -5) == 0 and sliding_cap(100, 100, 75) == 100  # clamped


@pytest.mark.parametrize("seed", range(5))
def test_sliding_wait_is_the_first_moment_the_cap_admits(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(400):
        limit = rng.randint(1, 500)
        prev, used = rng.randint(0, 2 * limit), rng.randint(0, limit)
        need, elapsed = rng.randint(1, limit), rng.uniform(0, 60)
        wait = sliding_wait(limit, prev, used, need, elapsed)
        assert wait is not None and wait >= 0
        when = elapsed + wait
        if when <= 60:  # this minute: the cap admits then, and not a little before
            assert sliding_cap(limit, prev, when) >= used + need
            if wait > 0.002:
                assert sliding_cap(limit, prev, when - 0.002) < used + need
        else:  # the next minute, where this one's count is the previous one
            assert sliding_cap(limit, prev, 60) < used + need
            assert sliding_cap(limit, used, when - 60) >= need
            if when - 60 > 0.002:
                assert sliding_cap(limit, used, when - 60 - 0.002) < need
    assert sliding_wait(10, 0, 0, 11, 0) is None  # more than the limit: never


def test_lease_size_is_a_share_of_an_eighth_of_the_limit() -> None:
    assert lease_size(100, 1) == 13 and lease_size(100, 4) == 4
    assert lease_size(1, 4) == 1 and lease_size(100_000, 3) == 4167


def test_a_process_share_of_a_parallel_cap() -> None:
    assert [parallel_share(8, n) for n in (1, 2, 3, 4, 8, 16)] == [8, 4, 3, 2, 1, 1]
    assert parallel_share(1, 0) == 1


# One process's allowance


RPM = Limits(rpm=100)


def test_a_key_without_limits_costs_nothing() -> None:
    limiter = Limiter()
    assert limiter.admit("k", Limits(max_parallel=3), 500, T0) is FREE
    assert limiter.allowances == {} and limiter.settle(None, 900, Limits(), T0) == []


def test_the_first_request_reads_the_previous_minute_then_leases_a_share() -> None:
    limiter = Limiter()
    step = limiter.admit("k", RPM, 0, T0 + 30, members=2)
    minute = minute_window(T0 + 30)
    assert step == Read("k", Counter.requests, (previous_minute(minute).id, minute.id))
    limiter.read(step, {previous_minute(minute).id: 80, minute.id: 5}, T0 + 30)
    lease = limiter.admit("k", RPM, 0, T0 + 30, members=2)
    # cap: 100 - floor(80 * 0.5) = 60; size: ceil(100 / 16) = 7
    assert lease == Lease("k", Counter.requests, minute.id, 7, 60, batch=True)
    limiter.granted(lease, 7, T0 + 30)
    for _ in range(7):  # from the allowance: no store call
        assert isinstance(limiter.admit("k", RPM, 0, T0 + 31, members=2), Go)
    again = limiter.admit("k", RPM, 0, T0 + 31, members=2)
    assert isinstance(again, Lease) and again.cap == sliding_cap(100, 80, 31)


def test_one_batch_lease_at_a_time_others_ask_for_what_they_need() -> None:
    shell = Shell(Limiter(), Store())
    limiter, store = shell.limiter, shell.store
    assert isinstance(shell.admit("k", Limits(tpm=8000), 10, T0), Go)
    allowance = limiter.allowances["k", Counter.tokens]
    allowance.held = 0
    first = limiter.admit("k", Limits(tpm=8000), 300, T0 + 1)
    second = limiter.admit("k", Limits(tpm=8000), 200, T0 + 1)  # while the first is out
    assert isinstance(first, Lease) and first.batch and first.want == 1000
    assert isinstance(second, Lease) and not second.batch and second.want == 200
    limiter.granted(second, store.lease(*second.call), T0 + 1)
    limiter.granted(first, store.lease(*first.call), T0 + 1)
    third = limiter.admit("k", Limits(tpm=8000), 5000, T0 + 1)
    assert isinstance(third, Lease) and third.batch and third.want == 5000 - 1200
    limiter.failed(third)  # the store call failed: another batch may be asked
    assert not allowance.batching


def test_a_short_lease_refuses_until_the_cap_has_grown_by_a_lease() -> None:
    shell = Shell(Limiter(), Store())
    store = shell.store
    prev = previous_minute(minute_window(T0)).id
    store.counts["k", "requests", prev] = 100  # a full previous minute
    now = T0 + 6  # cap: 100 - floor(100 * 0.9) = 10
    passed = [shell.admit("k", RPM, 0, now) for _ in range(12)]
    assert [isinstance(s, Go) for s in passed] == [True] * 10 + [False] * 2
    refused = passed[-1]
    assert isinstance(refused, Refused) and refused.counter is Counter.requests and refused.limit == 100
    # The store holds 10: a lease (13) fits once 100 - floor(100 * (1 - e/60)) >= 23,
    # just after 100 * (1 - e/60) = 78.
    assert refused.retry_after == pytest.approx(60 * (1 - 78 / 100) - 6 + 0.001)
    calls = store.calls
    assert isinstance(shell.admit("k", RPM, 0, T0 + 10), Refused)  # cap 17: not asked
    assert store.calls == calls
    assert refused.retry_after is not None
    assert isinstance(shell.admit("k", RPM, 0, now + refused.retry_after), Go)


def test_a_new_window_drops_what_was_held() -> None:
    shell = Shell(Limiter(), Store())
    limiter, store = shell.limiter, shell.store
    assert isinstance(shell.admit("k", RPM, 0, T0 + 59), Go)
    assert limiter.allowances["k", Counter.requests].held == 12  # leased 13, took 1
    step = limiter.admit("k", RPM, 0, T0 + 60)
    assert isinstance(step, Read)  # the new minute: nothing held, its previous one to read
    assert limiter.allowances["k", Counter.requests].held == 0
    assert store.counts["k", "requests", minute_window(T0).id] == 13  # the 12 count as used
    limiter.read(step, store.used(*step.call), T0 + 60)
    lease = limiter.admit("k", RPM, 0, T0 + 60)
    assert isinstance(lease, Lease) and lease.cap == 100 - 13


def test_a_lease_answered_after_its_window_ended_is_not_used_in_the_next() -> None:
    shell = Shell(Limiter(), Store())
    limiter, store = shell.limiter, shell.store
    shell.admit("k", RPM, 0, T0 + 59)
    limiter.allowances["k", Counter.requests].held = 0
    late = limiter.admit("k", RPM, 0, T0 + 59.9)
    assert isinstance(late, Lease)
    assert isinstance(limiter.admit("k", RPM, 0, T0 + 60.1), Read)  # the window rolled
    limiter.granted(late, store.lease(*late.call), T0 + 60.1)
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
    assert go.ticket.windows == ((Counter.budget, "M:2026-03"), (Counter.tokens, minute_window(now).id))


# Settling a request's tokens


def test_settle_gives_back_what_was_not_used_and_adds_what_was() -> None:
    shell = Shell(Limiter(), Store())
    limiter, store = shell.limiter, shell.store
    limits = Limits(tpm=80_000)  # leases of 10,000
    go = shell.admit("k", limits, 1000, T0)
    assert isinstance(go, Go)
    tokens = limiter.allowances["k", Counter.tokens]
    assert tokens.held == 9000
    shell.settle(go.ticket, 400, limits, T0 + 1)  # used fewer: 600 back
    assert tokens.held == 9600
    go = shell.admit("k", limits, 1000, T0 + 2)
    assert isinstance(go, Go)
    shell.settle(go.ticket, 9000, limits, T0 + 3)  # 8,000 more, all held
    assert tokens.held == 600 and store.counts["k", "tokens", minute_window(T0).id] == 10_000
    go = shell.admit("k", limits, 600, T0 + 4)
    assert isinstance(go, Go) and tokens.held == 0
    calls = limiter.settle(go.ticket, 2600, limits, T0 + 5)  # 2,000 beyond: to the store
    assert calls == [AddUsed("k", Counter.tokens, minute_window(T0).id, 2000)]
    assert tokens.floor == 12_000  # the store's count is known to include them


def test_settle_after_the_window_ended() -> None:
    shell = Shell(Limiter(), Store())
    limiter = shell.limiter
    limits = Limits(tpm=80_000, budget=Budget(10**6, "day"))  # leases of 10,000 and 125,000
    one, two = (shell.admit("k", limits, 1000, T0 + 59) for _ in range(2))
    assert isinstance(one, Go) and isinstance(two, Go)
    budget = limiter.allowances["k", Counter.budget]
    assert budget.held == 123_000
    # Fewer tokens than taken: nothing goes back to a minute that has ended (the day runs).
    assert limiter.settle(one.ticket, 0, limits, T0 + 61) == []
    assert limiter.allowances["k", Counter.tokens].held == 0 and budget.held == 124_000
    # More: counted in the window where they are known; the budget's from its allowance.
    calls = limiter.settle(two.ticket, 1500, limits, T0 + 62)
    assert calls == [AddUsed("k", Counter.tokens, minute_window(T0 + 62).id, 500)]
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


@pytest.mark.parametrize(("seed", "even"), [(1, False), (2, False), (3, True)])
def test_four_processes_keep_to_the_limit_over_every_sliding_minute(seed: int, even: bool) -> None:
    """200 requests a minute for 5 minutes against rpm 100, over four processes: every
    60 s passes the limit give or take the documented bound (one lease per process above,
    two below), and no fixed minute is granted more than the limit."""
    limit, members = 100, 4
    passed, store = simulate(Limits(rpm=limit), members, 200, 5, seed, even=even)
    bound = 16  # processes x lease: 4 x ceil(100 / (8 x 4))
    most, fewest = per_sliding_minute(passed, since=T0 + 120)
    assert limit - 2 * bound <= fewest and most <= limit + bound, (fewest, most)
    assert max(store.counts.values()) <= limit
    assert len(passed) >= 5 * (limit - bound)
    # Leases, not a store call per request: fewer calls than requests seen (1,000).
    assert store.calls < 600


def test_four_processes_under_the_limit_pass_everything() -> None:
    passed, store = simulate(Limits(rpm=400), 4, 200, 3, seed=4, even=True)
    assert len(passed) == 600
    assert store.calls < 100  # about eight leases a minute, a read per process and minute


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
    minutes = [n for (_, counter, _), n in store.counts.items() if counter == "tokens"]
    assert max(minutes) <= tpm + most_in_flight * extra
    assert max(minutes) > tpm  # the bound is reached for, not idle
    assert sum(minutes) >= used  # nothing used goes uncounted


def test_a_burst_at_the_end_of_a_minute_is_the_approximations_worst_case() -> None:
    """The documented limit of the method: the previous minute's count is assumed spread
    evenly, so a full burst in its last instant, then a steady stream, passes nearly twice
    the limit in the 60 s around the boundary; each fixed minute keeps to the limit."""
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
