"""What a rate-limited client is told: the 429 body, the retry headers and the
``x-ratelimit-*`` headers in OpenAI's formats."""

from __future__ import annotations

import pytest

from llmgw_cli.core.serving.limits import Budget, Limits
from llmgw_cli.core.serving.ratelimit import (
    Counter,
    Go,
    Lease,
    Limiter,
    Read,
    Refused,
    earlier_slots,
    slot_window,
)
from llmgw_cli.core.serving.ratelimit_answer import (
    CLIENT_MAX_RETRY_AFTER,
    duration,
    limit_headers,
    refusal,
    retry_headers,
)

T0 = 1_772_366_400.0  # 2026-03-01 12:00 UTC, the start of a minute


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (-1, "0s"),
        (0.0001, "1ms"),
        (0.02, "20ms"),
        (0.999, "999ms"),
        (1, "1s"),
        (1.5, "1.5s"),
        (17.234, "17.234s"),
        (59.9996, "1m0s"),
        (86.4, "1m26.4s"),
        (360, "6m0s"),
        (3723.5, "1h2m3.5s"),
        (7200, "2h0m0s"),
    ],
)
def test_durations_are_written_as_openai_writes_them(seconds: float, text: str) -> None:
    assert duration(seconds) == text


def test_retry_headers() -> None:
    assert retry_headers(0.3) == {"Retry-After": "1", "retry-after-ms": "300"}
    assert retry_headers(0) == {"Retry-After": "1", "retry-after-ms": "1"}  # never "now"
    assert retry_headers(2.0001) == {"Retry-After": "3", "retry-after-ms": "2001"}
    assert retry_headers(CLIENT_MAX_RETRY_AFTER) == {"Retry-After": "120", "retry-after-ms": "120000"}
    assert retry_headers(3600) == {
        "Retry-After": "3600",
        "retry-after-ms": "3600000",
        "x-should-retry": "false",
    }
    assert retry_headers(None) == {"x-should-retry": "false"}


def error(refused: Refused) -> tuple[int, dict[str, object], dict[str, str]]:
    status, body, headers = refusal(refused)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return status, dict(body["error"]), headers


def test_a_refusal_is_a_429_in_openai_shape() -> None:
    status, body, headers = error(Refused(Counter.requests, 60, 1, 1.5))
    assert status == 429 and headers == {"Retry-After": "2", "retry-after-ms": "1500"}
    assert body == {
        "message": "Rate limit reached for requests per minute (RPM): limit 60. Please try again in 1.5s.",
        "type": "rate_limit_exceeded",
        "param": None,
        "code": "rate_limit_exceeded",
    }
    _, body, _ = error(Refused(Counter.tokens, 10_000, 1200, 0.02))
    assert body["message"] == (
        "Rate limit reached for tokens per minute (TPM): limit 10000, requested 1200. Please try again in 20ms."
    )
    _, body, headers = error(Refused(Counter.tokens, 1000, 4000, None))
    assert body["message"] == (
        "Request too large for tokens per minute (TPM): limit 1000, requested 4000; send a shorter request."
    )
    assert body["code"] == "rate_limit_exceeded" and headers == {"x-should-retry": "false"}


def test_a_spent_budget_is_insufficient_quota() -> None:
    status, body, headers = error(Refused(Counter.budget, 100_000, 300, 5 * 3600 + 61, "day"))
    assert status == 429 and body["type"] == body["code"] == "insufficient_quota"
    assert body["message"] == "This key has used its token budget (100000/day); it renews in 5h1m1s."
    assert headers["Retry-After"] == "18061" and headers["x-should-retry"] == "false"
    _, body, _ = error(Refused(Counter.budget, 5_000_000, 6_000_000, None, "month"))
    assert body["message"] == (
        "Request too large for this key's token budget (5000000/month): 6000000 tokens requested."
    )


Used = dict[tuple[Counter, str], int]


def admitted(limiter: Limiter, limits: Limits, tokens: int, now: float, used: Used) -> None:
    """Admit one request against a store whose counts are ``used`` (granting any lease)."""
    for _ in range(10):
        step = limiter.admit("k", limits, tokens, now)
        if isinstance(step, Read):
            limiter.read(step, {w: used.get((step.counter, w), 0) for w in step.windows}, now)
        elif isinstance(step, Lease):
            count = used.get((step.counter, step.window), 0)
            got = max(0, min(step.want, step.cap - count))
            used[step.counter, step.window] = count + got
            limiter.granted(step, got, now)
        else:
            assert isinstance(step, Go)
            return
    raise AssertionError("no answer")


def test_limit_headers_say_what_this_process_knows() -> None:
    limiter = Limiter()
    limits = Limits(rpm=60, tpm=10_000, budget=Budget(10**6, "day"))
    assert limit_headers(limiter, "k", Limits(budget=Budget(10, "day")), T0) == {}  # no rpm, no tpm
    fresh = limit_headers(limiter, "k", limits, T0)
    assert fresh == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "60",
        "x-ratelimit-reset-requests": "0s",
        "x-ratelimit-limit-tokens": "10000",
        "x-ratelimit-remaining-tokens": "10000",
        "x-ratelimit-reset-tokens": "0s",
    }
    used: Used = {}
    for _ in range(3):
        admitted(limiter, limits, 500, T0 + 15, used)
    headers = limit_headers(limiter, "k", limits, T0 + 15)
    assert headers["x-ratelimit-remaining-requests"] == "57"
    assert headers["x-ratelimit-remaining-tokens"] == "8500"
    # What this slot (T0 + 10 to T0 + 20) used counts until a minute after its end.
    assert headers["x-ratelimit-reset-requests"] == headers["x-ratelimit-reset-tokens"] == "1m5s"


def test_limit_headers_of_a_minute_after_a_busy_one() -> None:
    limiter = Limiter()
    limits = Limits(rpm=60)
    now = T0 + 35  # half way through the slot from T0 + 30
    slot = slot_window(now)
    used: Used = {(Counter.requests, earlier_slots(slot)[0]): 60}  # a full slot a minute back
    admitted(limiter, limits, 0, now, used)  # the cap: 60 - 30 = 30; one taken of a lease of 2
    headers = limit_headers(limiter, "k", limits, now)
    assert headers["x-ratelimit-remaining-requests"] == "29"
    assert headers["x-ratelimit-reset-requests"] == "1m5s"
    # Another process took the rest: a lease comes back short, and the headers say so.
    used[Counter.requests, slot.id] = 30  # the cap now
    limiter.allowances["k", Counter.requests].held = 0
    step = limiter.admit("k", limits, 0, now)
    assert isinstance(step, Lease)
    limiter.granted(step, 0, now)
    assert limit_headers(limiter, "k", limits, now)["x-ratelimit-remaining-requests"] == "0"
