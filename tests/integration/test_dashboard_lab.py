"""The /admin dashboard on real lab data, in a real browser: `apply` starts the lab's
always-on models, a gateway on this machine probes the four lab nodes, a request goes
through it, and headless Chromium shows the GPUs in use per class, free whole nodes per
fabric, the models' states, the replicas and the key's usage: the same numbers as
`llmgw status --json` for the same nodes. A screenshot goes to test-output/."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from .conftest import Lab
from .lab_helpers import LabGateway, applied_with_gateway, run

pytestmark = pytest.mark.integration

CHROMIUM = "/usr/bin/chromium"
OUTPUT = Path(__file__).resolve().parents[2] / "test-output"


@pytest.fixture
def served(lab: Lab, tmp_path: Path) -> Iterator[LabGateway]:
    with applied_with_gateway(lab, tmp_path) as gw:
        yield gw


def test_dashboard_shows_the_lab(served: LabGateway) -> None:
    if not Path(CHROMIUM).exists():
        pytest.skip("chromium not installed (Debian package chromium, scripts/obs-packages.txt)")
    sync_api = pytest.importorskip("playwright.sync_api")
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{served.port}/v1", api_key=served.key, max_retries=0, timeout=60
    )
    try:
        for _ in range(2):
            client.chat.completions.create(
                model="smollm2-135m", messages=[{"role": "user", "content": "Hi."}], max_tokens=4
            )
    finally:
        client.close()
    status = json.loads(run("status", "-f", str(served.cluster), "--json").stdout)
    (h100,) = [c for c in status["classes"] if c["gpu_class"] == "H100-80GB"]
    assert h100["total"] == 32 and h100["used"] >= 3  # smollm2 (1 card) + llama-3.1-8b (TP 2)
    (fabric,) = status["fabrics"]

    OUTPUT.mkdir(exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(http_credentials={"username": "ops", "password": served.admin})
            response = page.goto(f"http://127.0.0.1:{served.admin_port}/admin")
            assert response is not None and response.status == 200
            assert page.locator("#cluster").inner_text() == "lab"
            row = page.locator('#classes tr[data-class="H100-80GB"]')
            assert row.locator(".used-count").inner_text() == str(h100["used"])
            assert row.locator(".free-count").inner_text() == str(h100["free"])
            assert row.locator(".faulty-count").inner_text() == str(h100["faulty"])
            used_bar = row.locator(".bar .used").get_attribute("style") or ""
            assert f"{100 * h100['used'] / h100['total']:.2f}%" in used_bar
            free_nodes = page.locator('#fabrics tr[data-fabric="lab-ib"] .free-nodes').inner_text()
            assert free_nodes == str(fabric["free_nodes"]) and 0 < fabric["free_nodes"] < 4

            def state(model: str) -> str:
                return page.locator(f'#models tr[data-model="{model}"] .state').inner_text()

            assert state("smollm2-135m") == "ready" and state("llama-3.1-8b-instruct") == "ready"
            assert state("qwen2.5-7b-instruct") == "stopped" and state("mistral-7b-instruct") == "off"
            healths = page.locator('#replicas tr[data-model="smollm2-135m"] .health').all_inner_texts()
            assert healths == ["ready"]
            usage = page.locator('#usage tr[data-key="lab-user"]')
            assert usage.locator(".requests-hour").inner_text() == "2"
            assert page.locator("#nodes tr[data-node]").count() == 4
            page.screenshot(path=str(OUTPUT / "dashboard-lab.png"), full_page=True)
        finally:
            browser.close()
    assert (OUTPUT / "dashboard-lab.png").stat().st_size > 10_000
