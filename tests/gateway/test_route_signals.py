"""Routing by what the engines say, end to end on loopback: in-process gateways (each its
own pool, as each worker process has) in front of engines that are real HTTP servers
serving a real vLLM /metrics page, edited per test for their queue and KV cache."""

from __future__ import annotations

import asyncio
import io
import json
import re
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.serving.affinity import rendezvous, request_key
from llmgw_cli.core.serving.keys import ApiKey, hash_token
from llmgw_cli.gateway.control.fleet import FleetCollector
from llmgw_cli.gateway.control.sources import StaticSource
from llmgw_cli.gateway.control.state import Gateway
from llmgw_cli.gateway.serving.accesslog import AccessLog
from llmgw_cli.gateway.serving.server import admin_app, public_app
from llmgw_cli.gateway.store.sqlite import SqliteStore

from .harness import ENGINE_KEY, free_port

TOKEN = "client-secret"
ADMIN = "admin-secret"
PAGE = (Path(__file__).resolve().parents[1] / "data/vllm_metrics.prom").read_text()
SYSTEM = "You are the billing desk of a large utility. Answer in two sentences. " * 20  # 1,400 chars


def metrics_page(waiting: float = 0, running: float = 0, kv: float = 0) -> str:
    """The real vLLM scrape with its engine's queue, running count and KV cache set."""
    page = PAGE
    for name, value in (
        ("vllm:num_requests_waiting", waiting),
        ("vllm:num_requests_running", running),
        ("vllm:kv_cache_usage_perc", kv),
    ):
        line = f'{name}{{engine="0",model_name="m"}} 0.0'
        assert page.count(line) == 1, line
        page = page.replace(line, f'{name}{{engine="0",model_name="m"}} {float(value)}')
    return page


@dataclass
class FakeEngine:
    """A vLLM stand-in: /health, /metrics (``mode``: ok, error, hang) and chat completions
    that answer with the engine's address, counting what it served."""

    page: str = field(default_factory=metrics_page)
    mode: str = "ok"
    served: int = 0
    metrics_auth: list[str | None] = field(default_factory=list)
    address: str = ""

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def metrics(self, request: web.Request) -> web.Response:
        self.metrics_auth.append(request.headers.get("Authorization"))
        if request.headers.get("Authorization") != f"Bearer {ENGINE_KEY}":
            return web.Response(status=401)
        if self.mode == "error":
            return web.Response(status=500, text="boom")
        if self.mode == "hang":
            await asyncio.sleep(30)
        return web.Response(text=self.page, content_type="text/plain")

    async def chat(self, request: web.Request) -> web.Response:
        await request.read()
        self.served += 1
        answer = {
            "id": "c",
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": self.address}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        }
        return web.json_response(answer)


@asynccontextmanager
async def engine_server(engine: FakeEngine) -> AsyncIterator[FakeEngine]:
    app = web.Application()
    app.router.add_get("/health", engine.health)
    app.router.add_get("/metrics", engine.metrics)
    app.router.add_post("/v1/chat/completions", engine.chat)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    engine.address = f"127.0.0.1:{port}"
    try:
        yield engine
    finally:
        await runner.cleanup()


def cluster(routing: str = "{}", interval: str = "100ms", timeout: str = "100ms") -> str:
    return f"""\
cluster: {{name: t}}
gateway: {{signals_interval: {interval}, signals_timeout: {timeout}}}
profiles: {{vllm: {{engine: vllm}}}}
models:
  - {{name: m, source: org/m, fetch: engine, profile: vllm, scaling: {{min: 1, max: 2}}, routing: {routing}}}
"""


@dataclass
class Front:
    """One gateway process's worth of state, its public API on a loopback port."""

    gw: Gateway
    client: TestClient[web.Request, web.Application]
    log: io.BytesIO

    async def ask(self, system: str = SYSTEM, user: str = "What do I owe?") -> tuple[str, float]:
        """One chat request: the replica that answered it, and how long it took."""
        body = {
            "model": "m",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        }
        started = time.monotonic()
        resp = await self.client.post(
            "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {TOKEN}"}
        )
        assert resp.status == 200, await resp.text()
        answer = await resp.json()
        return answer["choices"][0]["message"]["content"], time.monotonic() - started

    def samples(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        self.gw.metrics.build(FleetCollector(self.gw))
        text = self.gw.metrics.render()
        assert text is not None
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text.decode())
            for s in f.samples
        }

    def decisions(self, reason: str) -> float:
        got = self.samples()
        return sum(
            v
            for (n, labels), v in got.items()
            if n == "llmgw_route_decisions_total" and ("reason", reason) in labels
        )

    def log_lines(self) -> list[dict[str, object]]:
        self.gw.flush_log()
        return [json.loads(line) for line in self.log.getvalue().splitlines()]


