"""Key limits as an operator types them (`llmgw keys create|set`), as stores and the gateway
host's answers carry them (read back as hostile data), and the counter windows' ids."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from llmgw_cli.core.serving.limits import (
    NO_LIMITS,
    Budget,
    LimitError,
    Limits,
    Priority,
    as_dict,
    changed,
    describe,
    from_dict,
    option_args,
    parse_changes,
    window_end,
)
from llmgw_cli.core.serving.ratelimit import budget_window, slot_window


def given(**texts: str) -> dict[str, object]:
    return parse_changes(dict(texts))


def test_each_limit_in_the_forms_an_operator_types() -> None:
    assert given(rpm="60", tpm="100000", max_parallel="4", budget="100000/day", priority="high") == {
        "rpm": 60,
        "tpm": 100_000,
        "max_parallel": 4,
        "budget": Budget(100_000, "day"),
        "priority": Priority.high,
    }
    assert given(tpm="100k", budget="5M/month") == {"tpm": 100_000, "budget": Budget(5_000_000, "month")}
    assert given(budget="100K/Day", priority="LOW", rpm=" 7 ") == {
        "budget": Budget(100_000, "day"),
        "priority": Priority.low,
        "rpm": 7,
    }
    assert parse_changes({"rpm": None, "budget": None}) == {}  # not given: nothing changes


def test_none_removes_a_limit_and_only_the_options_given_change() -> None:
    limits = Limits(rpm=60, tpm=1000, max_parallel=2, budget=Budget(10, "day"), priority=Priority.high)
    changes = given(rpm="none", budget="None", priority="none")
    assert changes == {"rpm": None, "budget": None, "priority": Priority.normal}
    assert changed(limits, changes) == Limits(tpm=1000, max_parallel=2)
    assert changed(limits, given(tpm="5")) == Limits(60, 5, 2, Budget(10, "day"), Priority.high)
    assert changed(NO_LIMITS, {}) == NO_LIMITS


@pytest.mark.parametrize(
    ("field", "text", "message"),
    [
        ("rpm", "0", "--rpm '0': give a positive whole number, e.g. 60"),
        ("rpm", "-5", "--rpm '-5': give a positive whole number, e.g. 60"),
        ("rpm", "1.5", "--rpm '1.5': give a positive whole number, e.g. 60"),
        ("rpm", "", "--rpm '': give a positive whole number, e.g. 60"),
        ("rpm", "9" * 40, "give a positive whole number"),  # no int() of an endless string
        ("tpm", "lots", "--tpm 'lots': give a positive whole number, e.g. 100000 or 100k"),
        ("tpm", "1.5k", "--tpm '1.5k': give a positive whole number, e.g. 100000 or 100k"),
        ("tpm", "k", "--tpm 'k': give a positive whole number"),
        ("max_parallel", "four", "--max-parallel 'four': give a positive whole number, e.g. 4"),
        ("max_parallel", "٣", "--max-parallel '٣': give a positive whole number"),  # a digit, not ASCII
        ("budget", "10/week", "--budget '10/week': give TOKENS/day or TOKENS/month"),
        ("budget", "100000", "--budget '100000': give TOKENS/day or TOKENS/month"),
        ("budget", "0/day", "--budget '0/day': give TOKENS/day or TOKENS/month"),
        ("budget", "/day", "--budget '/day': give TOKENS/day or TOKENS/month"),
        ("budget", "1/day/month", "--budget '1/day/month': give TOKENS/day or TOKENS/month"),
        ("priority", "urgent", "--priority 'urgent': give high, normal or low"),
        ("priority", "", "--priority '': give high, normal or low"),
    ],
)
def test_a_bad_limit_names_its_option_and_the_accepted_form(field: str, text: str, message: str) -> None:
    with pytest.raises(LimitError) as bad:
        parse_changes({field: text})
    assert message in str(bad.value)
    if field == "budget":
        assert "e.g. 100000/day" in str(bad.value)


def test_limits_as_forwarded_options_parse_back_to_the_same_changes() -> None:
    changes = given(rpm="60", tpm="100k", max_parallel="none", budget="5M/month", priority="low")
    args = option_args(changes)
    assert args == [
        "--rpm=60",
        "--tpm=100000",
        "--max-parallel=none",
        "--budget=5000000/month",
        "--priority=low",
    ]
    back = {a.split("=")[0][2:].replace("-", "_"): a.split("=", 1)[1] for a in args}
    assert parse_changes(back) == changes


def test_limits_as_stored_and_read_back_as_hostile_data() -> None:
    limits = Limits(rpm=60, tpm=None, max_parallel=3, budget=Budget(5, "month"), priority=Priority.low)
    assert as_dict(limits) == {
        "rpm": 60,
        "tpm": None,
        "max_parallel": 3,
        "budget": "5/month",
        "priority": "low",
    }
    assert from_dict(as_dict(limits)) == limits
    assert from_dict({}) == NO_LIMITS  # an llmgw that stored no limits yet
    for bad, field in [
        ([], "limits"),
        ({"rpm": 0}, "rpm"),
        ({"rpm": True}, "rpm"),
        ({"tpm": "5"}, "tpm"),
        ({"max_parallel": 1.5}, "max_parallel"),
        ({"rpm": 10**20}, "rpm"),
        ({"budget": 5}, "budget"),
        ({"budget": "5/week"}, "budget"),
        ({"priority": "top"}, "priority"),
        ({"priority": None}, "priority"),
    ]:
        with pytest.raises(ValueError, match=field):
            from_dict(bad)


def test_describe_names_only_the_limits_a_key_has() -> None:
    assert describe(NO_LIMITS) == "none"
    assert (
        describe(Limits(60, 100_000, 4, Budget(100_000, "day"), Priority.high))
        == "rpm 60, tpm 100000, parallel 4, budget 100000/day, priority high"
    )
    assert describe(Limits(budget=Budget(5, "month"))) == "budget 5/month"


def test_counter_windows_and_when_they_end() -> None:
    now = datetime(2026, 12, 5, 10, 30, 15, tzinfo=UTC).timestamp()
    minute = f"m:{int(now // 60)}"
    assert slot_window(now).id == f"s:{int(now // 10)}"
    assert window_end(slot_window(now).id) == datetime(2026, 12, 5, 10, 30, 20, tzinfo=UTC).timestamp()
    assert window_end(minute) == datetime(2026, 12, 5, 10, 31, tzinfo=UTC).timestamp()
    assert budget_window("day", now).id == "d:2026-12-05"
    assert budget_window("month", now).id == "M:2026-12"
    # each window ends where window_end, reading only its id, says
    for window in (slot_window(now), budget_window("day", now), budget_window("month", now)):
        assert window_end(window.id) == window.end
    assert window_end("d:2026-12-05") == datetime(2026, 12, 6, tzinfo=UTC).timestamp()
    assert window_end("M:2026-12") == datetime(2027, 1, 1, tzinfo=UTC).timestamp()
    assert window_end("M:2027-02") == datetime(2027, 3, 1, tzinfo=UTC).timestamp()
    for bad in (
        "m:",
        "m:-1",
        "m:1.5",
        "d:2026-13-01",
        "d:yesterday",
        "M:2026-1",
        "w:49",
        "",
        "m:" + "9" * 30,
    ):
        with pytest.raises(ValueError):
            window_end(bad)
