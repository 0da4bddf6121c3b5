"""A fallback on the lab: real gateway, real sshd, real systemd. `primary` and `backup`
(each a whole node's eight cards, so on two nodes) run; `primary`'s node becomes
unreachable and a request for `primary` is answered by `backup`, which the answer says
(`x-llmgw-served-by`, its `model` field) and the usage counts."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from tests.gateway.harness import free_port, start_gateway, stop
from tests.waiting import wait_until

from .conftest import Lab
from .lab_helpers import reset, run
from .test_controller_lab import MODEL_SOURCE, where_running

pytestmark = pytest.mark.integration

NODES = ("node01", "node02")
MESSAGES: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "Say hi."}]


def _model(name: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "source": MODEL_SOURCE,
        "profile": "vllm",
        "tensor_parallel": 8,
        "scaling": {"min": 1, "max": 1},
        **extra,
    }


@pytest.fixture(scope="module")
def served(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[openai.OpenAI, str, int]]:
    folder = tmp_path_factory.mktemp("fallback")
    reset(lab)
    data = yaml.safe_load(lab.cluster_file.read_text())
    data["nodes"] = [n for n in data["nodes"] if n["name"] in NODES]
    port, admin_port = free_port(), free_port()
    data["gateway"].update(
        listen=f"127.0.0.1:{port}",
        admin_listen=f"127.0.0.1:{admin_port}",
        metrics_listen=f"127.0.0.1:{free_port()}",
        state_dir=str(folder / "state"),
        load_wait="3s",
        node_grace="5s",
        # a request on a connection opened before the node went silent waits first_byte
        timeouts={"connect": "2s", "first_byte": "5s"},
    )
    data["models"] = [_model("primary", fallbacks=["backup"]), _model("backup")]
    cluster = folder / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(data, sort_keys=False))
    applied = run("apply", "-f", str(cluster), "--yes")
    assert applied.returncode == 0, applied.stdout + applied.stderr
    key = run("keys", "create", "--name", "lab-user", "-f", str(cluster)).stdout.strip()
    options = ["--engine-keys-file", str(folder / "state/engine-keys.json")]
    options += ["--identity-file", str(folder / "state/ssh-key")]
    options += ["--discover-every", "1", "--health-every", "0.5", "--flush-every", "0.5"]
    log = folder / "gateway.log"
    proc = start_gateway(cluster, log, *options, port=port)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=60)
    try:
        yield client, str(log), admin_port
    finally:
        client.close()
        stop(proc)
        reset(lab)


def _served_by(client: openai.OpenAI, model: str) -> tuple[str, str]:
    raw = client.chat.completions.with_raw_response.create(model=model, messages=MESSAGES, max_tokens=4)
    return raw.headers["x-llmgw-served-by"], raw.parse().model


def test_a_fallback_serves_while_the_primary_s_only_node_is_unreachable(
    lab: Lab, served: tuple[openai.OpenAI, str, int]
) -> None:
    client, log, _ = served

    def answered(model: str) -> bool:
        try:
            return _served_by(client, model) == (model, model)
        except openai.APIError:
            return False

    for model in ("primary", "backup"):
        wait_until(lambda m=model: answered(m), timeout=60, interval=0.5, what=f"{model} to answer")  # type: ignore[misc]
    placed = where_running(lab, "primary")
    assert len(placed) == 1 and not set(placed) & set(where_running(lab, "backup")), placed
    (lost,) = placed
    lab.fault(lost, "node", "unreachable")
    try:
        # At once: the gateway still routes to the replica, on a connection that gets no
        # answer (first_byte), then falls back.
        started = time.monotonic()
        assert _served_by(client, "primary") == ("backup", "backup")
        print(f"\nprimary's node unreachable: backup answered in {time.monotonic() - started:.1f}s")
        # Still so once the gateway has seen the replica fail, and past node_grace: no
        # other node has room for `primary` (`backup`, min 1, is never evicted).
        time.sleep(8)
        assert _served_by(client, "primary") == ("backup", "backup")
        assert "could not answer, trying its next fallback" in Path(log).read_text(errors="replace")
    finally:
        lab.fault(lost, "node", "reachable")
    wait_until(lambda: answered("primary"), timeout=90, interval=1, what="primary to answer again")
