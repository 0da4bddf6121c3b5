"""The gateway's model controller on the lab: real gateway, real sshd, real systemd.

One cluster of two lab nodes and one gateway, shared by the tests of this module (in
this order; each leaves the lab as it found it, faults healed):

- `keeper` (always on, `min: 1`): its node becomes unreachable; the gateway answers
  again from the other node within `node_grace` + load time + a margin, and once the
  node is back it stops the old replica (replaced), so one replica runs, not two.
- `broken` (on demand, an engine flag the engine refuses: it exits at once): the request
  gets 503 `model_start_failed` with the journal's last lines within seconds, and a second
  request during the back-off gets the same answer at once without a second start.
- `slowpoke` (on demand, loads for minutes, its profile's `start_timeout` is 8s): the
  gateway is killed (SIGKILL, then SIGTERM) while it loads; the new gateway adopts the
  replica and stops it when it is not ready within `start_timeout`: no card stays held.
- `busy` (on demand, max 2, 5 tokens/s, `model_concurrency: 1`): requests/s with one
  replica, then with two after a scale-out; the second figure is clearly higher, so
  admission grows with the replicas.
- `keeper` again: healthy, then its node's engine program is replaced by one that exits
  and its engine is killed, so systemd restarts it over and over; the gateway stops it
  and answers again from a replica on the other node, and `llmgw status` shows it.
- `keeper` again: its card reports XID 79 (GPU fallen off the bus) in the node's kernel
  log while its engine runs on; the gateway replaces it on a healthy card within the
  recovery margin, successor first, and `llmgw status` shows the card faulty and why.

The measured figures are printed (`pytest -s` shows them; bench/controller.py measures
the first two as medians).
"""

from __future__ import annotations

import contextlib
import json
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from tests.gateway.harness import free_port, start_gateway, stop
from tests.waiting import wait_until

from .conftest import Lab
from .lab_helpers import admin_replicas, reset, run

pytestmark = pytest.mark.integration

MESSAGES = [{"role": "user", "content": "Say hi."}]
NODES = ("node01", "node02")
NODE_GRACE = 5.0  # gateway.node_grace in this module's cluster file
LOAD_SECONDS = 2.0  # the simulated engine's default load time
START_TIMEOUT = 8.0  # readiness.start_timeout of the `quick` profile
LOAD_WAIT = 10.0  # gateway.load_wait: how long a request waits for a replica to be ready
# Besides node_grace and the engine's load: noticing the loss (a probe of a node that does
# not answer takes up to twice ssh.connect_timeout, 5s in the lab), the start, and a busy
# machine (bench/RESULTS.md: where the time goes).
RECOVERY_MARGIN = 45.0
MODEL_SOURCE = "/data/models/Mistral-7B-Instruct-v0.3"

MODELS: list[dict[str, Any]] = [
    {"name": "keeper", "source": MODEL_SOURCE, "profile": "vllm", "scaling": {"min": 1, "max": 1}},
    {
        "name": "broken",
        "source": MODEL_SOURCE,
        "profile": "vllm",
        "args": ["--no-such-flag"],  # the engine refuses it and exits 2 at once
        "scaling": {"min": 0, "max": 1, "idle_timeout": "1h"},
    },
    {
        "name": "slowpoke",
        "source": MODEL_SOURCE,
        "profile": "quick",
        "env": {"LLMGW_LAB_LOAD_SECONDS": "600"},  # never ready within start_timeout
        "scaling": {"min": 0, "max": 1, "idle_timeout": "1h"},
    },
    {
        "name": "busy",
        "source": MODEL_SOURCE,
        "profile": "vllm",
        "env": {"LLMGW_LAB_LOAD_SECONDS": "1", "LLMGW_LAB_TOKENS_PER_SECOND": "5"},
        "scaling": {"min": 0, "max": 2},
    },
]


