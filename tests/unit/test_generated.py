"""Committed files derived from the spec must match the code (run scripts/regen)."""

from pathlib import Path

import pytest

from llmgw_cli.core.clusterfile.docgen import configuration_markdown, json_schema
from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.clusterfile.spec import ClusterSpec

ROOT = Path(__file__).resolve().parents[2]
INVENTORIES = sorted((ROOT / "inventories").glob("*.yaml"))


def test_committed_schema_is_current() -> None:
    committed = (ROOT / "docs/cluster.schema.json").read_text()
    assert committed == json_schema(), "docs/cluster.schema.json is stale: run scripts/regen"


def test_committed_configuration_reference_is_current() -> None:
    example = (ROOT / "inventories/single-box.yaml").read_text()
    expected = configuration_markdown(example, "inventories/single-box.yaml")
    assert (ROOT / "docs/configuration.md").read_text() == expected, "stale: run scripts/regen"


def test_reference_documents_every_key_of_every_section() -> None:
    text = (ROOT / "docs/configuration.md").read_text()
    for cls in (
        ClusterSpec,
        *[f.annotation for f in ClusterSpec.model_fields.values() if isinstance(f.annotation, type)],
    ):
        for name, info in cls.model_fields.items():
            assert f"| `{info.alias or name}` |" in text, f"{cls.__name__}.{name} is not documented"


def test_there_are_the_three_example_inventories() -> None:
    assert {p.name for p in INVENTORIES} >= {"lab.yaml", "hgx-two-fabrics.yaml", "single-box.yaml"}


@pytest.mark.parametrize("path", INVENTORIES, ids=lambda p: p.name)
def test_every_inventory_loads(path: Path) -> None:
    spec = parse_cluster(path.read_text(), str(path))
    assert spec.models, "an example without models shows nothing"


def test_hgx_example_has_what_it_claims() -> None:
    spec = parse_cluster((ROOT / "inventories/hgx-two-fabrics.yaml").read_text())
    per_fabric = {f: sum(1 for n in spec.nodes if n.fabric == f) for f in spec.fabrics}
    assert per_fabric == {"ib-a": 8, "ib-b": 8}
    assert sum(1 for n in spec.nodes if n.fabric is None) == 2
    assert [m.name for m in spec.models if m.nodes == 2] == ["llama-3.1-405b-instruct"]
    assert any(m.source.startswith("https://") and m.source.endswith(".gguf") for m in spec.models)
    modes = {m.mode.value for m in spec.models}
    assert modes == {"always", "on-demand", "off"}
