"""What a client is told about its key's limits (pure): the 429 of a refusal, when to retry,
and the ``x-ratelimit-*`` headers, in OpenAI's formats.

- The body has OpenAI's error shape; ``type`` and ``code`` are ``rate_limit_exceeded`` for
  rpm and tpm, ``insufficient_quota`` for a spent budget.
- ``Retry-After`` is whole seconds (at least 1); ``retry-after-ms`` the same wait in
  milliseconds, which the official ``openai`` client reads first. That client retries a
  429 after the stated wait when it is at most ``CLIENT_MAX_RETRY_AFTER`` seconds and does
  not retry at all beyond it; ``x-should-retry: false`` says so explicitly for a longer
  wait and for a request that can never pass (larger than the limit itself), which has no
  ``Retry-After``.
- ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}``: the key's rpm and tpm, what
  this process believes is left, and the time until what was used no longer counts, as a
  duration the way OpenAI writes it (``1s``, ``6m0s``, ``20ms``). ``remaining`` is
  approximate: a process knows what it leased and used itself, and the store's count only
  at its last lease.
"""

from __future__ import annotations

import math

from llmgw_cli.core.serving.limits import Limits
from llmgw_cli.core.serving.ratelimit import Counter, Limiter, Refused

CLIENT_MAX_RETRY_AFTER = 120.0
"""The longest ``Retry-After`` the official ``openai`` client waits for (its
``MAX_RETRY_AFTER_DELAY``); beyond it the client gives up at once."""


def duration(seconds: float) -> str:
    """A duration as OpenAI's headers write it (Go's format, to the millisecond):
    ``0s``, ``20ms``, ``1.5s``, ``6m0s``, ``1h2m3.5s``."""
    ms = max(0, math.ceil(seconds * 1000 - 1e-6))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    whole, frac = divmod(rest, 1000)
    text = f"{whole}.{frac:03d}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{text}"
    if minutes:
        return f"{minutes}m{text}"
    return text


def retry_headers(retry_after: float | None) -> dict[str, str]:
    """``Retry-After`` (whole seconds, at least 1) and ``retry-after-ms`` (at least 1);
    ``x-should-retry: false`` when the client should not wait for it (see the module)."""
    if retry_after is None:
        return {"x-should-retry": "false"}
    ms = max(1, math.ceil(retry_after * 1000 - 1e-6))
    headers = {"Retry-After": str(max(1, math.ceil(ms / 1000))), "retry-after-ms": str(ms)}
    if retry_after > CLIENT_MAX_RETRY_AFTER:
        headers["x-should-retry"] = "false"
    return headers


_NAMES = {
    Counter.requests: "requests per minute (RPM)",
    Counter.tokens: "tokens per minute (TPM)",
}


def message(refused: Refused) -> str:
    wait = refused.retry_after
    if refused.counter is Counter.budget:
        budget = f"{refused.limit}/{refused.period}"
        if wait is None:
            return (
                f"Request too large for this key's token budget ({budget}): "
                f"{refused.requested} tokens requested."
            )
        return f"This key has used its token budget ({budget}); it renews in {duration(wait)}."
    name = _NAMES[refused.counter]
    if wait is None:
        return (
            f"Request too large for {name}: limit {refused.limit}, requested {refused.requested}; "
            "send a shorter request."
        )
    asked = "" if refused.counter is Counter.requests else f", requested {refused.requested}"
    return (
        f"Rate limit reached for {name}: limit {refused.limit}{asked}. Please try again in {duration(wait)}."
    )


def refusal(refused: Refused) -> tuple[int, dict[str, dict[str, str | None]], dict[str, str]]:
    """The answer to a refused request: 429, OpenAI's error body, the retry headers."""
    kind = "insufficient_quota" if refused.counter is Counter.budget else "rate_limit_exceeded"
    body: dict[str, dict[str, str | None]] = {
        "error": {"message": message(refused), "type": kind, "param": None, "code": kind}
    }
    return 429, body, retry_headers(refused.retry_after)


def limit_headers(limiter: Limiter, key: str, limits: Limits, now: float) -> dict[str, str]:
    """``x-ratelimit-*`` for the key's rpm and tpm (none for a limit it does not have)."""
    headers: dict[str, str] = {}
    for counter, suffix in ((Counter.requests, "requests"), (Counter.tokens, "tokens")):
        allowance = limiter.allowance(key, counter, limits, now)
        if allowance is None:
            continue
        headers[f"x-ratelimit-limit-{suffix}"] = str(allowance.limit)
        headers[f"x-ratelimit-remaining-{suffix}"] = str(min(allowance.limit, allowance.remaining(now)))
        headers[f"x-ratelimit-reset-{suffix}"] = duration(allowance.reset_in(now))
    return headers
