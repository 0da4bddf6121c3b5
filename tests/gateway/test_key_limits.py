"""Per-key limits through a real `llmgw gateway run` (one process, SQLite store) to
simulated vLLM engines, read with the official openai client: rpm, tpm and a budget
refuse with OpenAI's 429 and headers; max_parallel makes a key's second request wait;
a high-priority key overtakes a low-priority backlog; a key without limits carries no
limit headers."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.gateway.harness import Engine, Gateway

pytestmark = pytest.mark.integration

MESSAGES: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "hello there"}]


class Setup:
    def __init__(self, gateway: Gateway, keys: dict[str, str]) -> None:
        self.gw, self.keys = gateway, keys

    def post(self, key: str, model: str = "chat", max_tokens: int = 4) -> httpx.Response:
        return httpx.post(
            f"http://127.0.0.1:{self.gw.port}/v1/chat/completions",
            json={"model": model, "messages": MESSAGES, "max_tokens": max_tokens},
            headers={"Authorization": f"Bearer {self.keys[key]}"},
            timeout=60,
        )


def _model(name: str) -> dict[str, object]:
    return {
        "name": name,
        "source": f"org/{name}",
        "fetch": "engine",
        "profile": "sim",
        "scaling": {"min": 1, "max": 1},
    }


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    directory = tmp_path_factory.mktemp("limits")
    chat = Engine(directory, "chat")
    slow = Engine(directory, "slow", tokens_per_second=20)  # 20 tokens: about a second
    # two requests at a time to `slow`, so its queue forms
    gw = Gateway(
        directory,
        [_model("chat"), _model("slow")],
        {"chat": [chat.address], "slow": [slow.address]},
        model_concurrency=2,
    )
    keys = {
        "free": gw.cli("keys", "create", "--name", "free"),
        "rpm": gw.cli("keys", "create", "--name", "rpm3", "--rpm", "3"),
        "tpm": gw.cli("keys", "create", "--name", "tpm", "--tpm", "100"),
        "budget": gw.cli("keys", "create", "--name", "budget", "--budget", "60/day"),
        "parallel": gw.cli("keys", "create", "--name", "one-at-a-time", "--max-parallel", "1"),
        **{
            f"low-{n}": gw.cli("keys", "create", "--name", f"low-{n}", "--priority", "low")
            for n in ("a", "b", "c")
        },
        "high": gw.cli("keys", "create", "--name", "high", "--priority", "high"),
    }
    gw.start()
    try:
        yield Setup(gw, keys)
    finally:
        if gw.proc is not None:
            gw.stop()
        chat.stop()
        slow.stop()


def test_rpm_refuses_the_fourth_request_in_openais_shape(setup: Setup) -> None:
    answers = [setup.post("rpm") for _ in range(4)]
    assert [a.status_code for a in answers] == [200, 200, 200, 429]
    assert [a.headers["x-ratelimit-limit-requests"] for a in answers] == ["3"] * 4
    assert [int(a.headers["x-ratelimit-remaining-requests"]) for a in answers] == [2, 1, 0, 0]
    refused = answers[-1]
    error = refused.json()["error"]
    assert error["type"] == error["code"] == "rate_limit_exceeded"
    assert "requests per minute" in error["message"].lower()
    assert int(refused.headers["retry-after"]) >= 1 and int(refused.headers["retry-after-ms"]) > 0
    assert refused.headers["x-ratelimit-reset-requests"]
    # the official client: a RateLimitError with the body's code
    client = setup.gw.client(setup.keys["rpm"])
    with pytest.raises(openai.RateLimitError) as raised:
        client.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=4)
    assert raised.value.code == "rate_limit_exceeded"


def test_tpm_counts_the_engines_usage(setup: Setup) -> None:
    spent, statuses = 0, []
    for _ in range(12):
        answer = setup.post("tpm", max_tokens=8)
        statuses.append(answer.status_code)
        if answer.status_code == 200:
            spent += answer.json()["usage"]["total_tokens"]
            assert answer.headers["x-ratelimit-limit-tokens"] == "100"
    assert 429 in statuses, statuses
    first_refusal = statuses.index(429)
    assert all(s == 200 for s in statuses[:first_refusal])
    # one process, one request at a time: at most one request's tokens past the limit
    assert 100 - 30 <= spent <= 100 + 30, (spent, statuses)


def test_a_spent_budget_is_insufficient_quota_and_stays_so(setup: Setup) -> None:
    statuses = []
    for _ in range(10):
        answer = setup.post("budget", max_tokens=8)
        statuses.append(answer.status_code)
        if answer.status_code == 429:
            error = answer.json()["error"]
            assert error["type"] == error["code"] == "insufficient_quota"
            assert "x-ratelimit-limit-requests" not in answer.headers  # a budget has no such header
    assert 200 in statuses and statuses[-3:] == [429, 429, 429], statuses
    client = setup.gw.client(setup.keys["budget"]).with_options(max_retries=2)
    began = time.monotonic()
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=4)
    assert time.monotonic() - began < 5  # a day's wait: the client does not retry


def test_a_key_without_limits_has_no_limit_headers(setup: Setup) -> None:
    answer = setup.post("free")
    assert answer.status_code == 200
    assert not [h for h in answer.headers if h.startswith("x-ratelimit-")]


def test_max_parallel_makes_the_second_request_wait_not_fail(setup: Setup) -> None:
    began = time.monotonic()
    assert setup.post("parallel", model="slow", max_tokens=20).status_code == 200
    one = time.monotonic() - began  # alone (the model has two slots)
    with ThreadPoolExecutor(2) as pool:
        began = time.monotonic()
        answers = list(pool.map(lambda _: setup.post("parallel", model="slow", max_tokens=20), range(2)))
        took = time.monotonic() - began
    assert [a.status_code for a in answers] == [200, 200]
    # one after the other: twice as long as one (two at once would take one's time)
    assert took >= 1.7 * one, (took, one)


def test_a_high_priority_request_goes_before_a_low_priority_backlog(setup: Setup) -> None:
    """Two slots busy and six low-priority requests of three keys waiting: a high-priority
    request takes the next slot freed. (Keys taking turns alone would put it fourth.)"""
    done: list[str] = []
    lock = threading.Lock()

    def ask(key: str) -> None:
        answer = setup.post(key, model="slow", max_tokens=10)  # about half a second
        assert answer.status_code == 200
        with lock:
            done.append(key)

    lows = [threading.Thread(target=ask, args=(f"low-{'abc'[n % 3]}",)) for n in range(8)]
    for t in lows:
        t.start()
        time.sleep(0.03)  # in this order: the first two hold the two slots
    time.sleep(0.2)
    high = threading.Thread(target=ask, args=("high",))
    high.start()
    for t in [*lows, high]:
        t.join()
    # the two in flight end first; the high one runs next, beside at most one low
    assert done.index("high") <= 3, done
