from pathlib import Path

import pytest

from llmgw_cli.core.load import parse_cluster
from llmgw_cli.core.templates import render
from llmgw_cli.core.units import gateway_unit
from llmgw_cli.errors import TemplateError

ROOT = Path(__file__).resolve().parents[2]


def spec_with_state_dir(state_dir: str) -> str:
    return f"cluster: {{name: c}}\ngateway: {{state_dir: {state_dir}}}\n"


def test_state_dir_under_var_lib_is_managed_by_systemd() -> None:
    unit = gateway_unit(
        parse_cluster(spec_with_state_dir("/var/lib/llmgw")), llmgw_bin="/b", config_path="/c.yaml"
    )
    assert "StateDirectory=llmgw\n" in unit
    assert "ReadWritePaths" not in unit
    assert (
        "ExecStart=/b gateway run -f /c.yaml --engine-keys-file /etc/llmgw/gateway/engine-keys.json\n" in unit
    )
    assert "User=llmgw\n" in unit


def test_other_state_dir_is_made_writable() -> None:
    unit = gateway_unit(parse_cluster(spec_with_state_dir("/srv/gw/")), llmgw_bin="/b", config_path="/c.yaml")
    assert "ReadWritePaths=/srv/gw\n" in unit
    assert "StateDirectory" not in unit


def test_missing_template_and_missing_variable_are_errors() -> None:
    with pytest.raises(TemplateError, match="not found"):
        render("nope.j2")
    with pytest.raises(TemplateError, match="'cluster' is undefined"):
        render("llmgw-gateway.service.j2")


def test_gateway_gets_the_engine_key_map_not_one_key() -> None:
    unit = gateway_unit(
        parse_cluster(spec_with_state_dir("/var/lib/llmgw")), llmgw_bin="/b", config_path="/c.yaml"
    )
    # keys are per node: the gateway reads the map (again on SIGHUP), no node's key file
    assert " --engine-keys-file /etc/llmgw/gateway/engine-keys.json" in unit
    assert "engine.env" not in unit