@dataclass
class Gw:
    """The module's gateway: its cluster file, ports, keys and log; restartable."""

    lab: Lab
    cluster: Path
    port: int
    admin_port: int
    metrics_port: int
    key: str
    admin: str
    log: Path
    options: list[str]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self) -> None:
        self.procs.append(start_gateway(self.cluster, self.log, *self.options, port=self.port))

    def halt(self, sig: int = signal.SIGTERM) -> None:
        stop(self.procs[-1], sig)

    def client(self, timeout: float = 30) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.port}/v1", api_key=self.key, max_retries=0, timeout=timeout
        )

    def replicas(self, model: str) -> list[dict[str, Any]]:
        return admin_replicas(self.admin_port, self.admin, model)

    def ready(self, model: str) -> list[str]:
        return sorted(r["address"] for r in self.replicas(model) if r["health"] == "ready")

    def log_text(self, since: int = 0) -> str:
        return self.log.read_text(errors="replace")[since:]

    def log_size(self) -> int:
        return len(self.log_text())

    def tail(self, since: int = 0, lines: int = 40) -> str:
        """The log's last lines since ``since``, without asyncssh's own, for a failure."""
        kept = [line for line in self.log_text(since).splitlines() if not line.startswith("[conn=")]
        return "\n".join(kept[-lines:])


def _cluster(lab: Lab, folder: Path, ports: tuple[int, int, int]) -> Path:
    data = yaml.safe_load(lab.cluster_file.read_text())
    data["nodes"] = [n for n in data["nodes"] if n["name"] in NODES]
    port, admin_port, metrics_port = ports
    data["gateway"].update(
        listen=f"127.0.0.1:{port}",
        admin_listen=f"127.0.0.1:{admin_port}",
        metrics_listen=f"127.0.0.1:{metrics_port}",
        state_dir=str(folder / "state"),
        load_wait=f"{LOAD_WAIT:g}s",
        model_concurrency=1,
        scale_out_wait="1s",
        node_grace=f"{NODE_GRACE:g}s",
        start_backoff="10s",
    )
    quick = dict(data["profiles"]["vllm"])
    quick.update(readiness={"start_timeout": f"{START_TIMEOUT:g}s"}, ports="8400-8499")
    data["profiles"]["quick"] = quick
    data["models"] = MODELS
    path = folder / "cluster.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def gw(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gw]:
    folder = tmp_path_factory.mktemp("controller")
    reset(lab)
    ports = (free_port(), free_port(), free_port())
    cluster = _cluster(lab, folder, ports)
    # apply starts keeper (min 1) and gives the gateway its key and the nodes their helper
    applied = run("apply", "-f", str(cluster), "--yes")
    assert applied.returncode == 0, applied.stdout + applied.stderr
    key = run("keys", "create", "--name", "lab-user", "-f", str(cluster)).stdout.strip()
    admin = run("keys", "create", "--name", "ops", "--admin", "-f", str(cluster)).stdout.strip()
    options = ["--engine-keys-file", str(folder / "state/engine-keys.json")]
    options += ["--identity-file", str(folder / "state/ssh-key")]
    options += ["--discover-every", "1", "--health-every", "0.5", "--flush-every", "0.5"]
    served = Gw(lab, cluster, *ports, key, admin, folder / "gateway.log", options)
    served.start()
    try:
        yield served
    finally:
        for proc in served.procs:
            stop(proc)
        reset(lab)


# --- looking at the nodes ----------------------------------------------------------------


def running_units(lab: Lab, node: str, model: str) -> set[str]:
    """The model's units on ``node`` that run or are about to (active, activating,
    reloading: what holds cards), read with the lab's own root login."""
    pattern = shlex.quote(f"llmgw-{model}-*")
    done = lab.ssh(
        node,
        f"systemctl list-units --plain --no-legend --state=active,activating,reloading {pattern}"
        " | awk '{print $1}'",
        timeout=20,
    )
    assert done.returncode == 0, done.stderr
    return set(done.stdout.split())


def where_running(lab: Lab, model: str, nodes: tuple[str, ...] = NODES) -> dict[str, set[str]]:
    return {node: units for node in nodes if (units := running_units(lab, node, model))}


