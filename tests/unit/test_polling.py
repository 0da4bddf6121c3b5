from __future__ import annotations

import asyncio

import pytest

from llmgw_cli.polling import poll_until


def test_returns_the_first_answer_that_is_not_none() -> None:
    calls: list[int] = []

    async def step() -> str | None:
        calls.append(1)
        return "ready" if len(calls) == 3 else None

    assert asyncio.run(poll_until(step, timeout=5, interval=0.001)) == "ready"
    assert len(calls) == 3


def test_gives_none_at_the_deadline_after_asking_at_least_once_and_once_at_the_end() -> None:
    now = [0.0]
    asked_at: list[float] = []

    async def step() -> str | None:
        asked_at.append(now[0])
        now[0] += 0.4  # each question takes 0.4 s of the fake clock
        return None

    assert asyncio.run(poll_until(step, timeout=1.0, interval=0.0, clock=lambda: now[0])) is None
    assert asked_at[0] == 0.0
    assert asked_at[-1] >= 0.8  # asked again close to the deadline, not given up early
    assert len(asked_at) == 3


def test_a_step_that_raises_ends_the_wait() -> None:
    async def step() -> str | None:
        raise RuntimeError("unit failed")

    with pytest.raises(RuntimeError, match="unit failed"):
        asyncio.run(poll_until(step, timeout=5, interval=0.001))
