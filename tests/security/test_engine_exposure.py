"""Attacks on the engines from inside the cluster network, and on their secrets on a node.

Someone on a lab node that is neither the gateway nor one of a replica's nodes (another
tenant's job, a compromised service) talks to the engine directly: vLLM's paths outside
``/v1`` (``/invocations`` here) need no key, and a multi-node replica's rendezvous port
takes anyone. An unprivileged account on a node (``nobody``) looks for the engine key in
the process list; anyone who can run ``systemctl show`` or read ``/etc/systemd/system``
looks for the Hugging Face token. Everything runs on the lab: real sshd, real systemd
(its BPF firewall for the unit's cgroup), the lab's simulated engines, and the real
gateway on this machine (the lab's ``gateway.engine_clients`` address).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.engine.engine_access import engine_env_text
from llmgw_cli.core.engine.engines import Member as UnitMember
from llmgw_cli.core.engine.engines import engine_args
from tests.gateway.harness import free_port, start_gateway, stop, wait_http
from tests.integration.conftest import Lab
from tests.integration.lab_helpers import cluster_variant, engine_keys_file, reset, run
from tests.test_llama_server import _script

pytestmark = pytest.mark.integration

HF_TOKEN = "hf_Secr3t-token-value"
# systemd reads `$` literally in Environment= and `%` as a specifier: both must come out
# exactly as written, and so must a double quote.
ODD_VALUE = 'a$HOME b%n "c" \\d'
GATEWAY_ADDRESS = "10.213.0.1"  # the lab's bridge: where this machine (the gateway) reaches nodes from


@dataclass(frozen=True)
class Member:
    node: str
    unit: str
    port: int
    rank: int


@dataclass(frozen=True)
class Applied:
    cluster: Path
    replicas: dict[str, list[Member]]  # model -> members, rank 0 first
    keys: dict[str, str]  # node -> engine key

    def address(self, lab: Lab, model: str) -> tuple[str, int]:
        head = self.replicas[model][0]
        return next(n.ip for n in lab.nodes if n.name == head.node), head.port

    def outsider(self, model: str) -> str:
        """A lab node that is not one of the replica's nodes (and not the gateway)."""
        inside = {m.node for m in self.replicas[model]}
        return next(n for n in sorted(self.keys) if n not in inside)


def _replicas(lab: Lab) -> dict[str, list[Member]]:
    found: dict[str, list[Member]] = {}
    for node in lab.nodes:
        listing = lab.ssh(node.name, "grep -H '^X-Llmgw-' /etc/systemd/system/llmgw-*.service 2>/dev/null")
        labels: dict[str, dict[str, str]] = {}
        for line in listing.stdout.splitlines():
            path, _, rest = line.partition(":")
            name, _, value = rest.partition("=")
            labels.setdefault(Path(path).name, {})[name] = value
        for unit, lab_labels in labels.items():
            member = Member(node.name, unit, int(lab_labels["X-Llmgw-Port"]), int(lab_labels["X-Llmgw-Rank"]))
            found.setdefault(lab_labels["X-Llmgw-Model"], []).append(member)
    return {model: sorted(ms, key=lambda m: m.rank) for model, ms in found.items()}


