"""`llmgw render commands`: each engine's argv and environment as its unit holds them."""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.engine.commands import SECRET, engine_command, stand_in_member, stand_in_node
from llmgw_cli.core.engine.engines import replica_unit

ROOT = Path(__file__).resolve().parents[2]
INVENTORIES = sorted((ROOT / "inventories").glob("*.yaml"))
TOKEN = "hf_doNotShowThisTokenAnywhere123"

CLUSTER = f"""
cluster: {{name: c}}
nodes:
  - {{name: small, address: 10.0.0.1, gpus: {{class: L4, count: 1}}, weights: [/w]}}
  - {{name: big, address: 10.0.0.2, engine_address: 10.9.0.2, gpus: {{class: H100-80GB, count: 8}}}}
profiles:
  vllm: {{engine: vllm, command: [/opt/vllm/bin/vllm, serve], ports: 8100-8199,
          args: [--max-model-len, "4096"], env: {{PERCENT: "50%", HF_TOKEN: {TOKEN}}}}}
  sglang: {{engine: sglang, ports: 8300-8399}}
models:
  - name: tiny
    source: /w/tiny
    profile: vllm
    args: [--chat-template, "/t/my template 100%.jinja"]
    scaling: {{min: 1, max: 1}}
  - name: large
    source: /w/large
    profile: sglang
    gpu_class: H100-80GB
    tensor_parallel: 4
    env: {{TOKEN_X: secret-value-x, PLAIN: "1"}}
    secret_env: [TOKEN_X]
  - name: hub
    source: org/repo
    profile: vllm
"""


@pytest.fixture
def cluster_file(tmp_path: Path) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(CLUSTER)
    return path


