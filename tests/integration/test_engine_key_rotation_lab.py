"""`llmgw apply --rotate-engine-key` on the lab: every node gets a new key while a client
keeps sending requests through the gateway, and none of them fails."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import openai
import pytest

from tests.gateway.harness import free_port, start_gateway, stop
from tests.integration.conftest import Lab
from tests.integration.lab_helpers import cluster_variant, reset, run

pytestmark = pytest.mark.integration

MODEL = "llama-3.1-8b-instruct"


def node_keys(lab: Lab) -> dict[str, str]:
    return {
        n.name: lab.ssh(n.name, "sed -n 's/^LLMGW_ENGINE_KEY=//p' /etc/llmgw/engine.env").stdout.strip()
        for n in lab.nodes
    }


def test_rotation_loses_no_request(lab: Lab, tmp_path: Path) -> None:
    reset(lab)
    port = free_port()
    state = tmp_path / "state"
    cluster = cluster_variant(
        lab,
        tmp_path,
        replace=(
            ("scaling: {min: 1, max: 1}", "scaling: {min: 0, max: 1}"),  # no llama-server
            ("scaling: {min: 1, max: 2, idle_timeout: 10m}", "scaling: {min: 2, max: 2}"),
            ("listen: 127.0.0.1:8080", f"listen: 127.0.0.1:{port}"),
            ("admin_listen: 127.0.0.1:9090", f"admin_listen: 127.0.0.1:{free_port()}"),
            ("metrics_listen: 127.0.0.1:9100", f"metrics_listen: 127.0.0.1:{free_port()}"),
            ("state_dir: /var/lib/llmgw-lab/gateway", f"state_dir: {state}"),
        ),
    )
    try:
        done = run("apply", "-f", str(cluster), "--yes")
        assert done.returncode == 0, done.stdout + done.stderr
        before = node_keys(lab)
        # apply left the gateway (run by hand here: the lab's host has no systemd) its map
        assert json.loads((state / "engine-keys.json").read_text()) == {n: [k] for n, k in before.items()}
        key = run("keys", "create", "--name", "rot", "-f", str(cluster)).stdout.strip()
        gateway = start_gateway(
            cluster, tmp_path / "gateway.log", "--identity-file", str(state / "ssh-key"), port=port
        )
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)
            failures: list[str] = []
            answered = [0]
            done_event = threading.Event()

            def keep_asking() -> None:
                while not done_event.is_set():
                    try:
                        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, timeout=30)
                        answered[0] += 1
                    except openai.OpenAIError as exc:
                        failures.append(repr(exc))

            threads = [threading.Thread(target=keep_asking) for _ in range(4)]
            for t in threads:
                t.start()
            started = time.monotonic()
            rotated = run("apply", "-f", str(cluster), "--yes", "--rotate-engine-key", timeout=600)
            took = time.monotonic() - started
            done_event.set()
            for t in threads:
                t.join(60)
            assert rotated.returncode == 0, rotated.stdout + rotated.stderr
            after = node_keys(lab)
            assert all(after[n] != before[n] and len(after[n]) == 64 for n in before), (before, after)
            assert json.loads((state / "engine-keys.json").read_text()) == {n: [k] for n, k in after.items()}
            assert rotated.stderr.count("replaced with the new engine key") == 2, rotated.stderr
            assert failures == [], failures[:5]
            assert answered[0] > 20
            print(
                f"rotation of 4 nodes, 2 replicas: {took:.1f} s, {answered[0]} requests answered, none failed"
            )
            # and after the rotation, the replicas answer with the new keys only
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2, timeout=30)
        finally:
            stop(gateway)
    finally:
        reset(lab)
