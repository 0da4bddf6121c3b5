"""The cluster file loader: every problem reported at once, each located."""

from pathlib import Path
from textwrap import dedent

import pytest

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.errors import SpecError

DATA = Path(__file__).resolve().parent.parent / "data"

BASE = """\
cluster: {name: t}
fabrics:
  ib-a: {kind: infiniband}
nodes:
  - {name: n1, address: 10.0.0.1, fabric: ib-a, gpus: {class: H100-80GB, count: 8}}
  - {name: n2, address: 10.0.0.2, fabric: ib-a, gpus: {class: H100-80GB, count: 8}}
profiles:
  vllm: {engine: vllm}
  cpp: {engine: llama-server}
models:
"""


def problems(text: str) -> list[str]:
    with pytest.raises(SpecError) as info:
        parse_cluster(dedent(text), "c.yaml")
    return [str(p) for p in info.value.problems]


def load(text: str) -> ClusterSpec:
    return parse_cluster(dedent(text), "c.yaml")


def test_five_mistakes_give_five_located_messages_in_one_run() -> None:
    found = problems((DATA / "five-mistakes.yaml").read_text())
    assert found == [
        "c.yaml:8:13: nodes[0].fabric: unknown fabric 'ib-z' (fabrics: ib-a)",
        "c.yaml:9:11: nodes[1].name: name 'gpu01' is already used by nodes[0]",
        "c.yaml:17:14: models[0].profile: unknown profile 'vlm' (profiles: vllm)",
        "c.yaml:21:5: models[1]: unknown key 'tensor_paralel' (did you mean 'tensor_parallel'?)",
        "c.yaml:25:14: models[2].scaling: max (0) is below min (1)",
        "c.yaml:29:22: models[3].tensor_parallel: 3 is not a power of two (1, 2, 4, 8, ...)",
        "c.yaml:30:45: models[3].scaling.idle_timeout: 10 has no unit: write 10s, 10m or 10h",
    ]


def test_yaml_syntax_error_has_line_and_column() -> None:
    assert problems("cluster:\n  name: x\nnodes: [\n  {name: a\n") == [
        "c.yaml:5:1: YAML syntax error: expected ',' or '}', but got '<stream end>'"
    ]


def test_tab_indentation_is_a_located_syntax_error() -> None:
    (message,) = problems("cluster:\n\tname: x\n")
    assert message.startswith("c.yaml:2:1: YAML syntax error")


def test_duplicate_keys_are_reported_not_merged() -> None:
    assert problems("cluster: {name: a}\ncluster: {name: b}\n") == [
        "c.yaml:2:1: key 'cluster' is given twice; the later one would win"
    ]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "c.yaml:1:1: the file is empty"),
        ("- a\n- b\n", "c.yaml:1:1: the top level must be a mapping"),
        ("cluster: {name: a}\n---\ncluster: {name: b}\n", "c.yaml:3:1: one cluster per file"),
    ],
)
def test_shape_of_the_document(text: str, expected: str) -> None:
    (message,) = problems(text)
    assert message.startswith(expected)


def test_missing_key_points_at_its_parent() -> None:
    assert problems(BASE + "  - {name: m, source: org/m}\n") == [
        "c.yaml:11:5: models[0]: missing required key 'profile'"
    ]


def test_unknown_key_without_close_match_lists_allowed_keys() -> None:
    (message,) = problems("cluster: {name: a, zzz: 1}\n")
    assert message == "c.yaml:1:20: cluster: unknown key 'zzz'; allowed here: name"


def test_did_you_mean_follows_aliases_and_nesting() -> None:
    found = problems(BASE.replace("count: 8}}\n  - {name: n2", "cout: 8}}\n  - {name: n2") + "  []\n")
    assert found == [
        "c.yaml:5:55: nodes[0].gpus: missing required key 'count'",
        "c.yaml:5:74: nodes[0].gpus: unknown key 'cout' (did you mean 'count'?)",
    ]


def test_scaling_semantics_exactly() -> None:
    spec = load(
        BASE
        + """\
  - {name: none, source: org/a, profile: vllm}
  - {name: disabled, source: org/a, profile: vllm, scaling: {min: 0, max: 0}}
  - {name: demand, source: org/a, profile: vllm, scaling: {min: 0, max: 2, idle_timeout: 10m}}
  - {name: always, source: org/a, profile: vllm, scaling: {min: 2, max: 3}}
"""
    )
    modes = {m.name: m.mode.value for m in spec.models}
    assert modes == {"none": "off", "disabled": "off", "demand": "on-demand", "always": "always"}
    assert spec.model("demand").scaling is not None
    assert spec.model("demand").scaling.idle_timeout == 600


