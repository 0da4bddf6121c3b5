"""Several gateway processes on one host (gateway/control/workers.py): real `llmgw gateway run
--workers N` supervisors with their real worker processes, a simulated engine, and the
sockets either bound by each worker (SO_REUSEPORT) or inherited the way systemd passes
them (fds 3, 4, ..., LISTEN_PID)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
from pathlib import Path

import httpx
import pytest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.harness import Engine, Gateway, start_gateway, stop
from tests.gateway.test_systemd_sockets import gateway_sockets, listening, run_on_sockets
from tests.integration.load import running_load
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

MODELS: list[dict[str, object]] = [{"name": "m", "source": "org/m", "fetch": "engine", "profile": "sim"}]
STARTED = re.compile(r"^worker (\d+) started \(pid (\d+)\)$", re.M)


def start(gw: Gateway, workers: int) -> subprocess.Popen[bytes]:
    options = ["--replicas", str(gw.replicas), "--engine-key-file", str(gw.dir / "engine.env")]
    options += ["--health-every", "0.3", "--flush-every", "0.3", "--workers", str(workers)]
    proc = start_gateway(gw.cluster, gw.log, *options, port=gw.port)
    gw.proc = proc
    wait_until(
        lambda: f"all {workers} workers ready" in gw.log.read_text(),
        timeout=60,
        what=lambda: f"every worker ready:\n{gw.log.read_text()[-3000:]}",
    )
    return proc


def worker_pids(log: Path) -> dict[int, int]:
    """Worker index -> pid of its latest start, from the supervisor's log."""
    return {int(index): int(pid) for index, pid in STARTED.findall(log.read_text())}


def native_serving_libraries(pid: int) -> set[str]:
    """The serving stack's compiled modules mapped in process ``pid`` (pydantic's core,
    aiohttp's parsers): present in every worker, absent from a lean supervisor."""
    maps = Path(f"/proc/{pid}/maps").read_text().split()
    return {path for path in maps if "/pydantic_core/" in path or "/aiohttp/" in path}


def routes_pids(gw: Gateway) -> set[int]:
    return {int(p.stem) for p in (gw.dir / "state" / "routes").glob("*.json")}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def ask(gw: Gateway, key: str, times: int) -> list[int]:
    """``times`` chat completions, each on a new connection (the kernel picks a worker
    per connection); their statuses."""
    statuses = []
    for _ in range(times):
        with httpx.Client(timeout=30) as client:
            answer = client.post(
                f"http://127.0.0.1:{gw.port}/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                headers={"Authorization": f"Bearer {key}"},
            )
        statuses.append(answer.status_code)
    return statuses


def answered(gw: Gateway) -> float:
    """Requests answered 200, as /metrics (worker 0) counts them: every worker's."""
    text = httpx.get(f"http://127.0.0.1:{gw.metrics_port}/metrics", timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "llmgw_requests_total" and s.labels.get("status") == "200"
    )


def answered_by(gw: Gateway, supervisor: int) -> dict[int, float]:
    """Requests answered 200 by each worker (pid), from its own counter file."""
    found: dict[int, float] = {}
    for path in (gw.dir / "state" / "metrics" / str(supervisor)).glob("counter_*.db"):
        pid = int(path.stem.removeprefix("counter_"))
        found[pid] = sum(
            s.value
            for family in MultiProcessCollector.merge([str(path)])  # type: ignore[no-untyped-call]
            for s in family.samples
            if s.name == "llmgw_requests_total" and s.labels.get("status") == "200"
        )
    return found


def stored_requests(gw: Gateway, admin_key: str) -> int:
    usage = gw.admin("/admin/api/usage", admin_key).json()["usage"]
    return sum(int(u["requests"]) for u in usage if u["model"] == "m")


