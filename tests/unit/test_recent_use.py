"""The gateway's last hour of use (gateway/serving/recent.py) on a clock the test moves: minute
buckets, the window sliding, old minutes dropped."""

from __future__ import annotations

from llmgw_cli.gateway.serving.recent import MINUTES, RecentUse

T0 = 1_000_020.0  # 20 s into a minute


def test_requests_land_in_their_minute_oldest_first() -> None:
    use = RecentUse()
    use.add("alice", "chat", 10, T0)
    use.add("bob", "chat", 5, T0 + 30)  # the same minute, another key
    use.add("alice", "chat", 7, T0 + 60)  # the next minute
    use.add("alice", "embed", 3, T0 + 60)
    got = use.per_model(T0 + 70)
    assert set(got) == {"chat", "embed"}
    assert len(got["chat"].requests) == len(got["chat"].tokens) == MINUTES
    assert got["chat"].requests[-2:] == (2, 1) and got["chat"].tokens[-2:] == (15, 7)
    assert sum(got["chat"].requests[:-2]) == 0
    assert got["embed"].requests[-1] == 1 and got["embed"].tokens[-1] == 3
    assert use.totals(T0 + 70) == {
        ("alice", "chat"): (2, 17),
        ("bob", "chat"): (1, 5),
        ("alice", "embed"): (1, 3),
    }


def test_the_window_slides_with_the_clock() -> None:
    use = RecentUse()
    use.add("alice", "chat", 10, T0)
    # Ten minutes on, the request is ten places from the right.
    later = use.per_model(T0 + 600)["chat"].requests
    assert later[-11] == 1 and sum(later) == 1
    # 59 minutes on it is the oldest minute shown; at 60 it is out of the hour.
    assert use.per_model(T0 + (MINUTES - 1) * 60)["chat"].requests[0] == 1
    assert use.per_model(T0 + MINUTES * 60) == {}
    assert use.totals(T0 + MINUTES * 60) == {}


def test_minutes_older_than_the_hour_are_dropped_when_a_minute_begins() -> None:
    use = RecentUse()
    for minute in range(3 * MINUTES):
        use.add("alice", "chat", 1, T0 + minute * 60)
    assert len(use.minutes) == MINUTES  # memory: at most one hour of buckets
    now = T0 + (3 * MINUTES - 1) * 60
    assert use.per_model(now)["chat"].requests == (1,) * MINUTES
    assert use.totals(now) == {("alice", "chat"): (MINUTES, MINUTES)}
