"""Engine command lines and replica units (pure)."""

import re
from pathlib import Path

import pytest

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.engine.engine_access import (
    engine_env_text,
    environment_quote,
    gateway_sources,
    secret_env_file,
    secret_env_text,
)
from llmgw_cli.core.engine.engines import (
    Member,
    engine_args,
    model_path,
    replica_unit,
    slug,
    spec_hash,
    systemd_quote,
)
from llmgw_cli.errors import SpecError
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
    assert "--api-key" not in argv  # the key is in the environment (VLLM_API_KEY), never argv
    assert argv[argv.index("--host") + 1] == m.node.address  # never every interface
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
    assert "--tensor-parallel-size 8 --pipeline-parallel-size 2" in flags
    assert "--api-key" not in flags
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
    assert "--tp-size 16" in flags
    assert "--enable-metrics" in argv  # the gateway routes on its /metrics
    assert f"--nnodes 2 --node-rank 1 --dist-init-addr {head.node.address}:29600" in flags


def test_llama_server_from_url_lives_in_first_weights_folder() -> None:
    model = HGX.model("qwen2.5-7b-instruct-gguf")
    node = HGX.node("pcie-01")
    assert model_path(model, node) == "/data/models/qwen2.5-7b-instruct-q4_k_m.gguf"
    argv = engine_args(HGX, model, Member(node, 0, ("GPU-x",)), port=8400, head=node, dist_port=0)
    assert argv[:3] == ["/usr/local/bin/llama-server", "-m", "/data/models/qwen2.5-7b-instruct-q4_k_m.gguf"]
    assert argv[argv.index("-a") + 1] == "qwen2.5-7b-instruct-gguf"
    assert "--metrics" in argv  # without it llama-server serves no /metrics to route on


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
        'Environment="NCCL_IB_HCA==mlx5_0:1,mlx5_1:1"',
        'Environment="NCCL_SOCKET_IFNAME=bond0"',
        'Environment="NCCL_DEBUG=WARN"',
        'Environment="CUDA_DEVICE_ORDER=PCI_BUS_ID"',
        "IPAddressDeny=any",
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
    # Routing is the gateway's: it shapes no unit, and a file that names it (or a version
    # that knows it) replaces no replica.
    routed = parse_cluster(
        base.replace(
            "scaling: {min: 1, max: 1}", "scaling: {min: 1, max: 1}\n    routing: {policy: round_robin}", 1
        )
    )
    assert routed.model("qwen2.5-7b-instruct").routing.policy == "round_robin"
    assert spec_hash(routed, routed.model("qwen2.5-7b-instruct")) == h
    assert h == "abb67fb5ad886e04"  # as before routing existed: an upgrade replaces nothing