def test_missing_max_is_never_filled_in() -> None:
    (message,) = problems(BASE + "  - {name: m, source: org/m, profile: vllm, scaling: {min: 1}}\n")
    assert message == "c.yaml:11:54: models[0].scaling: missing required key 'max'"


@pytest.mark.parametrize(
    ("source", "kind"),
    [
        ("Qwen/Qwen2.5-7B-Instruct", "hf-repo"),
        ("/data/models/x", "path"),
        ("./models/x", "path"),
        ("https://example.org/m.gguf", "url"),
    ],
)
def test_sources(source: str, kind: str) -> None:
    spec = load(BASE + f"  - {{name: m, source: '{source}', profile: vllm}}\n")
    assert spec.models[0].source_kind.value == kind


@pytest.mark.parametrize(
    ("source", "hint"),
    [
        ("http://example.org/m.gguf", "only https URLs"),
        ("model", "is not a source"),
        ("../x", "is not a source"),
    ],
)
def test_bad_sources(source: str, hint: str) -> None:
    (message,) = problems(BASE + f"  - {{name: m, source: '{source}', profile: vllm}}\n")
    assert "models[0].source" in message
    assert hint in message


def test_cross_references_and_feasibility() -> None:
    found = problems(
        BASE.replace("10.0.0.2", "10.0.0.1")
        + """\
  - {name: big, source: org/a, profile: vllm, tensor_parallel: 16}
  - {name: gg, source: org/gguf, profile: cpp, nodes: 2}
  - {name: big, source: org/b, profile: vllm}
"""
    )
    assert found == [
        "c.yaml:6:25: nodes[1].address: address '10.0.0.1' is already used by nodes[0]",
        "c.yaml:11:64: models[0].tensor_parallel: tensor_parallel 16 is larger than any node "
        "(the largest declares 8 GPUs)",
        "c.yaml:12:24: models[1].source: llama-server loads a GGUF file: give its path or an https URL, "
        "not a repo id",
        "c.yaml:12:55: models[1].nodes: llama-server cannot run a replica across nodes",
        "c.yaml:13:12: models[2].name: name 'big' is already used by models[0]",
    ]


def test_multi_node_model_needs_a_fabric() -> None:
    text = BASE.replace(", fabric: ib-a", "") + "  - {name: m, source: org/m, profile: vllm, nodes: 2}\n"
    (message,) = problems(text)
    assert "models[0].nodes: a 2-node replica needs nodes on a fabric" in message


def test_gateway_host_must_be_a_node_localhost_or_address() -> None:
    base = BASE + "  []\n"
    assert load(base + "gateway: {host: n1}\n").gateway.host == "n1"
    assert load(base + "gateway: {host: gw.example.net}\n").gateway.host == "gw.example.net"
    (message,) = problems(base + "gateway: {host: nx}\n")
    assert message.startswith("c.yaml:12:17: gateway.host: 'nx' is neither a node name")


def test_reference_problems_are_reported_beside_type_problems() -> None:
    found = problems(BASE + "  - {name: m, source: org/m, profile: nope, tensor_parallel: two}\n")
    assert any("unknown profile 'nope'" in f for f in found)
    assert any("tensor_parallel: Input should be a valid integer" in f for f in found)


def test_shorthands() -> None:
    spec = load(
        """\
cluster: {name: t}
nodes:
  - {name: n1, address: h1, hcas: [mlx5_0, "mlx5_1:2"], weights: [/data, {path: /nfs, shared: true}]}
profiles:
  p: {engine: vllm, ports: 9000-9009}
"""
    )
    node = spec.nodes[0]
    assert [(h.name, h.port) for h in node.hcas] == [("mlx5_0", None), ("mlx5_1", 2)]
    assert [(w.path, w.shared) for w in node.weights] == [("/data", False), ("/nfs", True)]
    assert (spec.profiles["p"].ports.first, spec.profiles["p"].ports.last) == (9000, 9009)


def test_yaml_merge_keys_work() -> None:
    spec = load(
        """\
cluster: {name: t}
profiles:
  base: &base {engine: vllm, ports: 8100-8110}
  big:
    <<: *base
    args: [--x]
"""
    )
    assert spec.profiles["big"].ports.first == 8100
    assert spec.profiles["big"].args == ["--x"]


