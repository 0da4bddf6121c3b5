"""The whole loop on the lab: `llmgw apply` starts replicas under real systemd, `llmgw
gateway run` finds them by probing the nodes (their units' labels) and serves them to the
official openai client: the real llama-server and the simulated vLLM."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.gateway.harness import free_port, stop, wait_http

from .conftest import Lab
from .lab_helpers import cluster_variant, reset, run

pytestmark = pytest.mark.integration


@pytest.fixture
def served(lab: Lab, tmp_path: Path) -> Iterator[openai.OpenAI]:
    reset(lab)
    port = free_port()
    cluster = cluster_variant(
        lab,
        tmp_path,
        replace=(
            ("listen: 127.0.0.1:8080", f"listen: 127.0.0.1:{port}"),
            ("admin_listen: 127.0.0.1:9090", f"admin_listen: 127.0.0.1:{free_port()}"),
            ("metrics_listen: 127.0.0.1:9100", f"metrics_listen: 127.0.0.1:{free_port()}"),
            ("state_dir: /var/lib/llmgw-lab/gateway", f"state_dir: {tmp_path / 'state'}"),
        ),
    )
    applied = run("apply", "-f", str(cluster), "--yes")
    assert applied.returncode == 0, applied.stdout + applied.stderr
    engine_env = tmp_path / "engine.env"
    engine_env.write_text(lab.ssh("node01", "cat /etc/llmgw/engine.env").stdout)
    key = run("keys", "create", "--name", "lab-user", "-f", str(cluster)).stdout.strip()
    log = tmp_path / "gateway.log"
    argv = [sys.executable, "-m", "llmgw_cli", "gateway", "run", "-f", str(cluster)]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*argv, "--engine-key-file", str(engine_env)], stdout=out, stderr=subprocess.STDOUT
        )
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=60)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc, log)
        yield client
    finally:
        client.close()
        stop(proc)
        reset(lab)


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
