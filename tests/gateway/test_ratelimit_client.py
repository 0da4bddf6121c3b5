"""The official openai client against the gateway's answer to a rate-limited request (a
real aiohttp server answering what core/serving/ratelimit_answer.py makes): it waits what
the answer says, retries, and raises RateLimitError when its retries run out; a spent
budget and a request larger than the limit are not retried.

The client's sleep is recorded instead of slept, so the test reads the waits the client
chose from the headers, exactly, without timing anything."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import openai
import pytest
from aiohttp import web
from openai.types.chat import ChatCompletion

from llmgw_cli.core.serving.ratelimit import Counter, Refused
from llmgw_cli.core.serving.ratelimit_answer import refusal

COMPLETION = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 0,
    "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}


@contextmanager
def gateway(refused: Refused, refusals: int) -> Iterator[tuple[str, list[str]]]:
    """A server that refuses the first ``refusals`` requests as the gateway does, then
    answers; its base URL and the requests it saw."""
    seen: list[str] = []

    async def chat(request: web.Request) -> web.Response:
        seen.append(await request.text())
        if len(seen) > refusals:
            return web.json_response(COMPLETION)
        status, body, headers = refusal(refused)
        return web.Response(
            status=status, text=json.dumps(body), content_type="application/json", headers=headers
        )

    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}/v1", seen
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The client's waits between retries (its ``time.sleep``), recorded instead of slept."""
    waits: list[float] = []
    monkeypatch.setattr(time, "sleep", waits.append)
    return waits


def ask(base_url: str, max_retries: int) -> object:
    with openai.OpenAI(
        base_url=base_url, api_key="llmgw-test", max_retries=max_retries, timeout=10
    ) as client:
        return client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])


def test_the_client_waits_the_stated_time_and_retries(sleeps: list[float]) -> None:
    refused = Refused(Counter.requests, 60, 1, 1.25)  # Retry-After: 2, retry-after-ms: 1250
    with gateway(refused, refusals=2) as (url, seen):
        answer = ask(url, max_retries=2)
    assert isinstance(answer, ChatCompletion) and len(seen) == 3
    assert sleeps == [1.25, 1.25]  # the milliseconds, not its own back-off (0.5 s, 1 s)


def test_the_client_raises_rate_limit_error_when_its_retries_run_out(sleeps: list[float]) -> None:
    refused = Refused(Counter.tokens, 10_000, 1200, 3.0)
    with gateway(refused, refusals=10) as (url, seen), pytest.raises(openai.RateLimitError) as caught:
        ask(url, max_retries=1)
    assert len(seen) == 2 and sleeps == [3.0]
    assert caught.value.code == "rate_limit_exceeded" and caught.value.type == "rate_limit_exceeded"
    assert (
        "Rate limit reached for tokens per minute (TPM): limit 10000, requested 1200" in caught.value.message
    )


@pytest.mark.parametrize(
    "refused",
    [
        Refused(Counter.budget, 100_000, 500, 5 * 3600.0, "day"),  # renews in 5 h
        Refused(Counter.tokens, 1000, 4000, None),  # larger than the limit itself
    ],
)
def test_a_refusal_that_lasts_is_not_retried(refused: Refused, sleeps: list[float]) -> None:
    with gateway(refused, refusals=10) as (url, seen), pytest.raises(openai.RateLimitError) as caught:
        ask(url, max_retries=3)
    assert len(seen) == 1 and sleeps == []
    kind = "insufficient_quota" if refused.counter is Counter.budget else "rate_limit_exceeded"
    assert caught.value.code == kind
