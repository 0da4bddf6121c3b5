"""The gateway in front of the real llama-server (SmolLM2-135M on the CPU), via the openai client.

llama-server answers any model name in single-model mode and closes the connection after
each stream: the gateway must check names itself and must not
reuse a connection the engine has closed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.gateway.harness import Gateway
from tests.test_llama_server import ALIAS, KEY, llama_server

pytestmark = pytest.mark.integration

__all__ = ["llama_server"]  # the module-scoped fixture, shared with tests/test_llama_server.py

MESSAGES: list[openai.types.chat.ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the capital of France? Answer in one word."}
]


@pytest.fixture(scope="module")
def gateway(
    llama_server: int, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Gateway, str, str]]:
    directory: Path = tmp_path_factory.mktemp("gateway-llama")
    models: list[dict[str, object]] = [
        {"name": ALIAS, "source": "./smollm2.gguf", "profile": "sim", "scaling": {"min": 1, "max": 1}}
    ]
    gw = Gateway(directory, models, {ALIAS: [f"127.0.0.1:{llama_server}"]}, engine_key=KEY)
    key = gw.cli("keys", "create", "--name", "user")
    admin = gw.cli("keys", "create", "--name", "ops", "--admin")
    gw.start()
    try:
        yield gw, key, admin
    finally:
        gw.stop()


def test_chat_and_streams_through_the_gateway(gateway: tuple[Gateway, str, str]) -> None:
    gw, key, admin = gateway
    client = gw.client(key)
    reply = client.chat.completions.create(model=ALIAS, messages=MESSAGES, max_tokens=12, temperature=0)
    text = reply.choices[0].message.content
    assert text and reply.usage is not None and reply.usage.completion_tokens > 0
    for asked in (True, True, False):  # llama-server closes the connection after each stream
        chunks = list(
            client.chat.completions.create(
                model=ALIAS,
                messages=MESSAGES,
                max_tokens=12,
                temperature=0,
                stream=True,
                **({"stream_options": {"include_usage": True}} if asked else {}),  # type: ignore[arg-type]
            )
        )
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
        if asked:
            assert (
                chunks[-1].usage is not None
                and chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
            )
        else:  # metered all the same (below), but not handed to a client that did not ask
            assert all(c.choices for c in chunks)
    with pytest.raises(openai.NotFoundError):  # llama-server itself would answer 200
        client.chat.completions.create(model="smollm2-135", messages=MESSAGES, max_tokens=2)
    gw.stop()
    gw.start()
    (row,) = [u for u in gw.admin("/admin/api/usage", admin).json()["usage"] if u["key"] == "user"]
    assert row["requests"] == 4 and row["completion_tokens"] == 4 * reply.usage.completion_tokens