def test_spec_is_frozen_and_round_trips_through_json() -> None:
    spec = load(
        BASE + "  - {name: m, source: org/m, profile: vllm, scaling: {min: 0, max: 1, idle_timeout: 90s}}\n"
    )
    with pytest.raises(ValueError, match="frozen"):
        spec.cluster.name = "other"  # type: ignore[misc]
    again = ClusterSpec.model_validate_json(spec.model_dump_json(by_alias=True))
    assert again == spec
    assert '"idle_timeout":"1m30s"' in spec.model_dump_json()


def test_empty_section_and_yaml_booleans_get_hints() -> None:
    assert problems(BASE) == ["c.yaml:10:8: models: has no value: give one, or remove the key"]
    (message,) = problems(BASE + "  - {name: off, source: org/a, profile: vllm}\n")
    assert "models[0].name: Input should be a valid string (got False); YAML reads unquoted" in message


def test_a_key_beside_a_merge_key_overrides_it_wherever_the_merge_is_written() -> None:
    spec = load(
        """\
cluster: {name: t}
nodes:
  - &a {name: a, address: 10.0.0.1, labels: {rack: r1}}
  - {name: b, <<: *a, address: 10.0.0.2}
"""
    )
    assert [(n.name, n.address, n.labels) for n in spec.nodes] == [
        ("a", "10.0.0.1", {"rack": "r1"}),
        ("b", "10.0.0.2", {"rack": "r1"}),
    ]
    # A key written twice beside the merge is still a duplicate, at the second one.
    (message,) = problems("cluster: {name: t}\nssh: {<<: {port: 22}, port: 23, port: 24}\n")
    assert message.startswith("c.yaml:2:33: ssh: key 'port' is given twice")


def test_values_keep_the_type_yaml_gave_them() -> None:
    """As the JSON Schema says: a quoted number is no count, a quoted yes no boolean."""
    found = problems(
        "cluster: {name: t}\nssh: {port: '22', accept_unknown_hosts: 'yes'}\n"
        "gateway: {key_queue_share: '0.5', workers: true}\n"
    )
    assert found == [
        "c.yaml:2:13: ssh.port: Input should be a valid integer (got '22')",
        "c.yaml:2:41: ssh.accept_unknown_hosts: Input should be a valid boolean (got 'yes')",
        "c.yaml:3:28: gateway.key_queue_share: Input should be a valid number (got '0.5')",
        "c.yaml:3:44: gateway.workers: Input should be a valid integer (got True)",
    ]


def test_a_number_without_a_fraction_is_an_integer_as_in_json() -> None:
    spec = load("cluster: {name: t}\nssh: {port: 2222.0}\ngateway: {key_queue_share: 1}\n")
    assert spec.ssh.port == 2222 and spec.gateway.key_queue_share == 1.0
    (message,) = problems("cluster: {name: t}\nssh: {port: 22.5}\n")
    assert "ssh.port: Input should be a valid integer" in message


@pytest.mark.parametrize(
    ("value", "tag"), [("2024-05-01", "timestamp"), ("!!binary aGk=", "binary"), ("!!set {a}", None)]
)
def test_yaml_values_json_has_no_type_for_are_refused(value: str, tag: str | None) -> None:
    (message,) = problems(f"cluster: {{name: t}}\nnodes:\n  - {{name: a, address: h, fabric: {value}}}\n")
    if tag:
        assert message == (
            f"c.yaml:3:35: nodes[0].fabric: YAML reads this value as a {tag}, which no setting "
            "takes: quote it if it is text"
        )
    else:  # a set is a mapping of nulls
        assert "nodes[0].fabric: Input should be a valid string" in message
    (message,) = problems("cluster: {name: t}\nnodes:\n  - {name: a, address: h, labels: {2024-05-01: x}}\n")
    assert message == "c.yaml:3:36: nodes[0].labels: a key must be text: quote '2024-05-01'"


def test_the_file_writes_documented_keys_not_python_names() -> None:
    text = BASE.replace(
        "{class: H100-80GB, count: 8}}\n  - {name: n2", "{gpu_class: H1, count: 8}}\n  - {name: n2"
    )
    assert problems(text + "  []\n") == [
        "c.yaml:5:55: nodes[0].gpus: missing required key 'class'",
        "c.yaml:5:56: nodes[0].gpus: unknown key 'gpu_class' (did you mean 'class'?)",
    ]