def node_ip(lab: Lab, name: str) -> str:
    return next(n.ip for n in lab.nodes if n.name == name)


# --- asking the gateway ------------------------------------------------------------------


def ask(client: openai.OpenAI, model: str, max_tokens: int = 4) -> str:
    reply = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=max_tokens)  # type: ignore[arg-type]
    return reply.choices[0].message.content or ""


def refusal(exc: openai.APIStatusError) -> tuple[int, str, str]:
    """Status, OpenAI error code and message of a refusal."""
    try:
        error = exc.response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return exc.status_code, "", exc.response.text
    return exc.status_code, str(error.get("code") or ""), str(error.get("message") or "")


def answered_within(client: openai.OpenAI, model: str, seconds: float) -> float:
    """Ask until answered (any refusal or failed connection meanwhile is "not yet");
    returns the seconds it took."""
    started = time.monotonic()
    errors: list[str] = []

    def once() -> bool:
        try:
            ask(client, model)
        except openai.APIStatusError as exc:
            errors.append(str(refusal(exc))[:300])
            return False
        except openai.APIConnectionError as exc:  # a timeout too
            errors.append(f"{type(exc).__name__}: {exc}"[:300])
            return False
        return True

    wait_until(
        once,
        timeout=seconds,
        interval=0.25,
        what=lambda: f"{model} to answer; last refusals: {errors[-3:]}",
    )
    return time.monotonic() - started


# --- 1. a node is lost -------------------------------------------------------------------


def test_a_lost_node_s_model_answers_again_from_another_node(lab: Lab, gw: Gw) -> None:
    client = gw.client(timeout=LOAD_WAIT + 5)
    try:
        answered_within(client, "keeper", 30)
        placed = where_running(lab, "keeper")
        assert len(placed) == 1 and len(next(iter(placed.values()))) == 1, placed
        (lost,) = placed
        (other,) = (n for n in NODES if n != lost)
        mark = gw.log_size()

        lab.fault(lost, "node", "unreachable")
        try:
            seconds = answered_within(client, "keeper", NODE_GRACE + LOAD_SECONDS + RECOVERY_MARGIN + 30)
            print(f"\nkeeper answered again {seconds:.1f}s after {lost} became unreachable")
            # answered by a replica on the other node, started there by the gateway
            replacement = running_units(lab, other, "keeper")
            assert replacement, gw.tail(mark)
            # numbered apart from the lost one, which still runs on the lost node: the same
            # number would make the two one replica once the node answers again
            assert not replacement & placed[lost], (replacement, placed[lost])
            assert all(a.startswith(f"{node_ip(lab, other)}:") for a in gw.ready("keeper")), gw.replicas(
                "keeper"
            )
            assert seconds < NODE_GRACE + LOAD_SECONDS + RECOVERY_MARGIN, seconds
            assert "keeper: starting replica" in gw.log_text(mark)
        finally:
            lab.fault(lost, "node", "reachable")
        healed = time.monotonic()

        # The old replica ran on through the outage: once its node answers again the
        # gateway stops it (it was replaced), so min (1) replicas run, not two.
        wait_until(
            lambda: not running_units(lab, lost, "keeper"),
            timeout=45,
            interval=0.5,
            what=lambda: f"the replaced replica on {lost} to be stopped:\n{gw.tail(mark)}",
        )
        print(
            f"the replaced replica on {lost} was stopped {time.monotonic() - healed:.1f}s after it came back"
        )
        assert set(where_running(lab, "keeper")) == {other}
        assert len(running_units(lab, other, "keeper")) == 1
        assert "keeper: stopping replica" in gw.log_text(mark)
        answered_within(client, "keeper", 10)
    finally:
        client.close()


# --- 2. a start that fails at once -------------------------------------------------------


