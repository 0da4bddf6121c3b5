from pathlib import Path

import pytest

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.engine.templates import render
from llmgw_cli.core.hosts.units import gateway_socket_unit, gateway_unit, socket_address
from llmgw_cli.errors import InputError, TemplateError

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


def test_the_socket_unit_holds_every_listener_by_address() -> None:
    spec = parse_cluster(
        "cluster: {name: c}\ngateway: {listen: '[::]:8443', admin_listen: 'localhost:9090', "
        "metrics_listen: '10.0.0.5:9100'}\n"
    )
    unit = gateway_socket_unit(spec)
    assert [x for x in unit.splitlines() if x.startswith("ListenStream=")] == [
        "ListenStream=[::]:8443",
        "ListenStream=127.0.0.1:9090",
        "ListenStream=10.0.0.5:9100",
    ]
    assert "Backlog=2048\n" in unit and "Service=llmgw-gateway.service\n" in unit
    assert "WantedBy=sockets.target\n" in unit


def test_a_listener_systemd_cannot_bind_is_refused_with_what_to_write() -> None:
    assert socket_address("[::1]:80") == "[::1]:80"
    with pytest.raises(InputError, match=r"gw\.example\.com:8080.*IP address"):
        socket_address("gw.example.com:8080")


def test_systemd_waits_for_the_drain_before_it_kills_the_gateway() -> None:
    def stop_timeout(drain: str) -> str:
        spec = parse_cluster(f"cluster: {{name: c}}\ngateway: {{drain_timeout: {drain}}}\n")
        unit = gateway_unit(spec, llmgw_bin="/b", config_path="/c.yaml")
        (line,) = [x for x in unit.splitlines() if x.startswith("TimeoutStopSec=")]
        return line

    assert stop_timeout("30s") == "TimeoutStopSec=60"
    assert stop_timeout("5m") == "TimeoutStopSec=330"
