"""Metrics, the /admin dashboard and the summary API on a real gateway process with
simulated engines on loopback; the dashboard in a real browser (Debian's chromium driven
headless by Playwright); the live /metrics checked by `promtool check metrics`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.harness import Engine, Gateway, free_port, start_gateway, stop

pytestmark = [pytest.mark.integration, pytest.mark.any_loop]  # page and metric contents

CHROMIUM = "/usr/bin/chromium"
MESSAGES: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
OUTPUT = Path(__file__).resolve().parents[2] / "test-output"  # git-ignored; CI keeps it


def model(name: str, scaling: dict[str, int] | None) -> dict[str, object]:
    entry: dict[str, object] = {"name": name, "source": f"org/{name}", "fetch": "engine", "profile": "sim"}
    if scaling:
        entry["scaling"] = scaling
    return entry


class Setup:
    def __init__(self, gw: Gateway, keys: dict[str, str]) -> None:
        self.gw, self.keys = gw, keys


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    directory = tmp_path_factory.mktemp("obs")
    engines = [Engine(directory, "chat"), Engine(directory, "chat")]
    models = [
        model("chat", {"min": 1, "max": 2}),
        model("starting", {"min": 1, "max": 1}),
        model("lazy", {"min": 0, "max": 1}),
        model("dark", None),
    ]
    replicas = {"chat": [e.address for e in engines], "starting": [f"127.0.0.1:{free_port()}"]}
    gw = Gateway(directory, models, replicas)
    keys = {
        "admin": gw.cli("keys", "create", "--name", "ops", "--admin"),
        "alice": gw.cli("keys", "create", "--name", "alice"),
    }
    gw.start()
    try:
        client = gw.client(keys["alice"])
        for _ in range(3):
            client.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=4)
        list(client.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=4, stream=True))
        yield Setup(gw, keys)
    finally:
        gw.stop()
        for e in engines:
            e.stop()


def families(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_live_metrics_on_both_listeners(setup: Setup) -> None:
    gw = setup.gw
    got = families(httpx.get(f"http://127.0.0.1:{gw.metrics_port}/metrics").text)
    assert got[("llmgw_requests_total", (("key", "alice"), ("model", "chat"), ("status", "200")))] == 4
    assert got[("llmgw_tokens_total", (("key", "alice"), ("kind", "completion"), ("model", "chat")))] == 16
    assert got[("llmgw_request_seconds_count", (("model", "chat"),))] == 4
    assert got[("llmgw_time_to_first_token_seconds_count", (("model", "chat"),))] == 1
    assert got[("llmgw_model_ready_replicas", (("model", "chat"),))] == 2
    assert got[("llmgw_model_state", (("model", "starting"), ("state", "starting")))] == 1
    assert got[("llmgw_in_flight", (("model", "chat"),))] == 0
    # The admin listener serves the same registry, behind the admin key.
    assert gw.admin("/metrics", setup.keys["alice"]).status_code == 403
    admin = gw.admin("/metrics", setup.keys["admin"])
    assert admin.status_code == 200 and "llmgw_requests_total" in admin.text


def test_live_metrics_pass_promtool(setup: Setup, promtool_check_metrics: Callable[[str], None]) -> None:
    promtool_check_metrics(httpx.get(f"http://127.0.0.1:{setup.gw.metrics_port}/metrics").text)


def test_summary_api(setup: Setup) -> None:
    gw, keys = setup.gw, setup.keys
    assert gw.admin("/admin/api/summary", keys["alice"]).status_code == 403
    report = gw.admin("/admin/api/summary", keys["admin"]).json()
    assert report["probing"] is False  # --replicas: nodes are not probed
    states = {m["name"]: (m["state"], m["ready"]) for m in report["models"]}
    assert states == {
        "chat": ("ready", 2),
        "starting": ("starting", 0),
        "lazy": ("stopped", 0),
        "dark": ("off", 0),
    }
    (alice,) = [k for k in report["keys"] if k["key"] == "alice"]
    assert (alice["requests_hour"], alice["requests_day"], alice["models"]) == (4, 4, ["chat"])
    assert alice["tokens_day"] == alice["tokens_hour"] > 16
    hour = report["last_hour"]
    assert list(hour) == ["chat", "starting", "lazy", "dark"]  # every model, in the file's order
    assert all(len(u["requests"]) == len(u["tokens"]) == 60 for u in hour.values())
    assert sum(hour["chat"]["requests"]) == 4 and sum(hour["chat"]["tokens"]) == alice["tokens_hour"]
    assert sum(hour["lazy"]["requests"]) == 0


def test_dashboard_charts_the_last_hour_per_model(setup: Setup) -> None:
    html = setup.gw.admin("/admin", setup.keys["admin"]).text
    table = re.search(r'<table id="last-hour">(.*?)</table>', html, re.S)
    assert table is not None
    rows = dict(re.findall(r'<tr data-model="([^"]+)">(.*?)</tr>', table.group(1), re.S))
    assert list(rows) == ["chat", "starting", "lazy", "dark"]
    for name, row in rows.items():
        assert row.count("<svg ") == 2 and "<title>" in row, name  # requests and tokens
    assert re.search(r'class="n requests-hour">4<', rows["chat"])
    assert "<title>chat: requests per minute, last hour; max " in rows["chat"]
    assert "<title>lazy: requests per minute, last hour; max 0</title>" in rows["lazy"]


def test_dashboard_in_chromium(setup: Setup) -> None:
    if not Path(CHROMIUM).exists():
        pytest.skip("chromium not installed (Debian package chromium, scripts/obs-packages.txt)")
    sync_api = pytest.importorskip("playwright.sync_api")
    gw, keys = setup.gw, setup.keys
    url = f"http://127.0.0.1:{gw.admin_port}/admin"
    OUTPUT.mkdir(exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(http_credentials={"username": "ops", "password": keys["admin"]})
            response = page.goto(url)
            assert response is not None and response.status == 200
            assert page.locator("#cluster").inner_text() == "gw"
            chat = page.locator('#models tr[data-model="chat"]')
            assert chat.locator(".state").inner_text() == "ready"
            assert "2 / 1" in chat.inner_text()
            assert page.locator('#models tr[data-model="starting"] .state').inner_text() == "starting"
            assert page.locator('#loading li[data-model="starting"]').count() == 1
            healths = page.locator('#replicas tr[data-model="chat"] .health').all_inner_texts()
            assert healths == ["ready", "ready"]
            alice = page.locator('#usage tr[data-key="alice"]')
            assert alice.locator(".requests-hour").inner_text() == "4"
            assert alice.locator(".requests-day").inner_text() == "4"
            charts = page.locator('#last-hour tr[data-model="chat"]')
            assert charts.locator("svg").count() == 2 and charts.locator(".requests-hour").inner_text() == "4"
            assert page.locator("#last-hour tr[data-model] svg polyline").count() == 2 * 4
            assert page.locator('meta[http-equiv="refresh"]').count() == 1
            page.screenshot(path=str(OUTPUT / "dashboard.png"), full_page=True)
            for credentials in (
                {"username": "ops", "password": "llmgw-wrong"},
                {"username": "ops", "password": keys["alice"]},
            ):
                other = browser.new_page(http_credentials=credentials)  # type: ignore[arg-type]
                refused = other.goto(url)
                assert refused is not None and refused.status in (401, 403)
                assert "Usage by key" not in other.content()
                other.close()
        finally:
            browser.close()
    assert (OUTPUT / "dashboard.png").stat().st_size > 10_000


def test_summary_equals_status_json_for_the_same_facts(tmp_path: Path) -> None:
    """A gateway that probes (here: this machine as a local node) reports the same fleet
    numbers as `llmgw status --json` on the same cluster file."""
    port, admin_port = free_port(), free_port()
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(
        json.dumps(
            {
                "cluster": {"name": "local"},
                "gateway": {
                    "listen": f"127.0.0.1:{port}",
                    "admin_listen": f"127.0.0.1:{admin_port}",
                    "state_dir": str(tmp_path / "state"),
                },
                "nodes": [{"name": "here", "address": "127.0.0.1", "connection": "local"}],
                "profiles": {"sim": {"engine": "vllm"}},
                "models": [model("chat", {"min": 1, "max": 1})],
            }
        )
    )
    (tmp_path / "engine.env").write_text("LLMGW_ENGINE_KEY=x\n")
    cli = [sys.executable, "-m", "llmgw_cli"]
    made = subprocess.run(
        [*cli, "keys", "create", "--name", "ops", "--admin", "-f", str(cluster)],
        capture_output=True,
        text=True,
        check=True,
    )
    key = made.stdout.strip()
    log = tmp_path / "gateway.log"
    proc = start_gateway(cluster, log, "--engine-key-file", str(tmp_path / "engine.env"), port=port)
    try:
        headers = {"Authorization": f"Bearer {key}"}
        report = httpx.get(f"http://127.0.0.1:{admin_port}/admin/api/summary", headers=headers).json()
        said = subprocess.run([*cli, "status", "--json", "-f", str(cluster)], capture_output=True, text=True)
        # no replica of an always-on model with min 1 is ready: status says so by its exit code
        assert said.returncode == 1, said.stderr
        status = json.loads(said.stdout)
        metrics = httpx.get(f"http://127.0.0.1:{admin_port}/metrics", headers=headers).text
    finally:
        stop(proc)
    assert report["probing"] is True
    for part in ("nodes", "classes", "fabrics"):
        assert report[part] == status[part], part
    fleet_fields = ("name", "mode", "desired", "maximum", "running", "where", "not_ready")
    assert [{k: m[k] for k in fleet_fields} for m in report["models"]] == [
        {k: m[k] for k in fleet_fields} for m in status["models"]
    ]
    got = families(metrics)
    assert got[("llmgw_node_up", (("node", "here"),))] == 1
    assert got[("llmgw_node_last_probe_age_seconds", (("node", "here"),))] < 60
    assert got[("llmgw_model_running_replicas", (("model", "chat"),))] == status["models"][0]["running"]