def test_an_engine_that_exits_at_once_is_reported_within_seconds(lab: Lab, gw: Gw) -> None:
    client = gw.client(timeout=LOAD_WAIT + 10)
    mark = gw.log_size()
    try:
        started = time.monotonic()

        def start_failed() -> openai.APIStatusError | None:
            try:
                ask(client, "broken")
            except openai.APIStatusError as exc:
                status, code, message = refusal(exc)
                if code == "model_start_failed":
                    return exc
                # until the failure is known, the start is under way
                assert (status, code) == (503, "model_loading"), (status, code, message)
                return None
            raise AssertionError("broken answered, yet its engine cannot start")

        first = wait_until(
            start_failed,
            timeout=30,
            interval=0.2,
            what=lambda: f"503 model_start_failed for broken:\n{gw.tail(mark)}",
        )
        assert first is not None
        seconds = time.monotonic() - started
        print(f"\nbroken: 503 model_start_failed {seconds:.1f}s after the first request")
        status, _, message = refusal(first)
        assert status == 503
        assert message.startswith("The model `broken` could not be started"), message
        # the engine's own complaint, from its journal: in the gateway's log, under the
        # request id the client was given, never in the answer
        assert "--no-such-flag" not in message, message
        rid = first.request_id
        assert rid is not None and f"(request id {rid})" in message, message
        logged = [line for line in gw.log_text(mark).splitlines() if rid in line]
        assert any("--no-such-flag" in line for line in logged), gw.tail(mark)
        retry_after = first.response.headers.get("Retry-After")
        assert retry_after is not None and 1 <= float(retry_after) <= 11, retry_after  # start_backoff 10s
        assert seconds < 15, seconds

        # During the back-off the same answer comes at once, and nothing starts again.
        asked = time.monotonic()
        with pytest.raises(openai.APIStatusError) as again:
            ask(client, "broken")
        at_once = time.monotonic() - asked
        assert refusal(again.value)[:2] == (503, "model_start_failed"), refusal(again.value)
        assert "--no-such-flag" not in refusal(again.value)[2]
        assert again.value.response.headers.get("Retry-After")
        assert at_once < 2, at_once

        # The failed replica's units are stopped (its cards go back), and no second start came.
        wait_until(
            lambda: not where_running(lab, "broken"),
            timeout=30,
            interval=0.5,
            what=lambda: f"broken's failed unit to be stopped:\n{gw.tail(mark)}",
        )
        log = gw.log_text(mark)
        assert log.count("broken: starting replica") == 1, gw.tail(mark)
        assert "broken: start failed:" in log, gw.tail(mark)
    finally:
        client.close()


# --- 3. the gateway restarts while a replica loads ---------------------------------------


def _kick(gw: Gw, model: str) -> None:
    """A request that makes the gateway start ``model``; its answer does not matter (it
    waits load_wait; this one gives up after a second)."""
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(
            f"http://127.0.0.1:{gw.port}/v1/chat/completions",
            json={"model": model, "messages": MESSAGES, "max_tokens": 4},
            headers={"Authorization": f"Bearer {gw.key}"},
            timeout=1,
        )


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_a_replica_loading_across_a_gateway_restart_is_adopted_then_stopped(
    lab: Lab, gw: Gw, sig: signal.Signals
) -> None:
    mark = gw.log_size()

    def loading() -> dict[str, set[str]]:
        _kick(gw, "slowpoke")  # again while a back-off from an earlier failure runs
        return where_running(lab, "slowpoke")

    placed = wait_until(
        loading,
        timeout=45,
        interval=1,
        what=lambda: f"slowpoke's unit to start:\n{gw.tail(mark)}",
    )
    assert len(placed) == 1, placed
    gw.halt(sig)
    assert where_running(lab, "slowpoke") == placed  # the engine loads on: nothing stopped it
    restart = gw.log_size()
    gw.start()
    restarted = time.monotonic()

    # It never becomes ready within start_timeout (8s): the new gateway stops it.
    wait_until(
        lambda: not where_running(lab, "slowpoke"),
        timeout=START_TIMEOUT + 25,
        interval=0.5,
        what=lambda: f"slowpoke's units to be stopped by the new gateway:\n{gw.tail(restart)}",
    )
    seconds = time.monotonic() - restarted
    print(f"\n{sig.name}: slowpoke stopped {seconds:.1f}s after the gateway restarted")
    log = gw.log_text(restart)
    assert "slowpoke: stopping replica" in log, gw.tail(restart)
    assert "slowpoke: starting replica" not in log, gw.tail(restart)  # adopted, not started anew
    assert seconds < START_TIMEOUT + 20, seconds


