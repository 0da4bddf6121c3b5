"""Engine command lines and replica units (pure)."""

import re
from pathlib import Path

import pytest

from llmgw_cli.core.engines import (
    Member,
    engine_args,
    model_path,
    replica_unit,
    slug,
    spec_hash,
    systemd_quote,
)
from llmgw_cli.core.load import parse_cluster
from llmgw_cli.remote.execute import new_engine_key

ROOT = Path(__file__).resolve().parents[2]
HGX = parse_cluster((ROOT / "inventories/hgx-two-fabrics.yaml").read_text())


def members(model_nodes: int) -> tuple[Member, ...]:
    nodes = HGX.nodes[8 : 8 + model_nodes]
    return tuple(
        Member(n, rank, tuple(f"GPU-{n.name}-{i}" for i in range(8)), "=mlx5_0:1,mlx5_1:1")
        for rank, n in enumerate(nodes)
    )


def test_vllm_single_node() -> None:
    model = HGX.model("llama-3.3-70b-instruct")
    (m,) = members(1)
    argv = engine_args(HGX, model, m, port=8100, head=m.node, dist_port=29500)
    assert argv[:3] == ["/opt/vllm/bin/vllm", "serve", "/shared/ib-a/models/Llama-3.3-70B-Instruct"]
    assert argv[argv.index("--tensor-parallel-size") + 1] == "4"
    assert argv[argv.index("--api-key") + 1] == "${LLMGW_ENGINE_KEY}"
    assert "--nnodes" not in argv
    assert argv[-4:] == ["--gpu-memory-utilization", "0.90", "--max-model-len", "32768"]


def test_vllm_multi_node_native() -> None:
    spec = parse_cluster(
        (ROOT / "inventories/hgx-two-fabrics.yaml").read_text().replace("profile: vllm-ray", "profile: vllm")
    )
    model = spec.model("llama-3.1-405b-instruct")
    head, worker = members(2)
    argv = engine_args(spec, model, worker, port=8100, head=head.node, dist_port=29500)
    flags = " ".join(argv)
    assert "--tensor-parallel-size 8 --api-key ${LLMGW_ENGINE_KEY} --pipeline-parallel-size 2" in flags
    assert (
        f"--nnodes 2 --node-rank 1 --master-addr {head.node.address} --master-port 29500 --headless" in flags
    )
    assert "--headless" not in engine_args(spec, model, head, port=8100, head=head.node, dist_port=29500)


def test_sglang_multi_node() -> None:
    spec = parse_cluster(
        (ROOT / "inventories/hgx-two-fabrics.yaml")
        .read_text()
        .replace("profile: vllm-ray", "profile: sglang")
    )
    model = spec.model("llama-3.1-405b-instruct")
    head, worker = members(2)
    argv = engine_args(spec, model, worker, port=8300, head=head.node, dist_port=29600)
    flags = " ".join(argv)
    assert argv[:3] == ["/opt/sglang/bin/python", "-m", "sglang.launch_server"]
    assert "--tp 16" in flags
    assert f"--nnodes 2 --node-rank 1 --dist-init-addr {head.node.address}:29600" in flags


def test_llama_server_from_url_lives_in_first_weights_folder() -> None:
    model = HGX.model("qwen2.5-7b-instruct-gguf")
    node = HGX.node("pcie-01")
    assert model_path(model, node) == "/data/models/qwen2.5-7b-instruct-q4_k_m.gguf"
    argv = engine_args(HGX, model, Member(node, 0, ("GPU-x",)), port=8400, head=node, dist_port=0)
    assert argv[:3] == ["/usr/local/bin/llama-server", "-m", "/data/models/qwen2.5-7b-instruct-q4_k_m.gguf"]
    assert argv[argv.index("-a") + 1] == "qwen2.5-7b-instruct-gguf"


