"""A start that fails, or fetches, saying secrets: what a client reads never holds them.

A node's fetch job and an engine's journal are hostile data, and they quote what they
were given: a peer's URL with its serve secret (``http://<node>:<port>/<secret>/<path>``),
the engine key on the engine's command line, a Hugging Face token, a traceback with the
engine's paths. The attack: a gateway whose model's fetch reports such a text, then whose
engine exits with such a journal. The official client's 503 (``model_loading``, then
``model_start_failed``) and ``/v1/models`` must hold none of it, only a reason and a
request id; the gateway's log keeps the detail under that id, without the secrets.

The gateway is the real one (``Gateway`` and its public listener on a loopback port,
its real store and cluster lock); its nodes are fakes whose fetch and journal say what
the test gives them, as ``tests/gateway/test_coordination.py`` does.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp import web

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.observe.facts import NodeFacts
from llmgw_cli.core.planning.controller import Phase
from llmgw_cli.core.planning.plan import Action, Plan
from llmgw_cli.core.serving.keys import ApiKey, hash_token
from llmgw_cli.gateway.control import controller as controller_module
from llmgw_cli.gateway.control import coordination
from llmgw_cli.gateway.control.state import Gateway
from llmgw_cli.gateway.serving import server
from llmgw_cli.gateway.store.sqlite import ModelState, Publication, SqliteStore
from llmgw_cli.progress import Report
from llmgw_cli.remote.cluster_lock import gateway_lock
from llmgw_cli.remote.execute import Outcome
from tests.gateway import harness
from tests.unit.facts_factory import node_facts, with_units
from tests.waiting import wait_until

CLUSTER = """\
cluster: {name: t}
nodes:
  - {name: a, address: 10.0.0.1}
profiles:
  vllm: {engine: vllm, ports: 8100-8199, readiness: {start_timeout: 10m}}
gateway: {load_wait: 1s, state_dir: STATE}
models:
  - {name: lazy, source: org/lazy, fetch: engine, profile: vllm, scaling: {min: 0, max: 1, idle_timeout: 5m}}
"""
PEER_SECRET = secrets.token_urlsafe(24)
ENGINE_KEY = secrets.token_hex(32)
HF_TOKEN = "hf_" + secrets.token_hex(17)
PEER_URL = f"http://10.0.0.2:8123/{PEER_SECRET}/model-00001-of-00002.safetensors"
PROGRESS = f"fetching 3/9 files, 1.2 of 4.0 GB from peer {PEER_URL}: retried with Bearer {ENGINE_KEY}"
JOURNAL = f"""\
llmgw-lazy-0.service: Main process exited, code=exited, status=1/FAILURE
Traceback (most recent call last):
  File "/opt/llmgw/venv/lib/python3.12/site-packages/vllm/entrypoints/openai/api_server.py", line 1044
ValueError: cannot read {PEER_URL}: 403 Forbidden
  cmdline: vllm serve /var/lib/llmgw/weights/hf/org--lazy --api-key {ENGINE_KEY} (HF_TOKEN={HF_TOKEN})
