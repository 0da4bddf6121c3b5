"""One writer at a time, on the lab: `llmgw apply` of an always-on model while the gateway
starts an on-demand model on the same node (8 simulated cards, both models want one).

Both plan on a probe of their own; without the cluster lock each would see the first
card and port free and take them.

- Both wait: the test holds the lock itself, asks the gateway for the on-demand model
  (its start waits), runs apply (it probes, plans, then waits and says for whom), then
  lets go. Whichever goes first, the other probes again under the lock.
- apply's plan goes stale: apply shows its plan and asks; meanwhile the gateway starts
  the on-demand model on the card that plan chose. Under the lock apply finds the nodes
  changed, shows the plan again and asks again.

Either way no two replica units share a GPU or a port.
"""

from __future__ import annotations

import fcntl
import os
import pty
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from llmgw_cli.core.planning.cluster_lock import lock_path
from tests.gateway.harness import free_port, start_gateway, stop
from tests.waiting import wait_until

from .conftest import Lab
from .lab_helpers import reset, run

pytestmark = pytest.mark.integration

ON_DEMAND: dict[str, object] = {
    "name": "gamma",
    "source": "/data/models/Mistral-7B-Instruct-v0.3",
    "profile": "vllm",
    "env": {"LLMGW_LAB_LOAD_SECONDS": "3"},
    "scaling": {"min": 0, "max": 1, "idle_timeout": "1h"},
}
ALWAYS_ON: dict[str, object] = {
    "name": "steady",
    "source": "/data/models/Llama-3.1-8B-Instruct",
    "profile": "vllm",
    "env": {"LLMGW_LAB_LOAD_SECONDS": "1"},
    "scaling": {"min": 1, "max": 1},
}
TEST_HOLDER = "the lab test"


def _cluster(
    lab: Lab, path: Path, state: Path, ports: tuple[int, int, int], models: list[dict[str, object]]
) -> Path:
    data = yaml.safe_load(lab.cluster_file.read_text())
    data["nodes"] = [n for n in data["nodes"] if n["name"] == "node01"]
    port, admin_port, metrics_port = ports
    data["gateway"].update(
        listen=f"127.0.0.1:{port}",
        admin_listen=f"127.0.0.1:{admin_port}",
        metrics_listen=f"127.0.0.1:{metrics_port}",
        state_dir=str(state),
        load_wait="1s",
    )
    data["models"] = models
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def replica_units(lab: Lab) -> list[dict[str, str]]:
    """Every replica unit file on node01 with its labels (model, replica, GPUs, port)."""
    done = lab.ssh(
        "node01",
        'for f in /etc/systemd/system/llmgw-*.service; do [ -f "$f" ] || continue; '
        'echo "unit=$(basename "$f")"; grep \'^X-Llmgw-\' "$f"; echo; done',
    )
    assert done.returncode == 0, done.stderr
    units = []
    for block in done.stdout.strip().split("\n\n"):
        if block.strip():
            pairs = (line.partition("=") for line in block.splitlines())
            units.append({k.removeprefix("X-Llmgw-").lower(): v for k, _, v in pairs})
    return units


