"""Rendered units pass `systemd-analyze verify`; any warning on stderr counts as a failure
(unknown keys and bad values are only warnings there, with exit code 0)."""

import shutil
import subprocess
from pathlib import Path

import pytest

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.hosts.units import (
    GATEWAY_HANDOVER_UNIT,
    GATEWAY_SOCKET,
    GATEWAY_UNIT,
    gateway_socket_unit,
    gateway_unit,
)

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed"),
]


def verify(unit_text: str, folder: Path, name: str = GATEWAY_UNIT) -> subprocess.CompletedProcess[str]:
    path = folder / name
    path.write_text(unit_text)
    return subprocess.run(
        ["systemd-analyze", "verify", str(path)], capture_output=True, text=True, cwd=folder, timeout=60
    )


@pytest.mark.parametrize("inventory", ["lab.yaml", "hgx-two-fabrics.yaml", "single-box.yaml"])
def test_gateway_unit_verifies_cleanly(inventory: str, tmp_path: Path) -> None:
    spec = parse_cluster((ROOT / "inventories" / inventory).read_text())
    unit = gateway_unit(spec, llmgw_bin="/bin/true", config_path="/etc/llmgw/cluster.yaml")
    result = verify(unit, tmp_path)
    assert result.returncode == 0, result.stderr
    assert [line for line in result.stderr.splitlines() if GATEWAY_UNIT in line] == []


@pytest.mark.parametrize("inventory", ["lab.yaml", "hgx-two-fabrics.yaml", "single-box.yaml"])
def test_socket_and_hand_over_units_verify_cleanly(inventory: str, tmp_path: Path) -> None:
    """The three units side by side, as apply installs them: the services name the socket
    (Sockets=), which verify resolves from the same folder."""
    spec = parse_cluster((ROOT / "inventories" / inventory).read_text())
    spec = spec.model_copy(
        update={"gateway": spec.gateway.model_copy(update={"metrics_listen": "[::1]:9100"})}
    )
    (tmp_path / GATEWAY_UNIT).write_text(
        gateway_unit(spec, llmgw_bin="/bin/true", config_path="/etc/llmgw/cluster.yaml")
    )
    (tmp_path / GATEWAY_SOCKET).write_text(gateway_socket_unit(spec))
    handover = gateway_unit(spec, llmgw_bin="/bin/true", config_path="/etc/llmgw/cluster.yaml", handover=True)
    for name, text in ((GATEWAY_SOCKET, gateway_socket_unit(spec)), (GATEWAY_HANDOVER_UNIT, handover)):
        result = verify(text, tmp_path, name)
        assert result.returncode == 0, result.stderr
        assert [line for line in result.stderr.splitlines() if "llmgw-gateway" in line] == [], result.stderr


def test_verify_would_catch_a_broken_unit(tmp_path: Path) -> None:
    """The check above can fail: a typo'd key is reported on stderr."""
    spec = parse_cluster((ROOT / "inventories/lab.yaml").read_text())
    unit = gateway_unit(spec, llmgw_bin="/bin/true", config_path="/c").replace("RestartSec=", "RestartSek=")
    result = verify(unit, tmp_path)
    assert "RestartSek" in result.stderr
