"""A ready replica that fails its health check, or SIGUSR1, makes the gateway probe the
nodes at once, not at the next discovery round: a lost node is noticed within one probe,
and apply's changes within a second. What discovery drops keeps no upstream connection."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
from aiohttp import web

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.gateway.control.sources import StaticSource
from llmgw_cli.gateway.control.state import DISCOVER_SOON, Gateway
from llmgw_cli.gateway.store.sqlite import SqliteStore

from .harness import free_port

CLUSTER = """\
cluster: {name: t}
profiles: {vllm: {engine: vllm}}
models:
  - {name: m, source: org/m, fetch: engine, profile: vllm, scaling: {min: 1, max: 1}}
"""


class Counting(StaticSource):
    def __init__(self, replicas: dict[str, list[str]]) -> None:
        super().__init__(replicas)
        self.rounds = 0

    async def discover(self, spec: ClusterSpec) -> dict[str, list[str]]:
        self.rounds += 1
        return await super().discover(spec)


async def _until(condition: Callable[[], bool], seconds: float) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while loop.time() < end:
        if condition():
            return True
        await asyncio.sleep(0.02)
    return False


def test_a_replica_failing_its_health_check_brings_the_next_probe_forward(tmp_path: Path) -> None:
    async def scenario() -> None:
        async def health(_: web.Request) -> web.Response:
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_get("/health", health)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        source = Counting({"m": [f"127.0.0.1:{port}"]})
        spec = parse_cluster(CLUSTER)
        gw = Gateway(spec, source, SqliteStore(tmp_path), "k", discover_every=3600.0, health_every=0.05)
        await gw.start()
        try:
            assert await _until(lambda: gw.pool.ready_count("m") == 1, 5)
            rounds = source.rounds
            await asyncio.sleep(0.5)
            assert source.rounds == rounds  # nothing due for an hour
            await runner.cleanup()  # the engine is gone: its health check fails
            assert await _until(lambda: source.rounds > rounds, 5), "no probe after the failure"
        finally:
            await gw.stop()
            await runner.cleanup()

    asyncio.run(scenario())


def test_sigusr1_brings_the_next_probe_within_discover_soon(tmp_path: Path) -> None:
    async def scenario() -> None:
        source = Counting({"m": []})
        gw = Gateway(
            parse_cluster(CLUSTER),
            source,
            SqliteStore(tmp_path),
            "k",
            discover_every=3600.0,
            health_every=3600.0,
        )
        await gw.start()
        try:
            await asyncio.sleep(DISCOVER_SOON + 0.2)  # the last round is long enough ago
            rounds = source.rounds
            loop = asyncio.get_running_loop()
            sent = loop.time()
            os.kill(os.getpid(), signal.SIGUSR1)  # what apply sends (PROBE_NOW_SIGNAL)
            assert await _until(lambda: source.rounds > rounds, 5), "no probe after SIGUSR1"
            assert loop.time() - sent < DISCOVER_SOON
        finally:
            await gw.stop()

    asyncio.run(scenario())


def test_an_address_that_leaves_the_pool_keeps_no_idle_upstream_connection(tmp_path: Path) -> None:
    async def scenario() -> None:
        peers: set[object] = set()

        async def answer(request: web.Request) -> web.Response:
            peers.add(request.transport)
            return web.json_response({"ok": True})

        app = web.Application()
        app.router.add_post("/v1/completions", answer)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        address = f"127.0.0.1:{port}"
        source = Counting({"m": [address]})
        gw = Gateway(parse_cluster(CLUSTER), source, SqliteStore(tmp_path), "k", discover_every=3600.0)
        await gw.start()
        try:
            reply = await gw.upstreams.request(address, "/v1/completions", b"{}", 5)
            await reply.read()
            reply.release()
            assert gw.upstreams.idle_count(address) == 1
            source.replicas = {"m": []}  # discovery no longer finds it (drained, stopped)
            await gw.discover()
            assert gw.upstreams.idle_count(address) == 0
            server = runner.server
            assert server is not None
            assert await _until(lambda: not server.connections, 5), "the engine still has a connection"
        finally:
            await gw.stop()
            await runner.cleanup()

    asyncio.run(scenario())


def test_a_routes_file_that_cannot_be_written_is_said_once_and_routing_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        blocked = tmp_path / "not-a-folder"
        blocked.write_text("")  # the routes folder cannot be made here
        gw = Gateway(
            parse_cluster(CLUSTER),
            Counting({"m": []}),
            SqliteStore(tmp_path),
            "k",
            discover_every=3600.0,
            routes=blocked / "routes",
        )
        await gw.start()
        try:
            for _ in range(3):
                await gw.discover()
        finally:
            await gw.stop()

    asyncio.run(scenario())
    assert caplog.text.count("cannot write the routes file") == 1


def test_intervals_follow_the_cluster_file_through_a_reload_unless_given(tmp_path: Path) -> None:
    """A gateway given no intervals (the installed unit passes no flag) runs its jobs at
    the file's; SIGHUP's reload takes a changed file's; one given stays as given."""
    file = tmp_path / "cluster.yaml"
    file.write_text(CLUSTER + "gateway: {discover_every: 1h, health_every: 3s, flush_every: 7s}\n")

    async def scenario() -> None:
        def load() -> ClusterSpec:
            return parse_cluster(file.read_text())

        gw = Gateway(
            load(), Counting({"m": []}), SqliteStore(tmp_path), "k", reload_spec=load, flush_every=9.0
        )
        assert (gw.every["discover"], gw.every["health"], gw.every["flush"]) == (3600.0, 3.0, 9.0)
        await gw.start()
        try:
            file.write_text(CLUSTER + "gateway: {discover_every: 2h, health_every: 4s, flush_every: 8s}\n")
            await gw.reload()
            assert (gw.every["discover"], gw.every["health"], gw.every["flush"]) == (7200.0, 4.0, 9.0)
        finally:
            await gw.stop()

    asyncio.run(scenario())