@pytest.mark.parametrize(
    ("arg", "quoted"),
    [
        ("plain", "plain"),
        ("${LLMGW_ENGINE_KEY}", "$${LLMGW_ENGINE_KEY}"),
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
    assert (
        f"\nExecStartPre=/opt/vllm/bin/ray start --head --port=8201 --node-ip-address={ms[0].node.address}\n"
        in head.text
    )
    assert "--distributed-executor-backend ray" in head.text
    assert "--tensor-parallel-size 8 --pipeline-parallel-size 2" in head.text
    assert (
        f"\nExecStart=/opt/vllm/bin/ray start --address={ms[0].node.address}:8201 "
        f"--node-ip-address={ms[1].node.address} --block\n" in worker.text
    )
    assert "ExecStartPre" not in worker.text
    assert f'Environment="VLLM_HOST_IP={ms[1].node.address}"' in worker.text


def test_new_engine_keys_never_look_like_an_option() -> None:
    # an engine given a key as an option value (an operator's own --api-key, llama-server's
    # list) reads one starting with `-` (URL-safe base64 does, once in 64) as a missing value
    keys = {new_engine_key() for _ in range(1000)}
    assert len(keys) == 1000
    assert all(re.fullmatch(r"[0-9a-f]{64}", k) for k in keys)


# --- reachable only from the gateway; keys and secrets out of the unit ---------------


def test_engines_listen_on_the_engine_address_never_every_interface() -> None:
    text = (ROOT / "inventories/hgx-two-fabrics.yaml").read_text()
    spec = parse_cluster(
        text.replace("address: 10.20.2.11,", "address: 10.20.2.11, engine_address: 10.99.2.11,")
    )
    node = spec.node("hgx-b01")
    assert node.engine_host == "10.99.2.11"
    for name in ("llama-3.3-70b-instruct", "qwen2.5-7b-instruct-gguf"):
        member = Member(node, 0, ("GPU-x",))
        argv = engine_args(spec, spec.model(name), member, port=8100, head=node, dist_port=0)
        assert argv[argv.index("--host") + 1] == "10.99.2.11"
        assert "0.0.0.0" not in argv


def test_multi_node_rendezvous_is_on_the_head_engine_address() -> None:
    spec = parse_cluster(
        (ROOT / "inventories/hgx-two-fabrics.yaml")
        .read_text()
        .replace("profile: vllm-ray", "profile: sglang")
    )
    head, worker = members(2)
    argv = engine_args(
        spec, spec.model("llama-3.1-405b-instruct"), worker, port=8300, head=head.node, dist_port=29600
    )
    assert argv[argv.index("--dist-init-addr") + 1] == f"{head.node.engine_host}:29600"
    assert argv[argv.index("--host") + 1] == worker.node.engine_host


def test_unit_firewall_lets_in_only_gateway_peers_and_localhost() -> None:
    spec = parse_cluster(
        (ROOT / "inventories/hgx-two-fabrics.yaml").read_text().replace("profile: vllm-ray", "profile: vllm")
    )
    ms = members(2)
    unit = replica_unit(
        spec,
        spec.model("llama-3.1-405b-instruct"),
        replica=0,
        member=ms[1],
        port=8100,
        members=ms,
        dist_port=29500,
    )
    allow = re.search(r"\nIPAddressAllow=(.*)\n", unit.text).group(1).split()  # type: ignore[union-attr]
    # localhost, the two members, and the gateway (gw01 is a host name: engine_clients)
    assert allow == ["localhost", ms[0].node.address, ms[1].node.address, "10.20.0.5"]
    assert "\nIPAddressDeny=any\n" in unit.text


def test_gateway_on_a_node_or_an_ip_is_let_in_and_host_names_are_refused() -> None:
    base = "cluster: {name: c}\nnodes: [{name: gw, address: 10.0.0.9}, {name: n1, address: 10.0.0.1}]\n"
    assert gateway_sources(parse_cluster(base + "gateway: {host: gw}\n")) == ["10.0.0.9"]
    assert gateway_sources(
        parse_cluster(base + "gateway: {host: 192.0.2.7, engine_clients: [10.1.0.0/24]}\n")
    ) == [
        "192.0.2.7",
        "10.1.0.0/24",
    ]
    with pytest.raises(SpecError) as bad_client:
        parse_cluster(base + "gateway: {engine_clients: [gw.example.net]}\n")
    assert "not an IP address or CIDR block" in str(bad_client.value.problems[0])
    assert bad_client.value.problems[0].line == 3  # located in the file, as every spec error
    with pytest.raises(SpecError) as bad_address:
        parse_cluster(base.replace("address: 10.0.0.1}", "address: 10.0.0.1, engine_address: n1.example}"))
    assert "not an IP address" in str(bad_address.value.problems[0])


def test_no_key_in_any_unit_the_engines_read_it_from_root_only_files() -> None:
    spec = parse_cluster((ROOT / "inventories/lab.yaml").read_text())
    node = spec.nodes[0]
    member = Member(node, 0, ("GPU-a",))
    for model in spec.models:
        unit = replica_unit(spec, model, replica=0, member=member, port=8100, members=(member,), dist_port=0)
        assert "api-key" not in unit.text
        assert "LLMGW_ENGINE_KEY" not in unit.text
        assert "\nEnvironmentFile=/etc/llmgw/engine.env\n" in unit.text
        if spec.profiles[model.profile].engine.value == "sglang":
            assert unit.text.count(" --config /etc/llmgw/engine-sglang-llmgw.yaml\n") == 1
    text = engine_env_text("ab" * 32)
    assert {
        "LLMGW_ENGINE_KEY=" + "ab" * 32,
        "VLLM_API_KEY=" + "ab" * 32,
        "LLAMA_API_KEY=" + "ab" * 32,
    } <= set(text.splitlines())


@pytest.mark.parametrize(
    ("value", "line"),
    [
        ("plain", '"X=plain"'),
        ("a$HOME", '"X=a$HOME"'),  # systemd does not expand $ in Environment=
        ("50%", '"X=50%%"'),
        ('say "hi"', '"X=say \\"hi\\""'),
        ("back\\slash", '"X=back\\\\slash"'),
    ],
)
def test_environment_lines_quoted_as_systemd_reads_them(value: str, line: str) -> None:
    assert environment_quote("X", value) == line


def test_tokens_and_marked_names_go_to_a_secret_file_not_the_unit() -> None:
    text = (
        (ROOT / "inventories/lab.yaml")
        .read_text()
        .replace(
            "    profile: llama-cpp\n",
            '    profile: llama-cpp\n    env: {HF_TOKEN: "hf_x$y", MY_PASS: "p\\"w", PLAIN: "v"}\n    secret_env: [MY_PASS]\n',
            1,
        )
    )
    spec = parse_cluster(text)
    model = spec.model("smollm2-135m")
    member = Member(spec.nodes[0], 0, ("GPU-a",))
    unit = replica_unit(spec, model, replica=0, member=member, port=8300, members=(member,), dist_port=0)
    assert "hf_x" not in unit.text and "MY_PASS" not in unit.text
    assert 'Environment="PLAIN=v"' in unit.text
    assert f"\nEnvironmentFile={secret_env_file(model.name)}\n" in unit.text
    assert secret_env_file(model.name) == "/etc/llmgw/env/smollm2-135m.env"
    assert secret_env_text(spec, model) == 'HF_TOKEN="hf_x\\$y"\nMY_PASS="p\\"w"\n'
