"""LoRA adapters end to end, fast: the official openai client through `llmgw gateway run`
to two simulated vLLM replicas started with LoRA on, which load adapters at run time as
vLLM 0.32 does (`POST /v1/load_lora_adapter`: a name loaded twice is a 400, a path that is
no folder a 404) and log every request. Real vLLM serving an adapter is in
tests/integration/test_real_vllm_lab.py."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from tests.gateway.harness import Engine, Gateway
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

ADAPTER, MISSING = "chat-sql", "chat-gone"
LOAD = re.compile(r'"POST /v1/load_lora_adapter HTTP/1.1" (\d+)')


@dataclass
class Setup:
    gw: Gateway
    engines: list[Engine]
    keys: dict[str, str]
    folder: Path

    def loads(self) -> dict[str, list[str]]:
        """Each replica's address -> the statuses of the loads it was asked for."""
        return {e.address: LOAD.findall(e.log.read_text()) for e in self.engines}

    def lines(self, key: str) -> list[dict[str, object]]:
        lines = [json.loads(x) for x in self.gw.log.read_text().splitlines() if x.startswith("{")]
        return [x for x in lines if x["key"] == key]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    directory = tmp_path_factory.mktemp("adapters")
    folder = directory / "loras" / "sql"
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text("{}")
    engines = [Engine(directory, "chat", tokens_per_second=40, lora=True) for _ in range(2)]
    models = [
        {
            "name": "chat",
            "source": "org/chat",
            "fetch": "engine",
            "profile": "sim",
            "scaling": {"min": 2, "max": 2},
            "adapters": [
                {"name": ADAPTER, "source": str(folder)},
                {"name": MISSING, "source": str(directory / "loras" / "gone")},
            ],
        }
    ]
    gw = Gateway(directory, models, {"chat": [e.address for e in engines]})
    keys = {
        "admin": gw.cli("keys", "create", "--name", "ops", "--admin"),
        "all": gw.cli("keys", "create", "--name", "alice"),
        "base-only": gw.cli("keys", "create", "--name", "bob", "--models", "chat"),
        "adapter-only": gw.cli("keys", "create", "--name", "carol", "--models", ADAPTER),
    }
    gw.start()
    try:
        yield Setup(gw, engines, keys, folder)
    finally:
        gw.stop()
        for e in engines:
            e.stop()


def _ask(client: openai.OpenAI, model: str = ADAPTER) -> str:
    done = client.completions.create(model=model, prompt="SELECT", max_tokens=4)
    assert done.model == model
    return done.choices[0].text


def test_an_adapter_is_listed_with_its_model_as_parent_for_the_keys_that_may_use_it(setup: Setup) -> None:
    every = {m.id: m.model_extra or {} for m in setup.gw.client(setup.keys["all"]).models.list()}
    assert every[ADAPTER]["parent"] == "chat" and every[ADAPTER]["root"] == "chat"
    assert "parent" not in every["chat"]
    base_only = {m.id for m in setup.gw.client(setup.keys["base-only"]).models.list()}
    assert base_only == {"chat"}
    adapter_only = {m.id for m in setup.gw.client(setup.keys["adapter-only"]).models.list()}
    assert adapter_only == {ADAPTER}


def test_a_key_limited_to_the_model_may_not_use_its_adapter_and_the_reverse(setup: Setup) -> None:
    with pytest.raises(openai.PermissionDeniedError):
        _ask(setup.gw.client(setup.keys["base-only"]))
    with pytest.raises(openai.PermissionDeniedError):
        _ask(setup.gw.client(setup.keys["adapter-only"]), "chat")
    assert _ask(setup.gw.client(setup.keys["adapter-only"]))


def test_loaded_once_per_replica_by_concurrent_first_requests_then_preferred(setup: Setup) -> None:
    client = setup.gw.client(setup.keys["all"])
    _ask(client)  # the first: one replica loads it
    (first,) = [a for a, statuses in setup.loads().items() if statuses]
    for _ in range(5):  # one at a time: the replica that has it takes each
        _ask(client)
    assert setup.loads()[first] == ["200"]
    with ThreadPoolExecutor(12) as pool:  # past the bounded-load limit: the other loads it too
        answers = list(pool.map(lambda _: _ask(client), range(24)))
    assert len(answers) == 24
    loads = setup.loads()
    print(f"\nloads per replica after 24 concurrent requests: {loads}")
    # whatever the overlap, each replica was asked to load the adapter at most once
    assert all(statuses in ([], ["200"]) for statuses in loads.values()), loads
    lines = wait_until(
        lambda: [x for x in setup.lines("alice") if x["model"] == ADAPTER],
        until=lambda found: len(found) == 30,
        timeout=10,
        what="the 30 access log lines",
    )
    assert {x["status"] for x in lines} == {200}
    assert [x["replica"] for x in lines[:6]] == [first] * 6
    served = {str(x["replica"]) for x in lines}
    assert served == {a for a, statuses in loads.items() if statuses}  # none served it unloaded
    # the admin API shows which replica holds which adapter
    shown = setup.gw.admin("/admin/api/replicas", setup.keys["admin"]).json()["replicas"]
    assert {r["address"] for r in shown if ADAPTER in r["adapters"]} == served


def test_an_adapter_the_engine_cannot_load_is_a_502_that_says_so(setup: Setup) -> None:
    client = setup.gw.client(setup.keys["all"])
    with pytest.raises(openai.APIStatusError) as failed:
        _ask(client, MISSING)
    assert failed.value.status_code == 502
    assert f"could not load the adapter `{MISSING}`" in failed.value.message
    assert "404" in "".join(s for statuses in setup.loads().values() for s in statuses)


def test_usage_is_metered_under_the_adapters_name(setup: Setup) -> None:
    client = setup.gw.client(setup.keys["adapter-only"])
    _ask(client)

    def rows() -> list[dict[str, object]]:
        usage = setup.gw.admin("/admin/api/usage", setup.keys["admin"]).json()["usage"]
        return [u for u in usage if u["key"] == "carol"]

    found = wait_until(
        rows, until=lambda r: bool(r) and r[0]["requests"] == 2, timeout=10, what="carol's usage"
    )
    (row,) = found
    assert row["model"] == ADAPTER and row["completion_tokens"] == 4 + 4