@asynccontextmanager
async def front(tmp_path: Path, name: str, spec_text: str, addresses: list[str]) -> AsyncIterator[Front]:
    store = SqliteStore(tmp_path / name)
    await store.add_key(ApiKey(name="k", digest=hash_token(TOKEN)))
    await store.add_key(ApiKey(name="admin", digest=hash_token(ADMIN), admin=True))
    log = io.BytesIO()
    gw = Gateway(
        parse_cluster(spec_text),
        StaticSource({"m": addresses}),
        store,
        ENGINE_KEY,
        discover_every=3600.0,
        health_every=0.05,
        access_log=AccessLog(log),
    )
    await gw.start()
    client = TestClient(TestServer(public_app(gw), host="127.0.0.1"))
    await client.start_server()
    try:
        yield Front(gw, client, log)
    finally:
        await client.close()
        await gw.stop()


async def until(condition: Callable[[], bool], seconds: float = 5.0) -> None:
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.02)


def ready(f: Front, *, signals: bool = True) -> Callable[[], bool]:
    return lambda: (
        f.gw.pool.ready_count("m") == 2
        and (not signals or all(r.signals is not None for r in f.gw.pool.of("m")))
    )


def waiting_seen(f: Front, address: str, value: float) -> Callable[[], bool]:
    """The gateway has scraped ``value`` as the replica's queue."""

    def seen() -> bool:
        r = next(r for r in f.gw.pool.of("m") if r.address == address)
        return r.signals is not None and r.signals.waiting == value

    return seen


def key_replica(system: str, addresses: list[str]) -> str:
    body = {
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "x"}],
    }
    key = request_key(body, None)
    assert key is not None
    return rendezvous(key, addresses)[0]


def test_a_shared_system_prompt_goes_to_one_replica_from_two_gateway_processes(tmp_path: Path) -> None:
    """Each process decides alone, from its own pool, and they agree: the replica of the
    prompt's key; prompts of other keys spread over both replicas."""

    async def scenario() -> None:
        async with AsyncExitStack() as stack:
            a = await stack.enter_async_context(engine_server(FakeEngine()))
            b = await stack.enter_async_context(engine_server(FakeEngine()))
            addresses = [a.address, b.address]
            one = await stack.enter_async_context(front(tmp_path, "one", cluster(), addresses))
            two = await stack.enter_async_context(
                front(tmp_path, "two", cluster(), list(reversed(addresses)))
            )
            await until(ready(one))
            await until(ready(two))
            systems = [f"Desk {i}. " + SYSTEM for i in range(16)]
            for system in systems:
                expected = key_replica(system, addresses)
                served = {
                    (await g.ask(system, user=f"question {n}"))[0] for n, g in enumerate((one, two, one, two))
                }
                assert served == {expected}, system[:10]
            assert len({key_replica(s, addresses) for s in systems}) == 2  # both replicas hold keys
            assert one.decisions("affinity") == two.decisions("affinity") == 32
            assert all(a == f"Bearer {ENGINE_KEY}" for a in a.metrics_auth)  # scraped with the engine key

    asyncio.run(scenario())


def test_an_overloaded_engine_yields_its_requests_to_the_other_replica(tmp_path: Path) -> None:
    """Its /metrics says 9 requests wait, above max_waiting 4: the key's requests go to
    the other replica, counted as overloaded, and come back once its queue is short."""

    async def scenario() -> None:
        async with AsyncExitStack() as stack:
            a = await stack.enter_async_context(engine_server(FakeEngine()))
            b = await stack.enter_async_context(engine_server(FakeEngine()))
            addresses = [a.address, b.address]
            g = await stack.enter_async_context(front(tmp_path, "g", cluster(), addresses))
            await until(ready(g))
            first = key_replica(SYSTEM, addresses)
            other = b.address if first == a.address else a.address
            assert (await g.ask())[0] == first
            busy = a if first == a.address else b
            busy.page = metrics_page(waiting=9, running=4, kv=0.5)
            await until(waiting_seen(g, first, 9.0))
            assert [(await g.ask())[0] for _ in range(3)] == [other] * 3
            assert g.decisions("overloaded") == 3
            got = g.samples()
            assert got[("llmgw_replica_engine_waiting", (("address", first), ("model", "m")))] == 9
            assert got[("llmgw_replica_engine_running", (("address", first), ("model", "m")))] == 4
            assert got[("llmgw_replica_engine_kv_usage", (("address", first), ("model", "m")))] == 0.5
            assert 0 <= got[("llmgw_replica_signals_age_seconds", (("address", first), ("model", "m")))] < 2
            busy.page = metrics_page(waiting=2)
            await until(waiting_seen(g, first, 2.0))
            assert (await g.ask())[0] == first

    asyncio.run(scenario())


