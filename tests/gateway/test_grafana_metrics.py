"""The Grafana dashboard reads what real gateways serve: every metric its queries name is
on the /metrics of a real `llmgw gateway run` (one serving a simulated engine after a few
requests, one probing this machine as a local node for the fleet metrics), and every
llmgw metric a gateway serves is on the dashboard."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.views.grafana import DASHBOARD_FILE, expressions
from llmgw_cli.core.views.monitoring import monitoring_files
from tests.gateway.harness import Engine, Gateway, start_gateway, stop
from tests.promql import label_values_metric, metric_names

pytestmark = [pytest.mark.integration, pytest.mark.any_loop]  # metric names, not the loop

MESSAGES: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
# Counted on the request path: after the requests below they have samples for "chat".
REQUESTED = {
    "llmgw_requests_total",
    "llmgw_tokens_total",
    "llmgw_request_seconds_bucket",
    "llmgw_request_seconds_sum",
    "llmgw_request_seconds_count",
    "llmgw_time_to_first_token_seconds_bucket",
}
# Suffixes of the samples of a family, by type (prometheus_client's exposition).
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


class Served:
    """The sample names of scraped expositions: those with samples, and those a declared
    family would have (a counter nothing has bumped yet, a histogram not observed)."""

    def __init__(self) -> None:
        self.sampled: dict[str, set[tuple[tuple[str, str], ...]]] = {}
        self.declared: set[str] = set()
        self.families: dict[str, str] = {}  # name -> type

    def add(self, text: str) -> None:
        for family in text_string_to_metric_families(text):
            if family.name.endswith("_created"):
                continue  # prometheus_client's creation times, not a metric of llmgw
            self.families[family.name] = family.type
            self.declared |= {family.name + s for s in SUFFIXES[family.type]}
            for s in family.samples:
                self.sampled.setdefault(s.name, set()).add(tuple(sorted(s.labels.items())))

    def names(self) -> set[str]:
        return self.declared | set(self.sampled)


def scrape(port: int) -> str:
    return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    out = Served()
    directory = tmp_path_factory.mktemp("traffic")
    engine = Engine(directory, "chat")
    gw = Gateway(
        directory,
        [{"name": "chat", "source": "org/chat", "fetch": "engine", "profile": "sim"}],
        {"chat": [engine.address]},
    )
    key = gw.cli("keys", "create", "--name", "alice")
    gw.start()
    try:
        client = gw.client(key)
        client.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=4)
        list(client.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=4, stream=True))
        out.add(scrape(gw.metrics_port))
    finally:
        gw.stop()
        engine.stop()
    # Probing: the fleet metrics. A model without scaling is off, so nothing is started.
    directory = tmp_path_factory.mktemp("fleet")
    fleet = Gateway(
        directory, [{"name": "dark", "source": "org/dark", "fetch": "engine", "profile": "sim"}], {}
    )
    options = ("--engine-key-file", str(directory / "engine.env"), "--health-every", "0.3")
    proc = start_gateway(fleet.cluster, fleet.log, *options, port=fleet.port)
    try:
        out.add(scrape(fleet.metrics_port))
    finally:
        stop(proc)
    yield out


def dashboard_names() -> tuple[set[str], str]:
    spec = parse_cluster("cluster: {name: t}\nnodes: []\nprofiles: {}\nmodels: []\n")
    board = json.loads(monitoring_files(spec)[DASHBOARD_FILE])
    names = set().union(*(metric_names(e) for e in expressions(board)))
    (variable,) = board["templating"]["list"]
    return names, label_values_metric(variable["query"]["query"])


def test_every_metric_on_the_dashboard_is_served(served: Served) -> None:
    names, variable = dashboard_names()
    names.discard("up")  # Prometheus's own: whether the scrape succeeded
    missing = sorted((names | {variable}) - served.names())
    assert missing == [], f"the dashboard reads metrics no gateway serves: {missing}"
    for name in REQUESTED:
        assert any(("model", "chat") in labels for labels in served.sampled.get(name, set())), name
    # the fleet families are there only because the second gateway probes
    assert {"llmgw_gpus", "llmgw_fabric_free_nodes", "llmgw_node_up"} <= set(served.families)


def test_every_llmgw_metric_served_is_on_the_dashboard(served: Served) -> None:
    names, _ = dashboard_names()
    unread = sorted(
        family
        for family, kind in served.families.items()
        if family.startswith("llmgw_") and not any(family + s in names for s in SUFFIXES[kind])
    )
    assert unread == [], f"served and not on the dashboard: {unread}"