# --- 4. a scale-out raises throughput ----------------------------------------------------


def _rate(client: openai.OpenAI, clients: int, each: int) -> float:
    """Requests per second of ``clients`` clients asking ``each`` times in a row."""

    def one(_: int) -> int:
        return sum(1 for _ in range(each) if ask(client, "busy", max_tokens=5))

    started = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        done = sum(pool.map(one, range(clients)))
    assert done == clients * each
    return done / (time.monotonic() - started)


def test_a_scale_out_raises_throughput(lab: Lab, gw: Gw) -> None:
    client = gw.client(timeout=120)
    mark = gw.log_size()
    try:
        answered_within(client, "busy", 40)  # the first request starts replica 0
        assert len(gw.ready("busy")) == 1

        # One replica takes one request at a time (model_concurrency 1): one client fills it
        # and never queues, so no scale-out yet.
        one = _rate(client, clients=1, each=6)
        placed = where_running(lab, "busy")
        assert sum(len(u) for u in placed.values()) == 1, placed

        # Four clients at once queue past scale_out_wait (1s): the gateway starts a second
        # replica. Keep them asking until both are ready.
        stop_asking = threading.Event()

        def keep_asking(_: int) -> None:
            while not stop_asking.is_set():
                ask(client, "busy", max_tokens=5)

        with ThreadPoolExecutor(4) as pool:
            askers = [pool.submit(keep_asking, i) for i in range(4)]
            try:
                wait_until(
                    lambda: len(gw.ready("busy")) == 2,
                    timeout=60,
                    interval=0.5,
                    what=lambda: f"a second replica of busy:\n{gw.tail(mark)}",
                )
            finally:
                stop_asking.set()
            for asker in askers:
                asker.result()

        two = _rate(client, clients=4, each=4)
        print(f"\nbusy: {one:.2f} requests/s with one replica, {two:.2f} with two ({two / one:.2f}x)")
        assert two > 1.5 * one, (one, two)
        placed = where_running(lab, "busy")
        assert sum(len(u) for u in placed.values()) == 2, placed
    finally:
        client.close()


# --- 5. a healthy replica starts crash-looping ---------------------------------------------

ENGINE = "/opt/vllm/bin/vllm"  # the profile's program on each lab node (a small script)
SAVED = ENGINE + ".lab-saved"
EXITS = "#!/bin/sh\necho 'lab: this engine program exits at once' >&2\nexit 1\n"


def test_a_replica_that_starts_crash_looping_is_replaced_on_another_node(lab: Lab, gw: Gw) -> None:
    client = gw.client(timeout=LOAD_WAIT + 5)
    mark = gw.log_size()
    try:
        answered_within(client, "keeper", 60)
        placed = where_running(lab, "keeper")
        assert len(placed) == 1, placed
        ((broken, (unit,)),) = placed.items()
        (other,) = (n for n in NODES if n != broken)
        saved = lab.ssh(broken, f"cp -p {ENGINE} {SAVED} && printf %s {shlex.quote(EXITS)} > {ENGINE}")
        assert saved.returncode == 0, saved.stderr
        try:
            # the engine dies; systemd starts the program again, which now exits at once
            killed = lab.ssh(broken, f"systemctl kill --signal=SIGKILL {unit}")
            assert killed.returncode == 0, killed.stderr
            seconds = answered_within(client, "keeper", 90)
            print(f"\nkeeper answered again {seconds:.1f}s after its engine began to crash-loop")
            log = gw.log_text(mark)
            assert f"its engine is crash-looping on {broken}" in log, gw.tail(mark)
            # not on the broken node's other cards, where the same program would exit too
            assert running_units(lab, other, "keeper"), gw.tail(mark)
            assert all(a.startswith(f"{node_ip(lab, other)}:") for a in gw.ready("keeper")), gw.replicas(
                "keeper"
            )
            wait_until(
                lambda: not running_units(lab, broken, "keeper"),
                timeout=30,
                interval=0.5,
                what=lambda: f"the crash-looping unit on {broken} to be stopped:\n{gw.tail(mark)}",
            )
            done = run("status", "-f", str(gw.cluster), "--json")
            rows = [r for r in json.loads(done.stdout)["health"] if r["model"] == "keeper"]
            assert done.returncode == 0, (done.stderr, rows)  # keeper has its min again
            # the crashed replica is gone (its units removed), or shown as not running
            assert {r["state"] for r in rows if broken in r["nodes"]} <= {"crash-looping", "failed"}, rows
            assert [r["state"] for r in rows if other in r["nodes"]] == ["ready"], rows
        finally:
            lab.ssh(broken, f"mv -f {SAVED} {ENGINE}")
    finally:
        client.close()