def test_least_load_follows_the_engines_queues_when_the_gateways_counts_are_equal(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with AsyncExitStack() as stack:
            a = await stack.enter_async_context(engine_server(FakeEngine(metrics_page(waiting=5, running=3))))
            b = await stack.enter_async_context(engine_server(FakeEngine(metrics_page(waiting=0, running=3))))
            spec = cluster("{policy: least_load}")
            g = await stack.enter_async_context(front(tmp_path, "g", spec, [a.address, b.address]))
            await until(ready(g))
            assert {(await g.ask(f"{i} " + SYSTEM))[0] for i in range(4)} == {b.address}
            # Nothing in flight from the gateway either way: only the engines' queues differ.
            a.page, b.page = metrics_page(waiting=0, running=3), metrics_page(waiting=5, running=3)
            await until(waiting_seen(g, b.address, 5.0))
            await until(waiting_seen(g, a.address, 0.0))
            assert {(await g.ask(f"{i} " + SYSTEM))[0] for i in range(4)} == {a.address}
            assert g.decisions("least_load") == 8

    asyncio.run(scenario())


def test_round_robin_alternates(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with AsyncExitStack() as stack:
            a = await stack.enter_async_context(engine_server(FakeEngine()))
            b = await stack.enter_async_context(engine_server(FakeEngine()))
            spec = cluster("{policy: round_robin}")
            g = await stack.enter_async_context(front(tmp_path, "g", spec, [a.address, b.address]))
            await until(ready(g, signals=False))
            served = [(await g.ask())[0] for _ in range(6)]
            assert served[0::2] == [served[0]] * 3 and served[1::2] == [served[1]] * 3
            assert served[0] != served[1]
            assert g.decisions("round_robin") == 6

    asyncio.run(scenario())


def test_a_replica_whose_metrics_fail_or_hang_is_still_routed_and_no_request_waits(tmp_path: Path) -> None:
    """One /metrics answers 500, the other never answers within the timeout: requests are
    routed by the gateway's own counts, at once, while the scrapes fail; an overloaded
    replica whose scrapes then fail is routed again once its last reading is stale."""

    async def scenario() -> None:
        async with AsyncExitStack() as stack:
            a = await stack.enter_async_context(engine_server(FakeEngine(mode="error")))
            b = await stack.enter_async_context(engine_server(FakeEngine(mode="hang")))
            addresses = [a.address, b.address]
            g = await stack.enter_async_context(front(tmp_path, "g", cluster(), addresses))
            await until(ready(g, signals=False))
            await asyncio.sleep(0.5)  # several rounds of failed scrapes
            assert all(r.signals is None for r in g.gw.pool.of("m"))
            served = set()
            for i in range(20):
                replica, took = await g.ask(f"{i} " + SYSTEM)
                assert took < 1.0  # never held up by a scrape that hangs for 30 s
                served.add(replica)
            assert served == set(addresses)  # still routed, both of them
            assert {line["route"] for line in g.log_lines()} == {"affinity"}

            first = key_replica(SYSTEM, addresses)
            engine = a if first == a.address else b
            engine.page, engine.mode = metrics_page(waiting=9), "ok"
            await until(waiting_seen(g, first, 9.0))
            assert (await g.ask())[0] != first
            engine.mode = "error"  # its reading of 9 waiting ages
            stale = g.gw.signals_stale_after()
            await asyncio.sleep(stale + 0.2)
            assert (await g.ask())[0] == first

    asyncio.run(scenario())


def test_the_access_log_names_the_route_beside_the_replica(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with AsyncExitStack() as stack:
            a = await stack.enter_async_context(engine_server(FakeEngine()))
            b = await stack.enter_async_context(engine_server(FakeEngine()))
            addresses = [a.address, b.address]
            g = await stack.enter_async_context(front(tmp_path, "g", cluster(), addresses))
            await until(ready(g))
            await g.ask()
            await g.ask(system="short")  # under 256 characters: no key
            lines = g.log_lines()
            assert (lines[0]["replica"], lines[0]["route"]) == (key_replica(SYSTEM, addresses), "affinity")
            assert lines[1]["route"] == "no_prefix"
            assert list(lines[0]).index("route") == list(lines[0]).index("replica") + 1
            sessions: Counter[str] = Counter()
            for n in range(4):  # one session: one replica, whatever the prompt
                resp = await g.client.post(
                    "/v1/chat/completions",
                    json={"model": "m", "messages": [{"role": "user", "content": f"{n}"}]},
                    headers={"Authorization": f"Bearer {TOKEN}", "x-session-id": "s-1"},
                )
                sessions[(await resp.json())["choices"][0]["message"]["content"]] += 1
            assert len(sessions) == 1 and g.log_lines()[-1]["route"] == "affinity"

    asyncio.run(scenario())


def test_the_admin_summary_and_dashboard_show_each_replicas_queue_and_kv_as_read(tmp_path: Path) -> None:
    """One engine says 7 waiting, 3 running, 42% of its KV cache, with HTML in its labels
    and an absurd count on another engine; one never serves its /metrics: its signals are
    unknown (null, "—"), never 0. What an engine says reaches the page as formatted
    numbers only."""

    async def scenario() -> None:
        hostile = metrics_page(waiting=7, running=3, kv=0.42).replace(
            'model_name="m"', 'model_name="<script>alert(1)</script>"'
        )
        async with AsyncExitStack() as stack:
            a = await stack.enter_async_context(engine_server(FakeEngine(page=hostile)))
            b = await stack.enter_async_context(engine_server(FakeEngine(mode="error")))
            c = await stack.enter_async_context(engine_server(FakeEngine(page=metrics_page(waiting=1e300))))
            g = await stack.enter_async_context(
                front(
                    tmp_path, "g", cluster(interval="1s", timeout="500ms"), [a.address, b.address, c.address]
                )
            )
            await until(lambda: g.gw.pool.ready_count("m") == 3)
            await until(waiting_seen(g, a.address, 7.0))
            await until(waiting_seen(g, c.address, 1e300))
            admin = TestClient(TestServer(admin_app(g.gw), host="127.0.0.1"))
            await admin.start_server()
            stack.push_async_callback(admin.close)
            headers = {"Authorization": f"Bearer {ADMIN}"}
            resp = await admin.get("/admin/api/summary", headers=headers)
            assert resp.status == 200
            loads = {r["address"]: r["load"] for r in (await resp.json())["replicas"]}
            read = loads[a.address]
            assert read["read"] is True
            assert (read["waiting"], read["running"], read["kv_usage"]) == (7.0, 3.0, 0.42)
            assert 0 <= read["age_seconds"] < 2 * 1.2 + 0.5
            assert loads[b.address] == {
                "read": False,
                "waiting": None,
                "running": None,
                "kv_usage": None,
                "age_seconds": None,
            }
            assert loads[c.address]["waiting"] == 1e300

            resp = await admin.get("/admin", headers=headers)
            html = await resp.text()
            assert "<script>" not in html and "alert(1)" not in html
            rows = {addr: _cells(html, addr) for addr in (a.address, b.address, c.address)}
            assert rows[a.address]["queue"] == "7" and rows[a.address]["running"] == "3"
            assert rows[a.address]["kv"] == "42%" and rows[a.address]["signals"].startswith("read ")
            assert (rows[b.address]["queue"], rows[b.address]["kv"]) == ("\u2014", "\u2014")
            assert rows[b.address]["signals"] == "not read"
            assert rows[c.address]["queue"] == "1e+300"

    asyncio.run(scenario())


def _cells(html: str, address: str) -> dict[str, str]:
    """The text of the replicas table's cells of ``address``, by class (queue, kv...)."""
    row = html.split(f'data-address="{address}"', 1)[1].split("</tr>", 1)[0]
    found = {}
    for m in re.finditer(r'<td class="([^"]*)">(.*?)</td>', row, re.S):
        names = [c for c in m.group(1).split() if c not in ("n", "ok", "warn", "muted")]
        if names:
            found[names[0]] = m.group(2).strip()
    return found