def test_several_workers_answer_on_one_port_and_share_the_store(tmp_path: Path) -> None:
    engine = Engine(tmp_path, "m")
    gw = Gateway(tmp_path, MODELS, {"m": [engine.address]})
    key = gw.cli("keys", "create", "--name", "client")
    admin_key = gw.cli("keys", "create", "--name", "ops", "--admin")
    proc = start(gw, 3)
    try:
        pids = worker_pids(gw.log)
        assert sorted(pids) == [0, 1, 2] and proc.pid not in pids.values()
        # The supervisor replaced the CLI by its lean entry (gateway/supervisor.py): the
        # same pid, without the serving stack that each worker loads.
        assert "llmgw_cli.gateway.supervisor" in Path(f"/proc/{proc.pid}/cmdline").read_text()
        assert native_serving_libraries(proc.pid) == set()
        assert all(native_serving_libraries(pid) for pid in pids.values())
        # Each worker is a whole gateway: it writes its own routes file (apply reads them all).
        wait_until(lambda: routes_pids(gw) == set(pids.values()), timeout=30, what="a routes file per worker")
        assert ask(gw, key, 60) == [200] * 60
        # Every worker answered some (the kernel spreads connections), and /metrics,
        # served by worker 0, counts them all.
        counts = answered_by(gw, proc.pid)
        assert set(counts) == set(pids.values()) and all(counts.values()), counts
        assert sum(counts.values()) == 60 and answered(gw) == 60
        # Usage goes to the one store of the host: every worker's requests are counted once.
        wait_until(
            lambda: stored_requests(gw, admin_key), until=lambda n: n == 60, timeout=30, what="usage of 60"
        )
        # SIGHUP reaches every worker: each reads the cluster file again.
        proc.send_signal(signal.SIGHUP)
        wait_until(
            lambda: gw.log.read_text().count("reloaded the cluster file"),
            until=lambda n: n == 3,
            timeout=30,
            what="three reloads",
        )
        assert stop(proc, wait=60) == 0
        log = gw.log.read_text()
        assert "stopping: SIGTERM passed to every worker" in log
        assert all(f"worker {i} exited (status 0)" in log for i in range(3)), log[-3000:]
        assert not any(alive(pid) for pid in pids.values())
        assert routes_pids(gw) == set()  # each removed its own on the way out
        assert not (gw.dir / "state" / "metrics" / str(proc.pid)).exists()
    finally:
        if proc.poll() is None:
            stop(proc, signal.SIGKILL)
        engine.stop()


def test_a_killed_worker_is_started_again_while_the_others_serve(tmp_path: Path) -> None:
    engine = Engine(tmp_path, "m")
    gw = Gateway(tmp_path, MODELS, {"m": [engine.address]})
    key = gw.cli("keys", "create", "--name", "client")
    proc = start(gw, 2)
    try:
        first = worker_pids(gw.log)
        assert ask(gw, key, 10) == [200] * 10
        os.kill(first[1], signal.SIGKILL)
        wait_until(
            lambda: "worker 1 exited (killed by SIGKILL)" in gw.log.read_text(),
            timeout=30,
            what=lambda: f"the supervisor to see the death:\n{gw.log.read_text()[-3000:]}",
        )
        # Its socket closed with it: every new connection goes to worker 0 meanwhile.
        assert ask(gw, key, 10) == [200] * 10
        again = wait_until(
            lambda: worker_pids(gw.log)[1],
            until=lambda pid: pid != first[1],
            timeout=30,
            what=lambda: f"worker 1 started again:\n{gw.log.read_text()[-3000:]}",
        )
        assert "worker 1 exited (killed by SIGKILL) after" in gw.log.read_text()
        assert "starting it again in 1s" in gw.log.read_text()
        wait_until(lambda: again in routes_pids(gw), timeout=60, what="the new worker's routes file")
        assert alive(first[0]) and worker_pids(gw.log)[0] == first[0]  # worker 0 was left alone
        # The new worker 1 takes its share of new connections; /metrics still counts what
        # the dead one answered (a counter never goes back).
        assert ask(gw, key, 40) == [200] * 40
        assert answered_by(gw, proc.pid).get(again, 0) > 0
        assert answered(gw) == 60
        assert stop(proc, wait=60) == 0
        assert not alive(again) and not alive(first[0])
    finally:
        if proc.poll() is None:
            stop(proc, signal.SIGKILL)
        engine.stop()