@pytest.fixture(scope="module")
def applied(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Applied]:
    """The lab applied with a vLLM replica (holding a token and an odd value in its
    environment), an SGLang replica and a two-node vLLM replica."""
    reset(lab)
    folder = tmp_path_factory.mktemp("exposure")
    env = json.dumps({"HF_TOKEN": HF_TOKEN, "LLMGW_ODD": ODD_VALUE})
    cluster = cluster_variant(
        lab,
        folder,
        replace=(
            # no llama-server replica: this suite is about the vLLM and SGLang engines
            ("scaling: {min: 1, max: 1}", "scaling: {min: 0, max: 1}"),
            ("scaling: {min: 1, max: 2, idle_timeout: 10m}", f"env: {env}\n    scaling: {{min: 1, max: 1}}"),
            ("scaling: {min: 0, max: 1, idle_timeout: 2m}", "scaling: {min: 1, max: 1}"),
            ("scaling: {min: 0, max: 1, idle_timeout: 5m}", "scaling: {min: 1, max: 1}"),
            ("state_dir: /var/lib/llmgw-lab/gateway", f"state_dir: {folder / 'state'}"),
        ),
    )
    done = run("apply", "-f", str(cluster), "--yes")
    assert done.returncode == 0, done.stdout + done.stderr
    keys = {}
    for node in lab.nodes:
        text = lab.ssh(node.name, "sed -n 's/^LLMGW_ENGINE_KEY=//p' /etc/llmgw/engine.env").stdout.strip()
        assert re.fullmatch(r"[0-9a-f]{64}", text), (node.name, text)
        keys[node.name] = text
    try:
        yield Applied(cluster, _replicas(lab), keys)
    finally:
        reset(lab)


