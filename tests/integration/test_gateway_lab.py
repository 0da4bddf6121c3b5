"""The whole loop on the lab: `llmgw apply` starts replicas under real systemd, `llmgw
gateway run` finds them by probing the nodes (their units' labels) and serves them to the
official openai client: the real llama-server and the simulated vLLM."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from llmgw_cli.polling import poll_until

from .conftest import Lab
from .lab_helpers import applied_with_gateway, logins, sshd_marks

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


def test_discovery_rounds_reuse_one_connection_per_node(lab: Lab, tmp_path: Path) -> None:
    """The gateway probes the nodes every second, over the connection it opened at the
    first round: each node's sshd lets the gateway's account in once."""
    marks = sshd_marks(lab)
    with applied_with_gateway(lab, tmp_path, "--discover-every", "1") as gw:
        ready = time.time()  # the first round ran before /health answered

        async def later_rounds() -> bool | None:
            async with httpx.AsyncClient() as client:
                summary = await client.get(
                    f"http://127.0.0.1:{gw.admin_port}/admin/api/summary",
                    headers={"Authorization": f"Bearer {gw.admin}"},
                )
            ages: dict[str, float] = summary.json()["probe_age_seconds"]
            probed = [time.time() - age for age in ages.values()]
            # every node probed successfully at least two rounds after the first
            return True if len(probed) == len(lab.nodes) and min(probed) > ready + 1.5 else None

        assert asyncio.run(poll_until(later_rounds, timeout=30, interval=0.5)), "no later discovery round"
        counts = {n.name: logins(lab, n.name, "llmgw-gateway", marks[n.name]) for n in lab.nodes}
    assert counts == {n.name: 1 for n in lab.nodes}
    # asyncssh's per-session lines (INFO) stay out of the gateway's journal
    assert "SSH session" not in (tmp_path / "gateway.log").read_text()
