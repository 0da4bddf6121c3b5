"""The gateway's metrics without traffic: the fleet from the Summary, the controller's
counters, and the 503 before the registry exists. Exposition checked by `promtool`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.observe.facts import NodeFacts
from llmgw_cli.core.serving.keys import ApiKey, hash_token
from llmgw_cli.gateway.control.fleet import FleetCollector
from llmgw_cli.gateway.control.sources import ProbeSource, StaticSource
from llmgw_cli.gateway.control.state import Gateway
from llmgw_cli.gateway.serving import metrics as metrics_module
from llmgw_cli.gateway.serving.metrics import Metrics
from llmgw_cli.gateway.serving.server import metrics_app
from llmgw_cli.gateway.store.sqlite import SqliteStore
from llmgw_cli.gateway.store.values import Usage
from tests.unit.facts_factory import node_facts, topology, unit_state

SPEC = parse_cluster(
    """\
cluster: {name: t}
fabrics: {ib: {kind: infiniband}}
nodes:
  - {name: a, address: 10.0.0.1, fabric: ib}
  - {name: b, address: 10.0.0.2, fabric: ib}
  - {name: c, address: 10.0.0.3, fabric: ib}
  - {name: d, address: 10.0.0.4}
profiles: {vllm: {engine: vllm}}
models:
  - {name: big, source: org/a, fetch: engine, profile: vllm, scaling: {min: 1, max: 1}}