def test_unit_carries_labels_env_and_settings() -> None:
    spec = parse_cluster(
        (ROOT / "inventories/hgx-two-fabrics.yaml").read_text().replace("profile: vllm-ray", "profile: vllm")
    )
    model = spec.model("llama-3.1-405b-instruct")
    ms = members(2)
    unit = replica_unit(spec, model, replica=3, member=ms[1], port=8105, members=ms, dist_port=29500)
    assert unit.name == "llmgw-llama-3.1-405b-instruct-3.service"
    assert unit.node == ms[1].node.name
    for line in (
        "X-Llmgw-Model=llama-3.1-405b-instruct",
        "X-Llmgw-Replica=3",
        "X-Llmgw-Rank=1",
        f"X-Llmgw-Members={ms[0].node.name},{ms[1].node.name}",
        f"X-Llmgw-Spec-Hash={spec_hash(spec, model)}",
        "Type=exec",
        "User=llmgw",
        "EnvironmentFile=/etc/llmgw/engine.env",
        "Environment=NCCL_IB_HCA==mlx5_0:1,mlx5_1:1",
        "Environment=NCCL_SOCKET_IFNAME=bond0",
        "Environment=NCCL_DEBUG=WARN",
        "Environment=CUDA_DEVICE_ORDER=PCI_BUS_ID",
        "Restart=on-failure",
        "KillMode=control-group",
        "LimitMEMLOCK=infinity",
    ):
        assert f"\n{line}\n" in unit.text, line


def test_spec_hash_changes_with_args_not_with_scaling() -> None:
    base = (ROOT / "inventories/single-box.yaml").read_text()
    spec = parse_cluster(base)
    h = spec_hash(spec, spec.model("qwen2.5-7b-instruct"))
    scaled = parse_cluster(base.replace("scaling: {min: 1, max: 1}", "scaling: {min: 1, max: 2}", 1))
    assert spec_hash(scaled, scaled.model("qwen2.5-7b-instruct")) == h
    changed = parse_cluster(base.replace('"16384"', '"8192"'))
    assert spec_hash(changed, changed.model("qwen2.5-7b-instruct")) != h


@pytest.mark.parametrize(
    ("arg", "quoted"),
    [
        ("plain", "plain"),
        ("${LLMGW_ENGINE_KEY}", "${LLMGW_ENGINE_KEY}"),
        ("$HOME", "$$HOME"),
        ("50%", "50%%"),
        ("two words", '"two words"'),
        ('{"a": 1}', '"{\\"a\\": 1}"'),
        ("", '""'),
    ],
)
def test_systemd_quote(arg: str, quoted: str) -> None:
    assert systemd_quote(arg) == quoted


def test_slug() -> None:
    assert slug("Qwen/Qwen2.5-7B-Instruct") == "qwen-qwen2.5-7b-instruct"


def test_vllm_multi_node_with_ray() -> None:
    model = HGX.model("llama-3.1-405b-instruct")  # its profile is vllm-ray
    ms = members(2)
    head = replica_unit(HGX, model, replica=0, member=ms[0], port=8200, members=ms, dist_port=8201)
    worker = replica_unit(HGX, model, replica=0, member=ms[1], port=8200, members=ms, dist_port=8201)
    assert "\nExecStartPre=/opt/vllm/bin/ray start --head --port=8201\n" in head.text
    assert "--distributed-executor-backend ray" in head.text
    assert "--tensor-parallel-size 8 --pipeline-parallel-size 2" in head.text
    assert f"\nExecStart=/opt/vllm/bin/ray start --address={ms[0].node.address}:8201 --block\n" in worker.text
    assert "ExecStartPre" not in worker.text
    assert f"Environment=VLLM_HOST_IP={ms[1].node.address}" in worker.text


def test_new_engine_keys_never_look_like_an_option() -> None:
    # engines take `--api-key ${LLMGW_ENGINE_KEY}`: a key starting with `-` (URL-safe
    # base64 does, once in 64) is read as a missing value and the engine exits
    keys = {new_engine_key() for _ in range(1000)}
    assert len(keys) == 1000
    assert all(re.fullmatch(r"[0-9a-f]{64}", k) for k in keys)
