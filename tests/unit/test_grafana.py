"""The Grafana dashboard and its provisioning files from `llmgw render monitoring`: the
shape Grafana loads (panels on the grid, queries on the provisioned datasource), the
same bytes on every render, PromQL that parses (`promtool check rules`). That every
metric it reads is one the gateway serves: tests/gateway/test_grafana_metrics.py."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.views.grafana import (
    DASHBOARD_FILE,
    DASHBOARDS_PROVIDER_FILE,
    DATASOURCE_FILE,
    GRID_WIDTH,
    expressions,
)
from llmgw_cli.core.views.monitoring import JOB, monitoring_files
from tests.promql import label_values_metric, metric_names

SPEC = parse_cluster(
    """\
cluster: {name: prod}
nodes:
  - {name: a, address: 10.0.0.1}
profiles: {vllm: {engine: vllm}}
models: []
"""
)


def rendered(**options: Any) -> dict[str, str]:
    return monitoring_files(SPEC, **options)


def board() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(rendered()[DASHBOARD_FILE])
    return loaded


def test_the_dashboard_has_grafanas_shape() -> None:
    b = board()
    assert b["uid"] == "llmgw" and b["title"] == "llmgw · prod" and b.get("id") is None
    panels = b["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) and i > 0 for i in ids)
    cells: set[tuple[int, int]] = set()
    for p in panels:
        pos = p["gridPos"]
        assert set(pos) == {"h", "w", "x", "y"} and all(isinstance(v, int) for v in pos.values())
        assert pos["x"] >= 0 and pos["w"] > 0 and pos["x"] + pos["w"] <= GRID_WIDTH, p["title"]
        mine = {
            (x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])
        }
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine
        if p["type"] == "row":
            assert p["panels"] == [] and p["collapsed"] is False
            continue
        assert p["type"] in {"timeseries", "stat", "table", "bargauge"} and p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        assert all(t["expr"].strip() for t in p["targets"]), p["title"]


def test_every_query_reads_the_provisioned_datasource() -> None:
    files = rendered(prometheus_url="http://prom.example:9091")
    (source,) = yaml.safe_load(files[DATASOURCE_FILE])["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prom.example:9091"
    assert source["jsonData"]["timeInterval"] == "15s"  # the scrape interval of prometheus.yml
    wanted = {"type": "prometheus", "uid": source["uid"]}
    b = json.loads(files[DASHBOARD_FILE])
    for p in b["panels"]:
        if p["type"] != "row":
            assert p["datasource"] == wanted, p["title"]
            assert all(t["datasource"] == wanted for t in p["targets"]), p["title"]
    (variable,) = b["templating"]["list"]
    assert variable["datasource"] == wanted
    assert label_values_metric(variable["query"]["query"]) == "llmgw_model_min_replicas"


def test_the_provider_loads_the_dashboard_folder() -> None:
    (provider,) = yaml.safe_load(rendered()[DASHBOARDS_PROVIDER_FILE])["providers"]
    assert provider["type"] == "file" and provider["options"]["path"] == "/var/lib/grafana/dashboards/llmgw"


def test_renders_are_identical() -> None:
    assert rendered() == rendered()
    assert rendered()[DASHBOARD_FILE].endswith("}\n")


def test_queries_read_llmgw_metrics_and_the_scrape_health_only() -> None:
    names = set().union(*(metric_names(e) for e in expressions(board())))
    assert {n for n in names if not n.startswith("llmgw_")} == {"up"}
    assert f'sum(up{{job="{JOB}"}})' in list(expressions(board()))
    # what an operator looks for: requests, tokens, latency, loads, evictions, scale-outs, the fleet
    assert {
        "llmgw_requests_total",
        "llmgw_tokens_total",
        "llmgw_request_seconds_bucket",
        "llmgw_model_loads_total",
        "llmgw_evictions_total",
        "llmgw_scale_outs_total",
        "llmgw_gpus",
        "llmgw_fabric_free_nodes",
        "llmgw_model_state",
    } <= names


def test_metric_names_of_an_expression() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (model, le) (rate(llmgw_a_bucket{model=~"$model"}[5m]))) '
        '/ on (model) group_left max by (model) (llmgw_b) and sum(up{job="x"}) or vector(1e3)'
    )
    assert metric_names(expr) == {"llmgw_a_bucket", "llmgw_b", "up"}


@pytest.mark.integration
def test_promtool_parses_every_expression(tmp_path: Path) -> None:
    """Each expression as a recording rule: `promtool check rules` parses its PromQL.
    Grafana's variables get values of their kind first."""
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed (Debian package prometheus, scripts/obs-packages.txt)")
    values = {"$__rate_interval": "1m", "$__range": "6h", "$model": ".*"}
    rules = []
    for i, query in enumerate(expressions(board())):
        expr = query
        for variable, value in values.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, expr
        rules.append({"record": f"llmgw:dashboard_query:{i}", "expr": expr})
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules)} rules found" in done.stdout
