"""`llmgw render monitoring`: the Prometheus configuration and the alert rules, checked by
the real promtool (`check config`, `check rules`, and `test rules` on tests/data)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from llmgw_cli.cli.main import app
from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.views.monitoring import PROMETHEUS_FILE, RULES_FILE, monitoring_files, scrape_target

RULE_TESTS = Path(__file__).resolve().parents[1] / "data" / "llmgw-alerts_test.yml"
CLUSTER = """\
cluster: {name: prod}
gateway: {host: gw-node, listen: "0.0.0.0:8080", admin_listen: "127.0.0.1:9090", metrics_listen: "0.0.0.0:9100"}
nodes:
  - {name: gw-node, address: 10.1.0.5}
profiles: {vllm: {engine: vllm}}
models: []
"""


def promtool(*args: str, cwd: Path) -> None:
    done = subprocess.run(["promtool", *args], cwd=cwd, capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"promtool {' '.join(args)}:\n{done.stdout}{done.stderr}"


def test_scrape_target_follows_the_listeners() -> None:
    spec = parse_cluster(CLUSTER)
    assert scrape_target(spec) == ("10.1.0.5:9100", False)  # wildcard: gateway.host's address
    no_metrics = parse_cluster(CLUSTER.replace(', metrics_listen: "0.0.0.0:9100"', ""))
    assert scrape_target(no_metrics) == ("127.0.0.1:9090", True)
    job = yaml.safe_load(monitoring_files(no_metrics, "/k")[PROMETHEUS_FILE])["scrape_configs"][0]
    assert job["authorization"] == {"type": "Bearer", "credentials_file": "/k"}


@pytest.mark.integration
@pytest.mark.parametrize("metrics_listen", [True, False])
def test_promtool_accepts_the_files_and_the_alerts_fire_as_specified(
    tmp_path: Path, metrics_listen: bool
) -> None:
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed (Debian package prometheus, scripts/obs-packages.txt)")
    text = CLUSTER if metrics_listen else CLUSTER.replace(', metrics_listen: "0.0.0.0:9100"', "")
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(text)
    key = tmp_path / "admin.key"
    key.write_text("llmgw-secret\n")
    out = tmp_path / "monitoring"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmgw_cli",
            "render",
            "monitoring",
            "-f",
            str(cluster),
            "--out",
            str(out),
            "--admin-key-file",
            str(key),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted([PROMETHEUS_FILE, RULES_FILE, "grafana"])
    promtool("check", "config", PROMETHEUS_FILE, cwd=out)
    promtool("check", "rules", RULES_FILE, cwd=out)
    shutil.copy(RULE_TESTS, out / RULE_TESTS.name)
    promtool("test", "rules", RULE_TESTS.name, cwd=out)


def test_stdout_has_both_files(tmp_path: Path) -> None:
    (tmp_path / "cluster.yaml").write_text(CLUSTER)
    result = CliRunner().invoke(app, ["render", "monitoring", "-f", str(tmp_path / "cluster.yaml")])
    assert result.exit_code == 0, result.output
    assert f"# ==> {PROMETHEUS_FILE} <==" in result.output and f"# ==> {RULES_FILE} <==" in result.output
    assert "LlmgwModelNotServing" in result.output