def test_workers_share_the_sockets_systemd_passed_and_the_supervisor_alone_tells_systemd(
    tmp_path: Path,
) -> None:
    engine = Engine(tmp_path, "m")
    gw = Gateway(tmp_path, MODELS, {"m": [engine.address]})
    key = gw.cli("keys", "create", "--name", "client")
    sockets = gateway_sockets(gw)
    path = tmp_path / "notify"
    sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sink.bind(str(path))
    sink.settimeout(60)
    log = tmp_path / "supervisor.log"
    proc = run_on_sockets(gw, sockets, path, log, "--workers", "2")
    try:
        # READY=1 once, from the supervisor, after both workers said it to the supervisor.
        assert sink.recv(4096) == b"READY=1", log.read_text()[-3000:]
        text = log.read_text()
        assert "supervising 2 gateway workers on 3 sockets from llmgw-gateway.socket" in text
        assert "all 2 workers ready" in text
        for i in (0, 1):
            assert f"[worker {i}] listening on 127.0.0.1:{gw.port} (from llmgw-gateway.socket)" in text
        # Only worker 0 serves the admin and metrics sockets.
        assert f"[worker 1] listening on 127.0.0.1:{gw.admin_port}" not in text
        assert f"[worker 0] listening on 127.0.0.1:{gw.admin_port} (from llmgw-gateway.socket)" in text
        assert ask(gw, key, 10) == [200] * 10
        assert httpx.get(f"http://127.0.0.1:{gw.admin_port}/admin/api/usage", timeout=5).status_code == 401
        assert stop(proc, wait=60) == 0
        # The next datagram is STOPPING=1: no worker sent its own READY=1 to systemd.
        assert sink.recv(4096) == b"STOPPING=1"
        sink.settimeout(0.5)
        with pytest.raises(TimeoutError):
            sink.recv(4096)
    finally:
        if proc.poll() is None:
            stop(proc, signal.SIGKILL)
        sink.close()
        engine.stop()
        for s in sockets:
            s.close()


def test_an_upgrade_hands_over_between_two_supervisors_without_a_refusal(tmp_path: Path) -> None:
    """What apply does with llmgw-gateway-handover.service, with two workers on each side:
    a second supervisor starts on the same sockets, the first stops (its workers drain).
    Streams flow throughout: none is cut, none refused beyond the rare reset of the
    one-process hand-over test."""
    engine = Engine(tmp_path, "m", tokens_per_second=40)
    gw = Gateway(tmp_path, MODELS, {"m": [engine.address]}, drain_timeout="10s")
    key = gw.cli("keys", "create", "--name", "load")
    sockets = gateway_sockets(gw)
    procs: list[subprocess.Popen[bytes]] = []

    def start_on_sockets(n: int) -> subprocess.Popen[bytes]:
        path = tmp_path / f"notify-{n}"
        log = tmp_path / f"supervisor-{n}.log"
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sink:
            sink.bind(str(path))
            sink.settimeout(90)
            proc = run_on_sockets(gw, sockets, path, log, "--workers", "2")
            procs.append(proc)
            assert sink.recv(4096) == b"READY=1", log.read_text()[-3000:]
        return proc

    try:
        first = start_on_sockets(1)
        with running_load(f"http://127.0.0.1:{gw.port}/v1", key, "m", concurrency=4, max_tokens=8) as load:
            second = start_on_sockets(2)
            assert stop(first, wait=60) == 0
            flowing = len(load.completed)
            wait_until(lambda: len(load.completed) >= flowing + 8, timeout=60, what="the load on the second")
        print(f"hand-over under load: {load.failures()}")
        assert not load.cut, load.failures()
        assert len(load.refused) <= 2, load.failures()
        assert all(r.status is None for r in load.refused), load.failures()
        assert "all 2 workers ready" in (tmp_path / "supervisor-2.log").read_text()
        assert stop(second, wait=60) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                stop(proc, signal.SIGKILL)
        engine.stop()
        for s in sockets:
            s.close()


def test_a_worker_that_cannot_start_fails_the_supervisor(tmp_path: Path) -> None:
    gw = Gateway(tmp_path, MODELS, {"m": []})
    sockets = [listening(port=gw.port)]  # the socket unit and the cluster file disagree
    log = tmp_path / "supervisor.log"
    proc = run_on_sockets(gw, sockets, None, log, "--workers", "2")
    try:
        assert proc.wait(60) == 1
        text = log.read_text()
        assert f"passed no socket for gateway.admin_listen 127.0.0.1:{gw.admin_port}" in text
        assert "before it was ready" in text and "all 2 workers ready" not in text
    finally:
        if proc.poll() is None:
            stop(proc, signal.SIGKILL)
        for s in sockets:
            s.close()