"""
SECRETS = (PEER_SECRET, ENGINE_KEY, HF_TOKEN)
INTERNALS = (
    "Traceback",
    "api_server.py",
    "/opt/llmgw",
    "/var/lib/llmgw",
    "--api-key",
    "10.0.0.2",
    "status=1",
)
WAIT = 20.0


class Exited:
    """A unit watch that says the engine exited, with the hostile journal."""

    async def failure(self) -> str | None:
        return JOURNAL


class HostileNodes:
    """One node whose fetch reports ``PROGRESS`` and waits for ``gate``, and whose engine
    exits saying ``JOURNAL``."""

    def __init__(self) -> None:
        self.truth: dict[str, NodeFacts] = {"a": node_facts("a", gpus=1)}
        self.facts: dict[str, NodeFacts] = {}
        self.gate = asyncio.Event()

    async def probe(self, spec: ClusterSpec) -> dict[str, NodeFacts]:
        self.facts = dict(self.truth)
        return self.facts

    async def fetch(self, spec: ClusterSpec, plan: Plan, report: Report) -> dict[str, str]:
        report("lazy@a", PROGRESS)
        await self.gate.wait()
        return {}

    async def execute(
        self, spec: ClusterSpec, plan: Plan, report: Callable[[str, str], None], *, fetch: bool = False
    ) -> list[Outcome]:
        for action in plan.changes:
            for node, name in action.remove:
                f = self.truth[node]
                self.truth[node] = f.model_copy(
                    update={
                        "units": tuple(u for u in f.units if u.name != name),
                        "unit_labels": {k: v for k, v in f.unit_labels.items() if k != name},
                    }
                )
            self.truth = with_units(self.truth, [(w.node, w.name, w.text) for w in action.write])
        return [Outcome(n, True, "units in place") for a in plan.changes for n in a.nodes]

    async def watch(self, spec: ClusterSpec, action: Action, since: str = "") -> Exited:
        return Exited()


class NoReplicas:
    async def discover(self, spec: ClusterSpec) -> dict[str, list[str]]:
        return {}

    async def close(self) -> None:
        return None


@pytest.fixture(autouse=True)
def fast(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, seconds in (("HEARTBEAT_EVERY", 0.05), ("LEAD_EVERY", 0.05), ("PUBLISH_EVERY", 0.3)):
        monkeypatch.setattr(coordination, name, seconds)
    monkeypatch.setattr(controller_module, "WATCH_EVERY", 0.01)
    monkeypatch.setattr(controller_module, "UNIT_EVERY", 0.0)


def _gateway(tmp_path: Path, nodes: HostileNodes) -> Gateway:
    spec = parse_cluster(CLUSTER.replace("STATE", str(tmp_path / "state")))
    (tmp_path / "state").mkdir(mode=0o700)
    gw = Gateway(
        spec,
        NoReplicas(),  # type: ignore[arg-type]
        SqliteStore(tmp_path / "state"),
        ENGINE_KEY,
        discover_every=0.2,
        health_every=0.1,
        flush_every=0.2,
        manage_replicas=True,
        lock=gateway_lock(spec),
        nodes=nodes,
        can_lead=True,
    )

    async def never_ready(address: str, model: str) -> int | None:
        return None

    gw.health_status = never_ready  # type: ignore[method-assign]
    gw.controller.health = never_ready
    return gw


def _clean(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text, text
    for internal in INTERNALS:
        assert internal not in text, text


def _id_in(message: str) -> str:
    found = re.search(r"\(request id (req_[0-9a-f]{24})\)", message)
    assert found is not None, message
    return found[1]


def _logged(caplog: pytest.LogCaptureFixture, rid: str) -> str:
    lines = [r.getMessage() for r in caplog.records if rid in r.getMessage()]
    assert lines, f"no log line carries {rid}:\n{caplog.text[-3000:]}"
    return "\n".join(lines)


@asynccontextmanager
async def serving(gw: Gateway, tmp_path: Path) -> AsyncIterator[openai.AsyncOpenAI]:
    """The gateway started, its public API on a loopback port, the official client to it."""
    admin = SqliteStore(tmp_path / "state")
    await admin.add_key(ApiKey(name="k1", digest=hash_token("secret-1"), models=()))
    await admin.close()
    await gw.start()
    runner = web.AppRunner(server.public_app(gw))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="secret-1", max_retries=0)
    try:
        yield client
    finally:
        await client.close()
        await runner.cleanup()
        await gw.stop()


async def refused(client: openai.AsyncOpenAI) -> openai.InternalServerError:
    """A chat request's 503, checked for secrets and internals."""
    messages: Any = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.InternalServerError) as caught:
        await client.chat.completions.create(model="lazy", messages=messages)
    error = caught.value
    _clean(str(error.body))
    return error


async def listed(client: openai.AsyncOpenAI) -> tuple[dict[str, object], str]:
    """``/v1/models``' one model, checked for secrets and internals, and the request id."""
    raw = await client.models.with_raw_response.list()
    _clean(raw.http_response.text)
    (model,) = raw.parse().data
    return dict(model.model_extra or {}), raw.headers["x-request-id"]


@pytest.fixture
def log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """The log; at the end of the test, no line of it holds a secret, whoever wrote it."""
    caplog.set_level(logging.INFO)
    yield caplog
    for secret in SECRETS:
        assert secret not in caplog.text


def test_a_fetch_reporting_secrets_answers_how_far_in_fixed_words_and_a_request_id(
    tmp_path: Path, log: pytest.LogCaptureFixture
) -> None:
    nodes = HostileNodes()
    gw = _gateway(tmp_path, nodes)
    server.redact_log(log.handler, gw)  # as `llmgw gateway run` does to its log's handlers

    async def scenario() -> None:
        async with serving(gw, tmp_path) as client:
            loading = await refused(client)
            assert loading.code == "model_loading"
            assert "(fetching weights: 3/9 files, 1.2 of 4.0 GB)" in str(loading.message)
            rid = _id_in(str(loading.message))
            assert loading.request_id == rid
            # the detail, for the operator
            assert "http://10.0.0.2:8123/***/model-00001" in _logged(log, rid)
            model, rid = await listed(client)
            assert model["progress"] == "fetching weights: 3/9 files, 1.2 of 4.0 GB"
            assert "from peer http://10.0.0.2:8123/***/" in _logged(log, rid)
            nodes.gate.set()

    asyncio.run(scenario())