def _connect_from(lab: Lab, node: str, host: str, port: int, request: bytes = b"") -> str:
    """Open a TCP connection from ``node`` (and send ``request``): "connected: <answer>" or
    the error, within 4 seconds (a dropped SYN is a timeout)."""
    script = (
        "import socket,sys\n"
        "try:\n"
        f"    s = socket.create_connection(({host!r}, {port}), timeout=4)\n"
        f"    s.sendall({request!r})\n"
        "    s.settimeout(4)\n"
        "    print('connected:', s.recv(200).decode(errors='replace').splitlines()[:1])\n"
        "except OSError as exc:\n"
        "    print('refused:', exc)\n"
    )
    done = lab.ssh(node, f"python3 -c {shlex.quote(script)}", timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _invocations(host: str, port: int) -> bytes:
    body = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()
    return (
        f"POST /invocations HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body


def test_other_node_cannot_use_vllm_paths_that_need_no_key(lab: Lab, applied: Applied) -> None:
    host, port = applied.address(lab, "llama-3.1-8b-instruct")
    # The path itself is open, as in vLLM: only the firewall keeps others out. From the
    # gateway's address it answers without any key...
    direct = httpx.post(f"http://{host}:{port}/invocations", json={"prompt": "hello", "max_tokens": 2})
    assert direct.status_code == 200, direct.text
    # ...from another node of the cluster it does not answer at all.
    outsider = applied.outsider("llama-3.1-8b-instruct")
    seen = _connect_from(lab, outsider, host, port, _invocations(host, port))
    assert seen.startswith("refused:"), f"{outsider} reached {host}:{port}/invocations: {seen}"


def test_other_node_cannot_reach_a_multi_node_control_port(lab: Lab, applied: Applied) -> None:
    model = "llama-3.1-405b-instruct"
    head, worker = applied.replicas[model][:2]
    exec_start = lab.ssh(head.node, f"systemctl show -p ExecStart --value {head.unit}").stdout
    control = int(re.search(r"--master-port (\d+)", exec_start).group(1))  # type: ignore[union-attr]
    host = next(n.ip for n in lab.nodes if n.name == head.node)
    # The replica's own worker node joins the rendezvous...
    assert _connect_from(lab, worker.node, host, control).startswith("connected:")
    # ...a node outside the replica cannot reach it, nor the API.
    outsider = applied.outsider(model)
    seen = _connect_from(lab, outsider, host, control)
    assert seen.startswith("refused:"), f"{outsider} reached the control port {host}:{control}: {seen}"
    assert _connect_from(lab, outsider, host, head.port).startswith("refused:")


def test_gateway_path_still_works(lab: Lab, applied: Applied, tmp_path: Path) -> None:
    port = free_port()
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(
        applied.cluster.read_text()
        .replace("listen: 127.0.0.1:8080", f"listen: 127.0.0.1:{port}")
        .replace("admin_listen: 127.0.0.1:9090", f"admin_listen: 127.0.0.1:{free_port()}")
        .replace("metrics_listen: 127.0.0.1:9100", f"metrics_listen: 127.0.0.1:{free_port()}")
    )
    keys_file = engine_keys_file(lab, tmp_path / "engine-keys.json")
    key = run("keys", "create", "--name", "exposure", "-f", str(cluster)).stdout.strip()
    proc = start_gateway(cluster, tmp_path / "gateway.log", "--engine-keys-file", str(keys_file), port=port)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)
        for model in ("llama-3.1-8b-instruct", "qwen2.5-7b-instruct", "llama-3.1-405b-instruct"):
            answer = client.completions.create(model=model, prompt="hello", max_tokens=2, timeout=30)
            assert answer.choices[0].text, model
    finally:
        stop(proc)


def test_nobody_on_a_node_sees_no_engine_key(lab: Lab, applied: Applied) -> None:
    for node in sorted({m.node for ms in applied.replicas.values() for m in ms}):
        seen = lab.ssh(
            node,
            'runuser -u nobody -- sh -c \'for f in /proc/[0-9]*/cmdline; do tr "\\0" " " < $f; echo; done;'
            " ps -eo args'; systemctl status --no-pager -l 'llmgw-*' 2>&1; true",
        ).stdout
        assert "serve" in seen or "sglang" in seen  # the engines' command lines were read
        for owner, key in applied.keys.items():
            assert key not in seen, f"{owner}'s engine key is readable on {node}"


def test_engine_journal_holds_no_key(lab: Lab, applied: Applied) -> None:
    for node in sorted(applied.keys):
        journal = lab.ssh(node, "journalctl --no-pager -o cat -u 'llmgw-*'").stdout
        for owner, key in applied.keys.items():
            assert key not in journal, f"{owner}'s engine key is in {node}'s journal"
    head = applied.replicas["llama-3.1-8b-instruct"][0]
    assert "non-default args" in lab.ssh(head.node, f"journalctl --no-pager -o cat -u {head.unit}").stdout


def test_token_is_not_in_the_unit_but_reaches_the_engine(lab: Lab, applied: Applied) -> None:
    head = applied.replicas["llama-3.1-8b-instruct"][0]
    shown = lab.ssh(head.node, f"systemctl show {head.unit}; cat /etc/systemd/system/{head.unit}").stdout
    assert HF_TOKEN not in shown
    secret = lab.ssh(head.node, "stat -c '%a %U' /etc/llmgw/env/llama-3.1-8b-instruct.env").stdout.strip()
    assert secret == "600 root"
    pid = lab.ssh(head.node, f"systemctl show -p MainPID --value {head.unit}").stdout.strip()
    environ = lab.ssh(head.node, f"cat /proc/{pid}/environ").stdout.split("\0")
    assert f"HF_TOKEN={HF_TOKEN}" in environ
    # `$`, `%` and quotes come through Environment= exactly as written
    assert f"LLMGW_ODD={ODD_VALUE}" in environ
    # systemctl show prints the assignments quoted for a shell: read back by one, the exact value
    script = f'eval "set -- $(systemctl show -p Environment --value {head.unit})"; printf "%s\\n" "$@"'
    props = lab.ssh(head.node, f"bash -c {shlex.quote(script)}").stdout.splitlines()
    assert f"LLMGW_ODD={ODD_VALUE}" in props
    assert not any(word.startswith("HF_TOKEN") for word in props)


def _sim_engine(tmp: Path, host: str, model: str, key: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    log = tmp / f"engine-{host}-{port}.log"
    env = {
        "LLMGW_LAB_LOAD_SECONDS": "0",
        "LLMGW_LAB_GPUS": "/nonexistent",
        "VLLM_API_KEY": key,
        "PATH": "/usr/bin:/bin",
    }
    argv = [sys.executable, "-m", "llmgw_cli.lab.engine_sim", "vllm", "serve", f"org/{model}"]
    argv += ["--host", host, "--port", str(port), "--served-model-name", model]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    wait_http(f"http://{host}:{port}/health", proc, log)
    return proc, f"{host}:{port}"


def test_gateway_sends_each_node_its_key_and_rides_out_a_rotation(tmp_path: Path) -> None:
    """Mid-rotation: node n1 has one engine still on its old key and one restarted with the
    new one, node n2 has a key of its own. Keys travel in the engines' environment, never
    argv. Every request through the gateway is answered."""
    old, new, other = "a" * 64, "b" * 64, "c" * 64
    engines = [
        _sim_engine(tmp_path, "127.0.0.1", "m", old),
        _sim_engine(tmp_path, "127.0.0.1", "m", new),
        _sim_engine(tmp_path, "127.0.0.2", "m", other),
    ]
    port = free_port()
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(
        "cluster: {name: rot}\n"
        f"gateway: {{listen: '127.0.0.1:{port}', admin_listen: '127.0.0.1:{free_port()}', "
        f"state_dir: '{tmp_path / 'state'}', manage_replicas: false}}\n"
        "nodes: [{name: n1, address: 127.0.0.1, connection: local}, {name: n2, address: 127.0.0.2, connection: local}]\n"
        "profiles: {sim: {engine: vllm}}\n"
        "models: [{name: m, source: org/m, fetch: engine, profile: sim, scaling: {min: 1, max: 3}}]\n"
    )
    replicas = tmp_path / "replicas.json"
    replicas.write_text(json.dumps({"m": [address for _, address in engines]}))
    keys = tmp_path / "engine-keys.json"
    keys.write_text(json.dumps({"n1": [old, new], "n2": [other]}))
    key = run("keys", "create", "--name", "rot", "-f", str(cluster)).stdout.strip()
    options = ("--replicas", str(replicas), "--engine-keys-file", str(keys))
    gateway = None
    try:
        gateway = start_gateway(cluster, tmp_path / "gateway.log", *options, port=port)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)
        for _ in range(30):  # spread over the three engines
            answer = client.completions.create(model="m", prompt="hi", max_tokens=2, timeout=10)
            assert answer.choices[0].text
        for proc, _ in engines:  # each engine answered, and none saw a key in its argv
            assert all(k not in " ".join(map(str, proc.args)) for k in (old, new, other))  # type: ignore[arg-type]
        served = [
            (tmp_path / p.name).read_text().count('"POST /v1/completions HTTP/1.1" 200')
            for p in sorted(tmp_path.glob("engine-*.log"))
        ]
        assert all(n > 0 for n in served), served
    finally:
        if gateway is not None:
            stop(gateway)
        for proc, _ in engines:
            stop(proc)


def test_llama_server_takes_its_key_from_the_environment(tmp_path: Path) -> None:
    """The real llama-server, started with the argv llmgw renders (no --api-key) and the
    node's key file as its environment, refuses a request without the key and shows the
    key to no one in its command line."""
    binary = _script("build-llama-server", "--print-path")
    model = _script("fetch-smollm2")
    port = free_port()
    spec = parse_cluster(
        "cluster: {name: c}\nnodes: [{name: n1, address: 127.0.0.1, connection: local}]\n"
        f"profiles: {{cpp: {{engine: llama-server, command: [{binary}], args: [-ngl, '0', -c, '2048', -np, '1']}}}}\n"
        f"models: [{{name: smol, source: {model}, profile: cpp, scaling: {{min: 1, max: 1}}}}]\n"
    )
    node = spec.nodes[0]
    argv = engine_args(spec, spec.model("smol"), UnitMember(node, 0, ()), port=port, head=node, dist_port=0)
    key = "d" * 64
    env = dict(line.split("=", 1) for line in engine_env_text(key).splitlines() if "=" in line)
    log = tmp_path / "llama.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=out, env={"PATH": "/usr/bin:/bin", **env})
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc, log, seconds=60)
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 401
        ok = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert ok.status_code == 200, ok.text
        assert key not in Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode()
        assert key not in log.read_text(errors="replace")
    finally:
        stop(proc)
