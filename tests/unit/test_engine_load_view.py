"""Each replica's engine load as the Summary carries it and ``llmgw status`` shows it: the
values while a reading is fresh, "—" (null in JSON) when none is, never a made-up 0; and
the path status reads it by (the engine's /metrics asked on the head node)."""

from __future__ import annotations

import asyncio
import json
from io import StringIO
from pathlib import Path

from aiohttp import web
from rich.console import Console

from llmgw_cli.cli.status import engine_loads
from llmgw_cli.cli.views import status_view
from llmgw_cli.core.serving.engine_signals import Signals
from llmgw_cli.core.views.summary import (
    UNKNOWN,
    EngineLoad,
    Live,
    LiveReplica,
    count_text,
    engine_load,
    share_text,
    summarize,
)
from llmgw_cli.remote.execute import METRICS_BYTES, metrics_page, response_body
from llmgw_cli.remote.local import LocalTransport

from .test_summary_scope import SPEC, running

PAGE = (Path(__file__).resolve().parents[1] / "data/vllm_metrics.prom").read_text()


def vllm_page(waiting: float, kv: float) -> str:
    page = PAGE
    for name, value in (("vllm:num_requests_waiting", waiting), ("vllm:kv_cache_usage_perc", kv)):
        line = f'{name}{{engine="0",model_name="m"}} 0.0'
        assert page.count(line) == 1, line
        page = page.replace(line, f'{name}{{engine="0",model_name="m"}} {float(value)}')
    return page


def test_a_fresh_reading_gives_its_values_a_stale_or_missing_one_none() -> None:
    signals = Signals(running=2.0, waiting=5.0, kv_usage=0.5)
    assert engine_load(signals, 1.23456, 10.0) == EngineLoad(
        read=True, waiting=5.0, running=2.0, kv_usage=0.5, age_seconds=1.235
    )
    # too old to route on: the values are not shown as current, the age is
    assert engine_load(signals, 11.0, 10.0) == EngineLoad(read=False, age_seconds=11.0)
    assert engine_load(None, None, 10.0) == EngineLoad()
    assert EngineLoad().waiting is None and EngineLoad().kv_usage is None  # unknown, not 0
    # a signal the engine does not report (llama-server's KV cache) stays unknown
    partial = engine_load(Signals(running=1.0, waiting=0.0), 0.0, 10.0)
    assert partial.read and partial.waiting == 0.0 and partial.kv_usage is None


def test_numbers_are_formatted_by_code() -> None:
    assert [count_text(v) for v in (None, 0.0, 3.0, 2.6, 1e300)] == [UNKNOWN, "0", "3", "3", "1e+300"]
    assert [share_text(v) for v in (None, 0.0, 0.256, 1.0)] == [UNKNOWN, "0%", "26%", "100%"]


def test_the_summary_carries_the_gateways_and_the_probes_readings() -> None:
    load = EngineLoad(read=True, waiting=4.0, running=1.0, kv_usage=0.3, age_seconds=0.5)
    live = Live(
        replicas=(
            LiveReplica(model="small", address="10.0.0.3:8100", health="ready", in_flight=0,
                        idle_seconds=1.0, load=load),
            LiveReplica(model="small", address="10.0.0.4:8100", health="ready", in_flight=0,
                        idle_seconds=1.0),
        )
    )  # fmt: skip
    rows = summarize(SPEC, {}, live).replicas
    assert [r.load for r in rows] == [load, EngineLoad()]
    dumped = summarize(SPEC, {}, live).model_dump(mode="json")["replicas"]
    assert dumped[1]["load"] == {
        "read": False,
        "waiting": None,
        "running": None,
        "kv_usage": None,
        "age_seconds": None,
    }

    facts = running()
    health = summarize(SPEC, facts).health
    first = (health[0].model, health[0].replica)
    with_loads = summarize(SPEC, facts, loads={first: load}).health
    assert with_loads[0].load == load
    assert all(r.load == EngineLoad() for r in with_loads[1:])


def shown(width: int = 200) -> tuple[str, dict[str, object]]:
    facts = running()
    health = summarize(SPEC, facts).health
    first = (health[0].model, health[0].replica)
    load = EngineLoad(read=True, waiting=12.0, running=3.0, kv_usage=0.875, age_seconds=0.0)
    summary = summarize(SPEC, facts, loads={first: load})
    out = StringIO()
    Console(file=out, width=width, force_terminal=False).print(status_view(summary, 0.5))
    return out.getvalue(), json.loads(json.dumps(summary.model_dump(mode="json")))


def test_status_shows_queue_and_kv_and_a_dash_where_unknown() -> None:
    text, report = shown()
    table = text[text.index("Replicas") :]
    header = next(line for line in table.splitlines() if "replica" in line and "state" in line)
    assert "queue" in header and "KV cache" in header
    rows = [line for line in table.splitlines() if "#" in line]
    assert len(rows) >= 2
    assert "12" in rows[0] and "88%" in rows[0]
    assert all(line.count(UNKNOWN) == 2 for line in rows[1:])
    # --json: the same, null where unknown
    health = report["health"]
    assert isinstance(health, list)
    assert health[0]["load"]["waiting"] == 12.0 and health[0]["load"]["kv_usage"] == 0.875
    assert all(h["load"]["waiting"] is None and h["load"]["read"] is False for h in health[1:])


def test_status_reads_loads_from_pages_and_leaves_a_bad_page_unknown() -> None:
    facts = running()
    keys = [(h.model, h.replica) for h in summarize(SPEC, facts).health]
    pages = {keys[0]: vllm_page(waiting=6, kv=0.25), keys[1]: "<html>not metrics</html>"}
    loads = engine_loads(SPEC, pages)
    assert list(loads) == [keys[0]]
    assert (loads[keys[0]].waiting, loads[keys[0]].kv_usage, loads[keys[0]].read) == (6.0, 0.25, True)


def test_an_http_response_gives_its_body_only_when_200_and_bounded() -> None:
    assert response_body("HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\na 1\n") == "a 1\n"
    assert response_body("HTTP/1.1 401 Unauthorized\r\n\r\n") is None
    assert response_body("HTTP/1.1 200 OK\r\nContent-Type: text/plain") is None  # cut in its head
    assert response_body("") is None
    assert response_body("HTTP/1.1 200 OK\r\n\r\n" + "x" * (METRICS_BYTES + 1)) is None


def test_the_page_is_asked_on_the_node_with_its_engine_key() -> None:
    """``metrics_page`` as status runs it, on this machine (bash's /dev/tcp) against a
    stand-in engine that wants the key."""
    seen: list[str | None] = []

    async def metrics(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        if request.headers.get("Authorization") != "Bearer k3y":
            return web.Response(status=401)
        return web.Response(text=vllm_page(waiting=2, kv=0.5))

    async def scenario() -> tuple[str | None, str | None, str | None]:
        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        t = LocalTransport("n", command_timeout=10.0)
        try:
            good = await metrics_page(t, "127.0.0.1", port, "k3y")
            wrong = await metrics_page(t, "127.0.0.1", port, None)
            closed = await metrics_page(t, "127.0.0.1", 1, "k3y")
        finally:
            await runner.cleanup()
        return good, wrong, closed

    good, wrong, closed = asyncio.run(scenario())
    assert good is not None and good == vllm_page(waiting=2, kv=0.5)
    assert wrong is None and closed is None
    assert seen == ["Bearer k3y", None]