"""
)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def gateway(tmp_path: Path, source: ProbeSource | StaticSource) -> Gateway:
    return Gateway(SPEC, source, SqliteStore(tmp_path / "state"), "engine-key")


def fleet_exposition(tmp_path: Path) -> str:
    """The fleet metrics of four nodes: one with a replica and a faulty card, one on PCIe
    only, one whose topology is unknown, one that never answered."""
    source = ProbeSource(tmp_path)
    a = node_facts("a", faulty=(3,))
    a = a.model_copy(
        update={
            "units": (unit_state("llmgw-big-0.service"),),
            "unit_labels": {
                "llmgw-big-0.service": {"Model": "big", "Replica": "0", "Gpus": "GPU-a-0,GPU-a-1"}
            },
        }
    )
    source.facts = {
        "a": a,  # 2 used, 1 faulty, NVSwitch
        "b": node_facts("b", topo=topology(8, "PHB")),  # free, PCIe only: 0 peers
        "c": node_facts("c", topo=None),  # free, topology unknown
        "d": NodeFacts(node="d", error="connection refused"),
    }
    now = time.monotonic()
    source.probed = {"a": now - 5, "b": now - 5, "c": now - 5}
    source.since = now - 600  # d never answered since the gateway began probing
    gw = gateway(tmp_path, source)
    gw.metrics.build(FleetCollector(gw))
    body = gw.metrics.render()
    assert body is not None
    return body.decode()


def test_fleet_metrics_come_from_the_summary(tmp_path: Path) -> None:
    got = samples(fleet_exposition(tmp_path))

    def value(name: str, **labels: str) -> float | None:
        return got.get((name, tuple(sorted(labels.items()))))

    assert value("llmgw_gpus", gpu_class="H100-80GB", state="used") == 2
    assert value("llmgw_gpus", gpu_class="H100-80GB", state="faulty") == 1
    assert value("llmgw_gpus", gpu_class="H100-80GB", state="free") == 8 * 3 - 2 - 1
    assert value("llmgw_gpu_nvlink_peers", node="a") == 7
    assert value("llmgw_gpu_nvlink_peers", node="b") == 0  # known: PCIe only
    assert value("llmgw_gpu_nvlink_peers", node="c") is None  # unknown is not 0
    assert value("llmgw_node_topology_known", node="c") == 0
    assert value("llmgw_node_topology_known", node="b") == 1
    assert value("llmgw_fabric_free_nodes", fabric="ib") == 2  # b and c; a has used and faulty cards
    assert value("llmgw_node_up", node="d") == 0
    age_d = value("llmgw_node_last_probe_age_seconds", node="d")
    age_a = value("llmgw_node_last_probe_age_seconds", node="a")
    assert age_d is not None and age_d >= 600
    assert age_a is not None and 5 <= age_a < 60
    assert value("llmgw_node_gpus", node="a", state="faulty") == 1
    assert value("llmgw_gpu_fault", node="a", gpu="3", cause="reset-required") == 1  # one per card and cause
    assert [k for k in got if k[0] == "llmgw_gpu_fault"] == [
        ("llmgw_gpu_fault", (("cause", "reset-required"), ("gpu", "3"), ("node", "a")))
    ]
    assert value("llmgw_model_running_replicas", model="big") == 1
    assert value("llmgw_model_min_replicas", model="big") == 1
    assert value("llmgw_model_ready_replicas", model="big") == 0  # no replica discovered yet


def test_without_probing_there_are_no_fleet_numbers(tmp_path: Path) -> None:
    gw = gateway(tmp_path, StaticSource({}))
    gw.metrics.build(FleetCollector(gw))
    body = gw.metrics.render()
    assert body is not None
    names = {f.name for f in text_string_to_metric_families(body.decode())}
    assert "llmgw_model_min_replicas" in names
    assert not names & {"llmgw_gpus", "llmgw_node_up", "llmgw_fabric_free_nodes"}


def controller_exposition() -> str:
    """The controller's counters after two loads (one failed), an eviction, two idle stops
    and its actions."""
    metrics = Metrics()
    assert metrics.render() is None  # not built: the endpoints answer 503
    metrics.build()
    metrics.loaded("big", 42.0)
    metrics.loaded("big", 700.0, ok=False)
    metrics.evicted("small")
    metrics.idle_stopped("small")
    metrics.idle_stopped("small")
    metrics.acted("big", "start", "below-min")
    metrics.acted("big", "start-failed", "start-failed")
    metrics.acted("small", "stop", "idle")
    metrics.acted("small", "stop", "idle")
    body = metrics.render()
    assert body is not None
    return body.decode()


def test_controller_counters_and_histograms() -> None:
    got = samples(controller_exposition())
    assert got[("llmgw_model_loads_total", (("model", "big"), ("result", "ok")))] == 1
    assert got[("llmgw_model_loads_total", (("model", "big"), ("result", "failed")))] == 1
    assert got[("llmgw_model_load_seconds_count", (("model", "big"),))] == 2
    assert got[("llmgw_model_load_seconds_sum", (("model", "big"),))] == 742.0
    assert got[("llmgw_model_load_seconds_bucket", (("le", "60.0"), ("model", "big")))] == 1
    assert got[("llmgw_evictions_total", (("model", "small"),))] == 1
    assert got[("llmgw_idle_stops_total", (("model", "small"),))] == 2
    actions = "llmgw_controller_actions_total"
    assert got[(actions, (("action", "start"), ("model", "big"), ("reason", "below-min")))] == 1
    assert got[(actions, (("action", "stop"), ("model", "small"), ("reason", "idle")))] == 2


@pytest.mark.integration
def test_promtool_accepts_the_fleet_and_controller_metrics(
    tmp_path: Path, promtool_check_metrics: Callable[[str], None]
) -> None:
    promtool_check_metrics(fleet_exposition(tmp_path))
    promtool_check_metrics(controller_exposition())


def test_request_metrics_by_model_status_and_key() -> None:
    metrics = Metrics()
    metrics.build()
    metrics.observe("chat", 200, "alice", prompt=5, completion=8, seconds=0.2, first_token=0.05)
    metrics.observe("chat", 200, "alice", prompt=5, completion=8, seconds=0.4)
    metrics.observe("-", 401, "-", prompt=0, completion=0, seconds=0.001)
    body = metrics.render()
    assert body is not None
    got = samples(body.decode())
    assert got[("llmgw_requests_total", (("key", "alice"), ("model", "chat"), ("status", "200")))] == 2
    assert got[("llmgw_requests_total", (("key", "-"), ("model", "-"), ("status", "401")))] == 1
    assert got[("llmgw_tokens_total", (("key", "alice"), ("kind", "completion"), ("model", "chat")))] == 16
    assert got[("llmgw_request_seconds_count", (("model", "chat"),))] == 2
    assert got[("llmgw_time_to_first_token_seconds_count", (("model", "chat"),))] == 1
    assert metrics.recent.totals(time.monotonic()) == {("alice", "chat"): (2, 26)}


def test_retries_and_route_decisions_count_through_kept_children(monkeypatch: pytest.MonkeyPatch) -> None:
    """The labelled children are kept per label set, and dropped when more than
    ``MAX_CHILDREN`` were seen: the counts go on from where they were either way."""
    monkeypatch.setattr(metrics_module, "MAX_CHILDREN", 1)
    metrics = Metrics()
    metrics.build()
    for model in ("a", "b", "c", "a", "a"):
        metrics.retry(model)
        metrics.routed(model, "least_load", "least_load")
    metrics.observe("a", 200, "k", prompt=1, completion=1, seconds=0.1)
    metrics.observe("b", 200, "k", prompt=1, completion=1, seconds=0.1)
    metrics.observe("a", 200, "k", prompt=1, completion=1, seconds=0.1)
    body = metrics.render()
    assert body is not None
    got = samples(body.decode())
    retries = {
        dict(labels)["model"]: v
        for (name, labels), v in got.items()
        if name == "llmgw_upstream_retries_total"
    }
    assert retries == {"a": 3, "b": 1, "c": 1}
    routes = {
        dict(labels)["model"]: v for (name, labels), v in got.items() if name == "llmgw_route_decisions_total"
    }
    assert routes == {"a": 3, "b": 1, "c": 1}
    requests = {
        dict(labels)["model"]: v for (name, labels), v in got.items() if name == "llmgw_requests_total"
    }
    assert requests == {"a": 2, "b": 1}
    assert len(metrics._retries) <= 2 and len(metrics._routes) <= 2  # bounded


def test_metrics_endpoint_answers_503_until_the_registry_is_built(tmp_path: Path) -> None:
    gw = gateway(tmp_path, StaticSource({}))

    async def scrape() -> tuple[int, str, int, str]:
        async with TestClient(TestServer(metrics_app(gw))) as client:
            before = await client.get("/metrics")
            first = (before.status, await before.text())
            gw.metrics.build(FleetCollector(gw))
            after = await client.get("/metrics")
            return (*first, after.status, after.headers["Content-Type"])

    status, text, later, content_type = asyncio.run(scrape())
    assert status == 503 and "not built yet" in text
    assert later == 200 and content_type.startswith("text/plain; version=")


def test_beyond_metrics_keys_the_least_used_keys_are_counted_as_other(tmp_path: Path) -> None:
    """Three keys, room for two in the ``key`` label: the two that used the most tokens over
    the store's last days keep their names, the third is ``other``; a new key beyond the
    bound is ``other`` too until the usage says otherwise."""
    spec = SPEC.model_copy(update={"gateway": SPEC.gateway.model_copy(update={"metrics_keys": 2})})
    store = SqliteStore(tmp_path / "state")
    today = datetime.now(UTC).date().isoformat()

    async def scenario() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        for name in ("heavy", "light", "middle"):
            await store.add_key(ApiKey(name=name, digest=hash_token(f"token-{name}")))
        spent = {"heavy": 9000, "middle": 500, "light": 20}
        await store.add_usage("b1", [Usage(today, k, "big", 1, tokens, 0) for k, tokens in spent.items()])
        gw = Gateway(spec, StaticSource({}), store, "engine-key")
        await gw.start()
        try:
            assert gw.metrics.labelled == frozenset({"heavy", "middle"})
            gw.metrics.build()  # as the server does once the gateway started
            for name in ("heavy", "middle", "light"):
                gw.metrics.observe("big", 200, name, prompt=3, completion=4, seconds=0.1)
            await store.add_key(ApiKey(name="newcomer", digest=hash_token("token-newcomer")))
            await gw.load_keys()
            gw.metrics.observe("big", 200, "newcomer", prompt=1, completion=1, seconds=0.1)
            body = gw.metrics.render()
        finally:
            await gw.stop()
        assert body is not None
        return samples(body.decode())

    got = asyncio.run(scenario())
    requests = {
        dict(labels)["key"]: value for (name, labels), value in got.items() if name == "llmgw_requests_total"
    }
    assert requests == {"heavy": 1, "middle": 1, "other": 2}
    tokens = {dict(labels)["key"] for (name, labels), _ in got.items() if name == "llmgw_tokens_total"}
    assert tokens == {"heavy", "middle", "other"}


def test_while_keys_fit_metrics_keys_every_key_is_named(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "state")

    async def scenario() -> frozenset[str] | None:
        await store.add_key(ApiKey(name="only", digest=hash_token("token-only")))
        gw = Gateway(SPEC, StaticSource({}), store, "engine-key")
        await gw.start()
        try:
            return gw.metrics.labelled
        finally:
            await gw.stop()

    assert asyncio.run(scenario()) is None
