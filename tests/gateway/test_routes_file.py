"""The routes file of `llmgw gateway run` (``core/drain.py``), which ``apply`` reads to know
what the gateway routes: it appears once the gateway runs, follows a replica going unready
and ready again, is written again within a second of SIGUSR1 (a probe round), and is
removed when the gateway stops. Real processes: simulated engines and the gateway."""

from __future__ import annotations

import signal
import stat
from pathlib import Path

import pytest

from llmgw_cli.core.drain import Routes, parse_routes
from tests.gateway.harness import Engine, Gateway
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

MODEL = {"name": "chat", "source": "org/chat", "profile": "sim", "scaling": {"min": 1, "max": 2}}


def read(path: Path) -> Routes | None:
    try:
        return parse_routes(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None


def test_the_routes_file_follows_what_the_gateway_routes_and_goes_with_it(tmp_path: Path) -> None:
    engines = [Engine(tmp_path, "chat"), Engine(tmp_path, "chat")]
    both = frozenset(e.address for e in engines)
    gw = Gateway(tmp_path, [MODEL], {"chat": sorted(both)})
    gw.start()
    assert gw.proc is not None
    folder = tmp_path / "state" / "routes"
    path = folder / f"{gw.proc.pid}.json"

    def routes_when(what: str, ready: frozenset[str]) -> Routes:
        found = wait_until(
            lambda: read(path),
            until=lambda r: r is not None and r.ready.get("chat", frozenset()) == ready,
            timeout=20,
            what=lambda: f"the routes file to say {what}:\n{gw.log.read_text()[-2000:]}",
        )
        assert found is not None
        return found

    try:
        first = routes_when("both replicas ready", both)
        assert first.pid == gw.proc.pid and first.draining == frozenset()
        assert stat.S_IMODE(path.stat().st_mode) == 0o644
        assert stat.S_IMODE(folder.stat().st_mode) == 0o755
        engines[1].stop()  # its health check fails: out of the ready set
        routes_when("one replica ready", frozenset({engines[0].address}))
        engines[1] = Engine(tmp_path, "chat", port=engines[1].port)
        before = routes_when("both ready again", both)
        # SIGUSR1: a probe round now (with --replicas there is none for an hour), which
        # writes the file again even though nothing changed
        gw.proc.send_signal(signal.SIGUSR1)
        wait_until(
            lambda: read(path),
            until=lambda r: r is not None and r.written > before.written,
            timeout=5,
            what="the routes file written again after SIGUSR1",
        )
        assert gw.proc.poll() is None  # handled, not the signal's default (the end)
        assert "gateway discover failed" not in gw.log.read_text()
    finally:
        code = gw.stop()
        for engine in engines:
            engine.stop()
    assert code == 0
    assert not path.exists()
    assert list(folder.iterdir()) == []  # no temporary file left either


def test_a_routes_file_of_a_gateway_process_that_is_gone_is_removed_at_start(tmp_path: Path) -> None:
    engine = Engine(tmp_path, "chat")
    gw = Gateway(tmp_path, [MODEL], {"chat": [engine.address]})
    folder = tmp_path / "state" / "routes"
    folder.mkdir(parents=True)
    gone = folder / "999999999.json"  # above any pid_max: no such process
    gone.write_text('{"pid": 999999999, "written": 0, "ready": {}, "draining": []}\n')
    gw.start()
    try:
        assert gw.proc is not None
        wait_until(
            lambda: (folder / f"{gw.proc.pid}.json").exists() if gw.proc else False,
            timeout=20,
            what="its own routes file",
        )
        assert not gone.exists()
    finally:
        gw.stop()
        engine.stop()