def render(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmgw_cli", "render", "commands", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )


def rendered_json(path: Path, *args: str) -> list[dict[str, object]]:
    done = render("-f", str(path), "--json", *args)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert isinstance(data, list)
    return data


def exec_start_words(unit_text: str) -> list[str]:
    """The words systemd runs from the ExecStart= line, its quoting undone."""
    (line,) = [x for x in unit_text.splitlines() if x.startswith("ExecStart=")]
    return [w.replace("%%", "%").replace("$$", "$") for w in shlex.split(line.removeprefix("ExecStart="))]


def unit_of(spec: ClusterSpec, name: str) -> str:
    model = spec.model(name)
    member = stand_in_member(model, stand_in_node(spec, model)[0])
    port = spec.profiles[model.profile].ports.first
    unit = replica_unit(
        spec, model, replica=0, member=member, port=port, members=(member,), dist_port=port + 1
    )
    return unit.text


def test_json_shape_in_file_order(cluster_file: Path) -> None:
    data = rendered_json(cluster_file)
    assert [d["model"] for d in data] == ["tiny", "large", "hub"]
    for entry in data:
        assert {"model", "engine", "node", "rank", "argv", "env"} <= set(entry)
        assert isinstance(entry["argv"], list) and all(isinstance(w, str) for w in entry["argv"])
        env = entry["env"]
        assert isinstance(env, dict) and all(isinstance(v, str) for v in env.values())
    assert [(d["engine"], d["node"], d["rank"]) for d in data] == [
        ("vllm", "small", 0),
        ("sglang", "big", 0),  # the first node of its gpu_class with 4 cards
        ("vllm", "small", 0),
    ]


def test_argv_is_what_the_units_exec_start_runs(cluster_file: Path) -> None:
    spec = parse_cluster(CLUSTER)
    data = {d["model"]: d for d in rendered_json(cluster_file)}
    for name in ("tiny", "large"):
        assert data[name]["argv"] == exec_start_words(unit_of(spec, name)), name
    tiny = data["tiny"]["argv"]
    assert tiny[:3] == ["/opt/vllm/bin/vllm", "serve", "/w/tiny"]
    assert tiny[-2:] == ["--chat-template", "/t/my template 100%.jinja"]
    large = data["large"]["argv"]
    assert large[large.index("--host") + 1] == "10.9.0.2"  # the node's engine address
    assert large[-2:] == ["--config", "/etc/llmgw/engine-sglang-llmgw.yaml"]  # SGLang's key file


def test_env_holds_the_units_environment_lines(cluster_file: Path) -> None:
    spec = parse_cluster(CLUSTER)
    env = {d["model"]: d["env"] for d in rendered_json(cluster_file)}
    for name in ("tiny", "large"):
        text = unit_of(spec, name)
        for line in re.findall(r"^Environment=(.*)$", text, re.M):
            key, value = shlex.split(line)[0].split("=", 1)
            assert env[name][key] == value.replace("%%", "%")
    assert env["tiny"]["PERCENT"] == "50%"
    assert env["large"]["PLAIN"] == "1"
    assert env["large"]["CUDA_VISIBLE_DEVICES"] == ",".join(f"<gpu-uuid-{i}>" for i in range(4))


def test_secrets_and_engine_key_are_placeholders(cluster_file: Path) -> None:
    done = render("-f", str(cluster_file), "--json")
    assert TOKEN not in done.stdout and "secret-value-x" not in done.stdout
    env = {d["model"]: d["env"] for d in json.loads(done.stdout)}
    assert env["tiny"]["HF_TOKEN"] == SECRET  # from the model's secret env file
    assert env["large"]["TOKEN_X"] == SECRET
    for name in env:
        assert env[name]["VLLM_API_KEY"] == SECRET  # from the node's engine key file
        assert env[name]["LLAMA_API_KEY"] == SECRET
    assert "HF_TOKEN" not in env["large"]  # only its own profile's secrets
    plain = render("-f", str(cluster_file))
    assert plain.returncode == 0 and TOKEN not in plain.stdout and "secret-value-x" not in plain.stdout
    assert f"HF_TOKEN={shlex.quote(SECRET)}" in plain.stdout


def test_unpinned_repository_shows_a_placeholder_commit(cluster_file: Path) -> None:
    (hub,) = rendered_json(cluster_file, "--model", "hub")
    argv = hub["argv"]
    assert isinstance(argv, list)
    assert argv[2] == "/w/hf/org--repo/<commit:main>"
    assert hub["env"] == {**hub["env"], "HF_HUB_OFFLINE": "1"}  # type: ignore[dict-item]
    assert any("resolved to a commit by apply" in n for n in hub["notes"])  # type: ignore[attr-defined]


def test_pinned_repository_argv_matches_its_unit() -> None:
    commit = "a" * 40
    spec = parse_cluster(CLUSTER.replace("source: org/repo", f"source: org/repo@{commit}"))
    command = engine_command(spec, spec.model("hub"))
    assert command.argv[2] == f"/w/hf/org--repo/{commit}"
    assert list(command.argv) == exec_start_words(unit_of(spec, "hub"))


def test_model_filter(cluster_file: Path) -> None:
    data = rendered_json(cluster_file, "--model", "large")
    assert [d["model"] for d in data] == ["large"]
    plain = render("-f", str(cluster_file), "--model", "large")
    assert plain.returncode == 0
    assert plain.stdout.startswith("# large: sglang on big, port 8300\n")
    assert (
        plain.stdout.rstrip()
        .splitlines()[-1]
        .startswith("python3 -m sglang.launch_server --model-path /w/large")
    )


def test_unknown_model_is_a_usage_error(cluster_file: Path) -> None:
    done = render("-f", str(cluster_file), "--model", "larg")
    assert done.returncode == 2
    assert "larg (did you mean large?)" in done.stderr
    assert "tiny, large, hub" in done.stderr
    assert done.stdout == ""


def test_multi_node_model_renders_rank_zero() -> None:
    spec = parse_cluster((ROOT / "inventories/hgx-two-fabrics.yaml").read_text())
    command = engine_command(spec, spec.model("llama-3.1-405b-instruct"))
    assert (command.rank, command.nodes) == (0, 2)
    assert command.pre_argv is not None and command.pre_argv[1:3] == ("start", "--head")
    assert "--distributed-executor-backend" in command.argv


@pytest.mark.parametrize("path", INVENTORIES, ids=lambda p: p.name)
def test_every_inventory_renders(path: Path) -> None:
    spec = parse_cluster(path.read_text())
    data = rendered_json(path)
    assert [d["model"] for d in data] == [m.name for m in spec.models]
    assert all(d["argv"] for d in data)


@pytest.mark.parametrize("path", INVENTORIES, ids=lambda p: p.name)
def test_no_inventory_gives_vllm_a_flag_it_refuses(path: Path) -> None:
    refused = {"--task", "--swap-space", "--disable-log-requests"}
    for entry in rendered_json(path):
        if entry["engine"] == "vllm":
            assert not refused & set(entry["argv"]), entry["model"]  # type: ignore[arg-type]


def test_a_file_without_nodes_is_bad_input(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(
        "cluster: {name: c}\nprofiles: {v: {engine: vllm}}\nmodels: [{name: m, source: /x, profile: v}]\n"
    )
    done = render("-f", str(path))
    assert done.returncode == 2
    assert "declares no node" in done.stderr
