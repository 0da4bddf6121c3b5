"""Aliases and fallbacks in front of the real llama-server (SmolLM2-135M on the CPU), via
the openai client: the `model` field of a plain and of a streamed answer is the model
that served, as the `x-llmgw-served-by` header says."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.gateway.harness import Gateway, free_port
from tests.test_llama_server import ALIAS, KEY, llama_server

pytestmark = pytest.mark.integration

__all__ = ["llama_server"]  # the module-scoped fixture, shared with tests/test_llama_server.py

MESSAGES: list[openai.types.chat.ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the capital of France? Answer in one word."}
]


@pytest.fixture(scope="module")
def gateway(llama_server: int, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, str]]:
    directory: Path = tmp_path_factory.mktemp("aliases-llama")
    models: list[dict[str, object]] = [
        {
            "name": ALIAS,
            "source": "./smollm2.gguf",
            "profile": "sim",
            "scaling": {"min": 1, "max": 1},
            "aliases": ["gpt-4o-mini"],
        },
        {
            "name": "big",
            "source": "./big.gguf",
            "profile": "sim",
            "scaling": {"min": 1, "max": 1},
            "fallbacks": [ALIAS],
        },
    ]
    # `big`: a replica nothing listens on, never ready
    replicas = {ALIAS: [f"127.0.0.1:{llama_server}"], "big": [f"127.0.0.1:{free_port()}"]}
    gw = Gateway(directory, models, replicas, engine_key=KEY)
    key = gw.cli("keys", "create", "--name", "user")
    gw.start()
    try:
        yield gw, key
    finally:
        gw.stop()


@pytest.mark.parametrize("asked", ["gpt-4o-mini", "big"])
def test_the_answer_names_the_model_that_served(gateway: tuple[Gateway, str], asked: str) -> None:
    gw, key = gateway
    client = gw.client(key)
    raw = client.chat.completions.with_raw_response.create(
        model=asked, messages=MESSAGES, max_tokens=8, temperature=0
    )
    reply = raw.parse()
    assert raw.headers["x-llmgw-served-by"] == ALIAS and reply.model == ALIAS
    assert reply.choices[0].message.content
    with client.chat.completions.with_streaming_response.create(
        model=asked, messages=MESSAGES, max_tokens=8, temperature=0, stream=True
    ) as streamed:
        assert streamed.headers["x-llmgw-served-by"] == ALIAS
        chunks = list(streamed.parse())
    assert chunks and {c.model for c in chunks} == {ALIAS}
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content
    assert [m.id for m in client.models.list().data] == [ALIAS, "gpt-4o-mini", "big"]
