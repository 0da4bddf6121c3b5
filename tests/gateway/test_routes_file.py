"""The routes file of `llmgw gateway run` (``core/planning/drain.py``), which ``apply`` reads to know
what the gateway routes: it appears once the gateway runs, follows a replica going unready
and ready again, is written again within a second of SIGUSR1 (a probe round), and is
removed when the gateway stops (real processes: simulated engines and the gateway); and a
replica apply marks draining leaves it, keeping no connection from the gateway."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from aiohttp import web

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.observe.facts import NodeFacts
from llmgw_cli.core.planning.drain import Routes, parse_routes
from llmgw_cli.gateway.control import sources
from llmgw_cli.gateway.control.sources import ProbeSource
from llmgw_cli.gateway.control.state import Gateway
from llmgw_cli.gateway.store.sqlite import SqliteStore
from llmgw_cli.remote.probe import Snapshot
from tests.gateway import harness
from tests.gateway.harness import Engine, free_port
from tests.unit.facts_factory import unit_state
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

MODEL = {
    "name": "chat",
    "source": "org/chat",
    "fetch": "engine",
    "profile": "sim",
    "scaling": {"min": 1, "max": 2},
}


def read(path: Path) -> Routes | None:
    try:
        return parse_routes(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None


def test_the_routes_file_follows_what_the_gateway_routes_and_goes_with_it(tmp_path: Path) -> None:
    engines = [Engine(tmp_path, "chat"), Engine(tmp_path, "chat")]
    both = frozenset(e.address for e in engines)
    gw = harness.Gateway(tmp_path, [MODEL], {"chat": sorted(both)})
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
    gw = harness.Gateway(tmp_path, [MODEL], {"chat": [engine.address]})
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


# --- in one process: a probed cluster whose nodes are faked, engines real on loopback ---

PROBED = """\
cluster: {name: t}
nodes:
  - {name: a, address: 127.0.0.1}
profiles: {vllm: {engine: vllm}}
models:
  - {name: m, source: org/m, fetch: engine, profile: vllm, scaling: {min: 2, max: 2}}
"""


def _node(ports: list[int], draining: dict[str, float] | None = None) -> NodeFacts:
    units = {f"llmgw-m-{i}.service": port for i, port in enumerate(ports)}
    return NodeFacts(
        node="a",
        units=tuple(unit_state(name) for name in units),
        unit_labels={
            name: {
                "Model": "m",
                "Replica": name.split("-")[2].split(".")[0],
                "Port": str(port),
                "Members": "a",
            }
            for name, port in units.items()
        },
        draining=draining or {},
        clock=time.time(),
    )


def test_a_replica_apply_drains_leaves_the_routes_file_and_keeps_no_connection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def scenario() -> None:
        servers: list[web.AppRunner] = []
        ports: list[int] = []
        for _ in range(2):
            app = web.Application()
            app.router.add_get("/health", _ok)
            app.router.add_post("/v1/completions", _ok)
            runner = web.AppRunner(app)
            await runner.setup()
            ports.append(free_port())
            await web.TCPSite(runner, "127.0.0.1", ports[-1]).start()
            servers.append(runner)
        first, second = (f"127.0.0.1:{p}" for p in ports)
        facts = {"now": _node(ports)}

        async def gather(_spec: ClusterSpec, _conns: object, _nodes: object = None) -> Snapshot:
            return Snapshot(nodes=(facts["now"],), seconds=0.0)

        monkeypatch.setattr(sources, "gather", gather)
        folder = tmp_path / "routes"
        gw = Gateway(
            parse_cluster(PROBED),
            ProbeSource(tmp_path),
            SqliteStore(tmp_path),
            "k",
            discover_every=3600.0,
            health_every=0.05,
            routes=folder,
        )
        path = folder / f"{os.getpid()}.json"
        await gw.start()
        try:
            assert await _until(lambda: (r := read(path)) is not None and r.ready.get("m") == {first, second})
            reply = await gw.upstreams.request(second, "/v1/completions", b"{}", 5)
            await reply.read()
            reply.release()
            assert gw.upstreams.idle_count(second) == 1
            # apply marks the second draining, then signals the gateway
            facts["now"] = _node(ports, {"llmgw-m-1.service": time.time() + 30})
            os.kill(os.getpid(), signal.SIGUSR1)
            assert await _until(
                lambda: (
                    (r := read(path)) is not None and r.ready.get("m") == {first} and r.draining == {second}
                )
            )
            assert gw.upstreams.idle_count(second) == 0
            server = servers[1].server
            assert server is not None
            assert await _until(lambda: not server.connections), "the drained engine still has a connection"
            assert gw.controller.phase("m").value == "degraded"
            assert not gw.controller.actions  # nothing decided about it
        finally:
            await gw.stop()
            for runner in servers:
                await runner.cleanup()
        assert not path.exists()

    asyncio.run(scenario())


async def _ok(_request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def _until(condition: Callable[[], bool], seconds: float = 10) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while loop.time() < end:
        if condition():
            return True
        await asyncio.sleep(0.02)
    return False