def test_a_start_that_fails_saying_secrets_answers_a_reason_and_a_request_id(
    tmp_path: Path, log: pytest.LogCaptureFixture
) -> None:
    nodes = HostileNodes()
    nodes.gate.set()  # the fetch ends at once; the engine starts and exits
    gw = _gateway(tmp_path, nodes)
    server.redact_log(log.handler, gw)

    async def scenario() -> None:
        async with serving(gw, tmp_path) as client:
            first = await refused(client)  # begins the start
            assert first.code in ("model_loading", "model_start_failed")
            end = time.monotonic() + WAIT
            while gw.controller.phase("lazy") is not Phase.failed:
                assert time.monotonic() < end, "the start never failed"
                await asyncio.sleep(0.02)
            failed = await refused(client)
            assert failed.code == "model_start_failed"
            rid = _id_in(str(failed.message))
            assert failed.request_id == rid
            detail = _logged(log, rid)
            assert "ValueError: cannot read http://10.0.0.2:8123/***/" in detail and "--api-key ***" in detail
            model, _ = await listed(client)
            assert model["state"] == "failed"
            # what the dashboard shows and the leader publishes: the detail, no secret
            state = gw.controller.model_state("lazy")
            assert "Traceback" in state.last_failure
            for secret in SECRETS:
                assert secret not in state.last_failure

    asyncio.run(scenario())


def test_a_real_gateway_tells_a_client_no_secret_its_leader_published(tmp_path: Path) -> None:
    """`llmgw gateway run --follow`, a real process: the leader's publication (hostile
    data, here the test's) says the model fetches with ``PROGRESS`` and then failed with
    ``JOURNAL``. The client's 503s and ``/v1/models`` hold neither, only a reason and a
    request id; the process's own log holds the detail under that id, without a secret."""
    model = {"name": "lazy", "source": "org/lazy", "fetch": "engine", "profile": "sim"}
    gw = harness.Gateway(tmp_path, [{**model, "scaling": {"min": 0, "max": 1}}], {})
    key = gw.cli("keys", "create", "--name", "user")

    async def publish(state: ModelState) -> None:
        store = SqliteStore(tmp_path / "state")
        leadership = store.leadership("the-test")
        fence = await leadership.try_acquire()
        assert fence is not None
        assert await store.publish(fence, Publication({}, [], {"lazy": state}), "the-test")
        await leadership.release()
        await store.close()

    asyncio.run(publish(ModelState(phase="starting", progress=f"lazy@a: {PROGRESS}")))
    gw.proc = harness.start_gateway(
        gw.cluster,
        gw.log,
        *("--follow", "--engine-key-file", str(tmp_path / "engine.env")),
        port=gw.port,
    )
    messages: Any = [{"role": "user", "content": "hi"}]

    def refused(code: str) -> openai.APIStatusError | None:
        try:
            client.chat.completions.create(model="lazy", messages=messages)
        except openai.APIStatusError as exc:
            return exc if exc.code == code else None
        raise AssertionError("answered, yet no replica runs")

    try:
        client = gw.client(key)
        loading = wait_until(lambda: refused("model_loading"), timeout=WAIT, what="a 503 model_loading")
        _clean(str(loading.body))
        assert "(fetching weights: 3/9 files, 1.2 of 4.0 GB)" in loading.message
        assert loading.request_id is not None and _id_in(loading.message) == loading.request_id
        raw = client.models.with_raw_response.list()
        _clean(raw.http_response.text)
        listed = raw.headers["x-request-id"]
        asyncio.run(
            publish(ModelState(phase="failed", failures=1, last_failure=JOURNAL, retry_at=time.time() + 60))
        )
        failed = wait_until(
            lambda: refused("model_start_failed"), timeout=WAIT, what="a 503 model_start_failed"
        )
        _clean(str(failed.body))
        assert failed.request_id is not None and _id_in(failed.message) == failed.request_id
    finally:
        assert gw.stop() == 0
    log = gw.log.read_text()
    for secret in SECRETS:
        assert secret not in log
    lines = log.splitlines()
    assert any(loading.request_id in x and "http://10.0.0.2:8123/***/model-00001" in x for x in lines), log
    assert any(listed in x and "from peer http://10.0.0.2:8123/***/" in x for x in lines), log
    failure = [x for x in lines if failed.request_id in x]
    assert any("ValueError: cannot read http://10.0.0.2:8123/***/" in x for x in failure), log
    assert any("--api-key *** (HF_TOKEN=***" in x for x in failure), log
