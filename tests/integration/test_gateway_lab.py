"""The whole loop on the lab: `llmgw apply` starts replicas under real systemd, `llmgw
gateway run` finds them by probing the nodes (their units' labels) and serves them to the
official openai client: the real llama-server and the simulated vLLM."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from .conftest import Lab
from .lab_helpers import applied_with_gateway

pytestmark = pytest.mark.integration


@pytest.fixture
def served(lab: Lab, tmp_path: Path) -> Iterator[openai.OpenAI]:
    with applied_with_gateway(lab, tmp_path) as gw:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{gw.port}/v1", api_key=gw.key, max_retries=0, timeout=60
        )
        try:
            yield client
        finally:
            client.close()


def test_gateway_serves_the_replicas_apply_started(served: openai.OpenAI) -> None:
    client = served
    states = {m.id: m.model_extra.get("state") if m.model_extra else None for m in client.models.list().data}
    assert states["smollm2-135m"] == "ready"
    assert states["llama-3.1-8b-instruct"] == "ready"
    assert states["mistral-7b-instruct"] == "off"
    for model in ("smollm2-135m", "llama-3.1-8b-instruct"):  # real llama-server, simulated vLLM
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=6, temperature=0
        )
        assert reply.choices[0].message.content
        chunks = list(
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=6, stream=True
            )
        )
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "x"}], max_tokens=2
        )
