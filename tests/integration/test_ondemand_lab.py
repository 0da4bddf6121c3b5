"""On-demand models on the lab, with the real gateway, real sshd and real systemd.

One node (8 simulated H100s) and three on-demand models: `gamma` (1 card, idle_timeout
4s), `alpha` and `beta` (8 cards each: only one of them fits). The gateway starts models
at their first request (the first caller gets 503 with Retry-After within load_wait),
stops idle ones, evicts an idle one to make room, and keeps last-use times across a
restart, so the eviction after the restart is not blocked by "unknown is not idle".
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tests.gateway.harness import free_port, start_gateway, stop
from tests.waiting import wait_until

from .conftest import Lab
from .lab_helpers import reset, run

pytestmark = pytest.mark.integration

MESSAGES = [{"role": "user", "content": "Say hi."}]


@dataclass
class Served:
    cluster: Path
    port: int
    admin_port: int
    metrics_port: int
    key: str
    admin: str
    log: Path
    start: Callable[[], None]
    stop: Callable[[], None]

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.port}/v1", api_key=self.key, max_retries=0, timeout=30
        )

    def admin_get(self, path: str) -> httpx.Response:
        return httpx.get(
            f"http://127.0.0.1:{self.admin_port}{path}",
            headers={"Authorization": f"Bearer {self.admin}"},
            timeout=10,
        )


SLOW_LOAD = {"LLMGW_LAB_LOAD_SECONDS": "3"}  # loads longer than load_wait

ON_DEMAND: list[dict[str, object]] = [
    {
        "name": "gamma",
        "source": "/data/models/Mistral-7B-Instruct-v0.3",
        "profile": "vllm",
        "env": SLOW_LOAD,
        "scaling": {"min": 0, "max": 1, "idle_timeout": "4s"},
    },
    *(
        {
            "name": name,
            "source": source,
            "profile": "vllm",
            "tensor_parallel": 8,
            "env": SLOW_LOAD,
            "scaling": {"min": 0, "max": 1, "idle_timeout": "1h"},
        }
        for name, source in (
            ("alpha", "/data/models/Llama-3.1-8B-Instruct"),
            ("beta", "/data/models/Mistral-7B-Instruct-v0.3"),
        )
    ),
]

# One model, slow to answer (5 tokens/s), one request at a time per replica: four
# requests at once queue up, and the gateway starts a second replica.
SATURABLE: list[dict[str, object]] = [
    {
        "name": "busy",
        "source": "/data/models/Mistral-7B-Instruct-v0.3",
        "profile": "vllm",
        "env": {"LLMGW_LAB_LOAD_SECONDS": "1", "LLMGW_LAB_TOKENS_PER_SECOND": "5"},
        "scaling": {"min": 0, "max": 2, "idle_timeout": "5s"},
    }
]


def _cluster(
    lab: Lab, folder: Path, ports: tuple[int, int, int], models: list[dict[str, object]], **gateway: str | int
) -> Path:
    data = yaml.safe_load(lab.cluster_file.read_text())
    data["nodes"] = [n for n in data["nodes"] if n["name"] == "node01"]
    port, admin_port, metrics_port = ports
    data["gateway"].update(
        listen=f"127.0.0.1:{port}",
        admin_listen=f"127.0.0.1:{admin_port}",
        metrics_listen=f"127.0.0.1:{metrics_port}",
        state_dir=str(folder / "state"),
        load_wait="1s",
        eviction_grace="2s",
        **gateway,
    )
    data["models"] = models
    path = folder / "cluster.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _serve(
    lab: Lab, tmp_path: Path, models: list[dict[str, object]], **gateway: str | int
) -> Iterator[Served]:
    reset(lab)
    port, admin_port, metrics_port = free_port(), free_port(), free_port()
    cluster = _cluster(lab, tmp_path, (port, admin_port, metrics_port), models, **gateway)
    # apply starts nothing here (every model is on demand) but gives the gateway its own
    # key and the node its helper: the gateway starts and stops replicas with that key only.
    applied = run("apply", "-f", str(cluster), "--yes")
    assert applied.returncode == 0, applied.stdout + applied.stderr
    key = run("keys", "create", "--name", "lab-user", "-f", str(cluster)).stdout.strip()
    admin = run("keys", "create", "--name", "ops", "--admin", "-f", str(cluster)).stdout.strip()
    log = tmp_path / "gateway.log"
    procs: list[subprocess.Popen[bytes]] = []
    # keys are per node: apply wrote every node's key and left the gateway their map
    options = ["--engine-keys-file", str(tmp_path / "state/engine-keys.json")]
    options += ["--health-every", "0.5", "--flush-every", "0.5"]
    options += ["--identity-file", str(tmp_path / "state/ssh-key")]

    def start() -> None:
        procs.append(start_gateway(cluster, log, *options, port=port))

    def halt() -> None:
        stop(procs[-1])

    start()
    try:
        yield Served(cluster, port, admin_port, metrics_port, key, admin, log, start, halt)
    finally:
        for proc in procs:
            stop(proc)
        reset(lab)


@pytest.fixture
def served(lab: Lab, tmp_path: Path) -> Iterator[Served]:
    yield from _serve(lab, tmp_path, ON_DEMAND)


@pytest.fixture
def saturable(lab: Lab, tmp_path: Path) -> Iterator[Served]:
    yield from _serve(lab, tmp_path, SATURABLE, model_concurrency=1, scale_out_wait="1s")


def units(lab: Lab) -> set[str]:
    done = lab.ssh("node01", "systemctl list-units --plain --no-legend 'llmgw-*' | awk '{print $1}'")
    return set(done.stdout.split())


def states(client: openai.OpenAI) -> dict[str, str]:
    return {m.id: str((m.model_extra or {}).get("state")) for m in client.models.list().data}


def serve_within(client: openai.OpenAI, model: str, seconds: float) -> str:
    """Ask until answered; every refusal meanwhile must be the 503 'loading'."""

    def ask() -> openai.types.chat.ChatCompletion | str:
        try:
            return client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4)  # type: ignore[arg-type]
        except openai.InternalServerError as exc:
            assert exc.status_code == 503 and "loading" in exc.message, exc.message
            return ""  # not yet: the last refusal is what the wait shows

    reply = wait_until(ask, timeout=seconds, interval=0.5, what=f"{model} to answer")
    assert not isinstance(reply, str)
    return reply.choices[0].message.content or ""


def test_on_demand_start_idle_stop_eviction_and_restart(lab: Lab, served: Served) -> None:
    client = served.client()
    try:
        assert set(states(client).values()) == {"stopped"}
        assert units(lab) == set()

        # Cold start: the first request waits load_wait (1 s) and gets 503 + Retry-After.
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError) as cold:
            client.chat.completions.create(model="gamma", messages=MESSAGES, max_tokens=4)  # type: ignore[arg-type]
        waited = time.monotonic() - started
        assert cold.value.status_code == 503 and "loading" in cold.value.message
        # what the start is doing, in fixed words: placing and starting, the engine loading
        doing = ("placing a replica", "starting the engine", "engine loading")
        assert any(f"is loading ({d})" in cold.value.message for d in doing), cold.value.message
        assert cold.value.response.headers.get("Retry-After")
        assert 0.9 <= waited < 5, waited
        assert states(client)["gamma"] == "starting"
        assert serve_within(client, "gamma", 30)
        assert states(client)["gamma"] == "ready"
        assert units(lab) == {"llmgw-gamma-0.service"}

        # idle_timeout 4 s: the replica is stopped and its unit removed.
        wait_until(
            lambda: units(lab) == set(), timeout=20, interval=0.5, what="gamma to stop after its idle_timeout"
        )
        assert states(client)["gamma"] == "stopped"

        # alpha takes the whole node.
        assert serve_within(client, "alpha", 30)
        assert units(lab) == {"llmgw-alpha-0.service"}
        time.sleep(1.5)  # past a flush of the last-use times

        # A restart keeps what the gateway knew about alpha's last use.
        before = [
            r for r in served.admin_get("/admin/api/replicas").json()["replicas"] if r["model"] == "alpha"
        ]
        assert before and before[0]["last_used"]
        served.stop()
        served.start()
        wait_until(
            lambda: any(
                r["model"] == "alpha" and r["health"] == "ready" and r["last_used"] == before[0]["last_used"]
                for r in served.admin_get("/admin/api/replicas").json()["replicas"]
            ),
            timeout=15,
            interval=0.5,
            what="alpha ready again with its last use known after the restart",
        )
        time.sleep(2.5)  # past the eviction grace (2 s) after alpha was seen ready again

        # beta does not fit next to alpha: alpha is idle (known), so it is evicted.
        assert serve_within(client, "beta", 40)
        assert units(lab) == {"llmgw-beta-0.service"}
        assert states(client)["alpha"] == "stopped"
        metrics = httpx.get(f"http://127.0.0.1:{served.metrics_port}/metrics", timeout=10).text
        assert 'llmgw_evictions_total{model="alpha"} 1.0' in metrics
        assert 'llmgw_model_loads_total{model="beta",result="ok"} 1.0' in metrics
        log = served.log.read_text()
        assert "gamma: stopping replica 0" in log and "idle" in log
        assert "evicted to make room for beta" in log
    finally:
        client.close()


def test_a_saturated_model_scales_out_and_back(lab: Lab, saturable: Served) -> None:
    client = saturable.client()
    try:
        assert serve_within(client, "busy", 30)  # the first request starts replica 0
        assert units(lab) == {"llmgw-busy-0.service"}

        def ask() -> int:
            chunks = list(
                client.chat.completions.create(model="busy", messages=MESSAGES, max_tokens=15, stream=True)  # type: ignore[arg-type]
            )
            return sum(1 for c in chunks if c.choices and c.choices[0].delta.content)

        # Four streams of 3 s each on one replica that takes one at a time: the queue waits
        # past scale_out_wait (1 s), so the gateway starts replica 1 and both serve.
        with ThreadPoolExecutor(4) as pool:
            answered = list(pool.map(lambda _: ask(), range(4)))
        assert answered == [15, 15, 15, 15]
        assert units(lab) == {"llmgw-busy-0.service", "llmgw-busy-1.service"}
        metrics = httpx.get(f"http://127.0.0.1:{saturable.metrics_port}/metrics", timeout=10).text
        assert 'llmgw_scale_outs_total{model="busy"} 1.0' in metrics
        replicas = saturable.admin_get("/admin/api/replicas").json()["replicas"]
        served_by = {r["address"]: r["requests"] for r in replicas if r["model"] == "busy"}
        assert len(served_by) == 2 and all(n >= 1 for n in served_by.values()), served_by

        # Idle for 5 s: back towards min (0), one replica after the other.
        wait_until(
            lambda: units(lab) == set(),
            timeout=30,
            interval=0.5,
            what="busy to scale back after idle_timeout",
        )
        # counted once each stop has finished (its units are gone a moment before)
        wait_until(
            lambda: (
                'llmgw_idle_stops_total{model="busy"} 2.0'
                in httpx.get(f"http://127.0.0.1:{saturable.metrics_port}/metrics", timeout=10).text
            ),
            timeout=10,
            interval=0.5,
            what="two idle stops to be counted",
        )
    finally:
        client.close()
