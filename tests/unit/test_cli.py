"""The CLI as a user meets it: exit codes, messages on stderr, no tracebacks."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def llmgw(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmgw_cli", *args], capture_output=True, text=True, cwd=cwd, timeout=60
    )


def test_validate_ok_summarises() -> None:
    result = llmgw("validate", "-f", str(ROOT / "inventories/hgx-two-fabrics.yaml"))
    assert result.returncode == 0, result.stderr
    assert "valid (cluster hgx-prod)" in result.stdout
    assert "10: 5 always on, 4 on demand, 1 off" in result.stdout


def test_validate_reports_every_problem_with_exit_2_and_no_traceback() -> None:
    result = llmgw("validate", "-f", str(ROOT / "tests/data/five-mistakes.yaml"))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len([line for line in lines if "five-mistakes.yaml:" in line]) == 7
    assert lines[-1] == "7 problems; nothing was changed."
    # one problem per line, never wrapped, whatever the terminal width
    expected = (
        "five-mistakes.yaml:21:5: models[1]: unknown key 'tensor_paralel' (did you mean 'tensor_parallel'?)"
    )
    assert any(line.endswith(expected) for line in lines)


def test_missing_file_is_an_input_error(tmp_path: Path) -> None:
    result = llmgw("validate", "-f", str(tmp_path / "nope.yaml"))
    assert result.returncode == 2
    assert "nope.yaml: no such file (give the cluster file with -f FILE)" in result.stderr
    assert "Traceback" not in result.stderr


def test_cluster_file_from_environment(tmp_path: Path) -> None:
    env_file = ROOT / "inventories/single-box.yaml"
    result = subprocess.run(
        [sys.executable, "-m", "llmgw_cli", "validate"],
        capture_output=True,
        text=True,
        env={"LLMGW_CLUSTER": str(env_file), "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert f"{env_file}: valid (cluster workstation)" in result.stdout.splitlines()


def test_validate_keeps_a_long_path_on_one_line(tmp_path: Path) -> None:
    """Without a terminal rich wraps at 80 columns: the headline must not be cut in two."""
    deep = tmp_path / ("d" * 70) / "cluster.yaml"
    deep.parent.mkdir()
    deep.write_text((ROOT / "inventories/single-box.yaml").read_text())
    result = llmgw("validate", "-f", str(deep))
    assert result.returncode == 0, result.stderr
    assert f"{deep}: valid (cluster workstation)" in result.stdout.splitlines()


def test_schema_prints_json_schema() -> None:
    result = llmgw("schema")
    assert result.returncode == 0
    schema = json.loads(result.stdout)
    assert schema["title"] == "llmgw cluster file"
    assert set(schema["properties"]) == {
        "cluster",
        "ssh",
        "gateway",
        "fabrics",
        "nodes",
        "profiles",
        "models",
    }


@pytest.mark.parametrize("args", [["--help"], ["validate", "--help"], ["render", "gateway-unit", "--help"]])
def test_help_explains(args: list[str]) -> None:
    result = llmgw(*args)
    assert result.returncode == 0
    assert "Usage" in result.stdout


def test_render_gateway_unit() -> None:
    result = llmgw(
        "render",
        "gateway-unit",
        "-f",
        str(ROOT / "inventories/lab.yaml"),
        "--llmgw-bin",
        "/opt/llmgw/bin/llmgw",
    )
    assert result.returncode == 0, result.stderr
    assert (
        "ExecStart=/opt/llmgw/bin/llmgw gateway run -f /etc/llmgw/gateway/cluster.yaml "
        "--engine-keys-file /etc/llmgw/gateway/engine-keys.json --identity-file /etc/llmgw/gateway/id_ed25519 "
        "--known-hosts /etc/llmgw/gateway/known_hosts\n" in result.stdout
    )
    assert "StateDirectory=llmgw-lab/gateway\n" in result.stdout