@pytest.fixture
def held_lock(tmp_path: Path) -> Iterator[list[int]]:
    """The cluster lock, held by the test until it closes the descriptor it yields."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700, exist_ok=True)
    fd = os.open(lock_path(str(state)), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, f"{TEST_HOLDER}\n".encode())
    held = [fd]
    try:
        yield held
    finally:
        for open_fd in held:
            os.close(open_fd)


@dataclass
class Scene:
    """node01 with nothing running, the gateway serving the on-demand model (started from
    a file without the always-on one), and apply's file with both."""

    gateway_file: Path
    apply_file: Path
    log: Path
    port: int
    key: str

    def ask_gamma(self) -> None:
        """A request for gamma: answered 503 (loading) while the gateway starts it."""
        asked = httpx.post(
            f"http://127.0.0.1:{self.port}/v1/chat/completions",
            headers={"Authorization": f"Bearer {self.key}"},
            json={"model": "gamma", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            timeout=30,
        )
        assert asked.status_code == 503, asked.text

    def gateway_said(self) -> str:
        return self.log.read_text()[-3000:]


@pytest.fixture
def scene(lab: Lab, tmp_path: Path) -> Iterator[Scene]:
    reset(lab)
    state = tmp_path / "state"
    state.mkdir(mode=0o700, exist_ok=True)
    ports = (free_port(), free_port(), free_port())
    gateway_file = _cluster(lab, tmp_path / "gateway.yaml", state, ports, [ON_DEMAND])
    apply_file = _cluster(lab, tmp_path / "cluster.yaml", state, ports, [ON_DEMAND, ALWAYS_ON])
    # apply with the on-demand model only starts nothing (and takes no lock): it gives the
    # gateway its key and the node its helper
    setup = run("apply", "-f", str(gateway_file), "--yes")
    assert setup.returncode == 0, setup.stdout + setup.stderr
    key = run("keys", "create", "--name", "lab-user", "-f", str(gateway_file)).stdout.strip()
    log = tmp_path / "gateway.log"
    options = [
        "--engine-keys-file",
        str(state / "engine-keys.json"),
        "--identity-file",
        str(state / "ssh-key"),
    ]
    gateway = start_gateway(gateway_file, log, *options, "--health-every", "0.5", port=ports[0])
    try:
        yield Scene(gateway_file, apply_file, log, ports[0], key)
    finally:
        stop(gateway)
        reset(lab)


def assert_one_card_and_port_each(lab: Lab) -> None:
    units = replica_units(lab)
    assert sorted(u["model"] for u in units) == ["gamma", "steady"], units
    cards = [g for u in units for g in u["gpus"].split(",") if g]
    assert len(cards) == 2 and len(set(cards)) == 2, units
    assert len({u["port"] for u in units}) == 2, units


def test_apply_waits_for_the_gateway_and_they_never_share_a_card_or_port(
    lab: Lab, tmp_path: Path, held_lock: list[int], scene: Scene
) -> None:
    apply_err = tmp_path / "apply.err"
    waiting = f"waiting for the cluster lock held by {TEST_HOLDER}"
    applying: subprocess.Popen[bytes] | None = None
    try:
        # 1. the gateway's start of gamma waits for the lock the test holds
        scene.ask_gamma()
        wait_until(lambda: waiting in scene.log.read_text(), timeout=30, what=f"the gateway: {waiting!r}")
        # 2. apply probes and plans steady on a node where nothing runs yet, then waits
        with apply_err.open("wb") as err_out:
            applying = subprocess.Popen(
                [sys.executable, "-m", "llmgw_cli", "apply", "-f", str(scene.apply_file), "--yes"],
                stdout=subprocess.DEVNULL,
                stderr=err_out,
            )
        wait_until(
            lambda: waiting in apply_err.read_text(),
            timeout=120,
            what=lambda: f"apply: {waiting!r}; it said: {apply_err.read_text()}",
        )
        assert replica_units(lab) == []
        # 3. let go: one of them writes its units, the other probes again under the lock
        os.close(held_lock.pop())
        assert applying.wait(timeout=240) == 0, apply_err.read_text()
        wait_until(
            lambda: "gamma" in {u.get("model") for u in replica_units(lab)},
            timeout=60,
            what=lambda: f"gamma's unit; gateway log: {scene.gateway_said()}",
        )
    finally:
        if applying is not None and applying.poll() is None:
            applying.kill()
            applying.wait()
    said = apply_err.read_text()
    assert said.count("waiting for the cluster lock held by") == 1, said
    assert_one_card_and_port_each(lab)


def test_apply_plans_again_when_the_gateway_started_a_replica_since_its_plan(
    lab: Lab, tmp_path: Path, scene: Scene
) -> None:
    """apply shows its plan and asks; meanwhile the gateway starts gamma on the card that
    plan chose. Under the lock apply finds the nodes changed, shows the new plan and asks
    again: steady goes on another card."""
    out, err = tmp_path / "apply.out", tmp_path / "apply.err"
    master, slave = pty.openpty()  # apply asks only on a terminal
    applying: subprocess.Popen[bytes] | None = None

    def asked() -> int:  # the prompt goes to stderr, beside the plan's other messages
        return err.read_text().count("Apply these changes?")

    try:
        with out.open("wb") as out_file, err.open("wb") as err_file:
            applying = subprocess.Popen(
                [sys.executable, "-m", "llmgw_cli", "apply", "-f", str(scene.apply_file)],
                stdin=slave,
                stdout=out_file,
                stderr=err_file,
            )
        os.close(slave)
        wait_until(asked, timeout=120, what=lambda: f"apply to ask; it said: {err.read_text()}")
        assert replica_units(lab) == []  # its plan was made on a node where nothing runs
        scene.ask_gamma()
        wait_until(
            lambda: "gamma" in {u.get("model") for u in replica_units(lab)},
            timeout=60,
            what=lambda: f"gamma's unit; gateway log: {scene.gateway_said()}",
        )
        os.write(master, b"y\n")
        wait_until(lambda: asked() == 2, timeout=120, what=lambda: f"apply to ask again: {err.read_text()}")
        os.write(master, b"y\n")
        assert applying.wait(timeout=240) == 0, err.read_text()
    finally:
        os.close(master)
        if applying is not None and applying.poll() is None:
            applying.kill()
            applying.wait()
    assert "The nodes changed since the plan above was made; the plan now:" in err.read_text()
    assert_one_card_and_port_each(lab)