# --- 6. a card of a serving replica reports a fatal XID --------------------------------------


def card_index(lab: Lab, node: str, uuid: str) -> int:
    done = lab.ssh(node, "nvidia-smi --query-gpu=index,uuid --format=csv,noheader")
    assert done.returncode == 0, done.stderr
    return next(int(i) for i, u in (line.split(", ") for line in done.stdout.splitlines()) if u == uuid)


def unit_cards(lab: Lab, node: str, unit: str) -> list[str]:
    done = lab.ssh(node, f"sed -n 's/^X-Llmgw-Gpus=//p' /etc/systemd/system/{shlex.quote(unit)}")
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(",")


def test_a_replica_whose_card_reports_xid_79_is_replaced_on_healthy_cards(lab: Lab, gw: Gw) -> None:
    """XID 79 lands in the node's kernel log while keeper's engine runs on (the lab's engine
    does not notice, a real one might not at once): the gateway's probe reads it through
    the node helper, takes the card out and starts a successor on a healthy card first;
    `llmgw status` shows the card faulty with the XID's meaning."""
    client = gw.client(timeout=LOAD_WAIT + 5)
    mark = gw.log_size()
    answered_within(client, "keeper", 60)
    placed = where_running(lab, "keeper")
    assert len(placed) == 1, placed
    ((node, (unit,)),) = placed.items()
    (card,) = unit_cards(lab, node, unit)
    index = card_index(lab, node, card)
    try:
        lab.fault(node, "gpu", str(index), "xid", "79")
        injected = time.monotonic()

        def replaced() -> bool:
            running = where_running(lab, "keeper")
            units = [(n, u) for n, us in running.items() for u in us]
            return bool(gw.ready("keeper")) and (node, unit) not in units and len(units) == 1

        wait_until(
            replaced,
            timeout=LOAD_SECONDS + RECOVERY_MARGIN,
            interval=0.5,
            what=lambda: f"keeper to be replaced off GPU {index} of {node}:\n{gw.tail(mark)}",
        )
        seconds = time.monotonic() - injected
        print(f"\nkeeper replaced off a card with XID 79 {seconds:.1f}s after the report")
        ((now_on, (successor,)),) = where_running(lab, "keeper").items()
        assert card not in unit_cards(lab, now_on, successor)
        log = gw.log_text(mark)
        assert "it holds a faulty card" in log and "XID 79: GPU has fallen off the bus" in log, gw.tail(mark)
        answered_within(client, "keeper", 10)
        done = run("status", "-f", str(gw.cluster), "--json")
        row = next(n for n in json.loads(done.stdout)["nodes"] if n["name"] == node)
        assert row["faulty"] == 1, row
        assert row["faulty_reasons"] == [f"GPU {index}: XID 79: GPU has fallen off the bus"], row
        (faulty,) = row["faulty_cards"]
        assert (faulty["gpu"], faulty["causes"]) == (str(index), ["xid-79"]), faulty
        assert "reboot" in faulty["action"], faulty
    finally:
        lab.fault(node, "gpu", str(index), "healthy")
        client.close()
