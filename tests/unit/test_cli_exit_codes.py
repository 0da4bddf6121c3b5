"""Exit codes, the same for every command: 0 done, 1 failed, 2 bad input, 130 interrupted."""

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from llmgw_cli.cli.main import EXIT_CODES, _Commands
from llmgw_cli.errors import ExitCode, Interrupted

ROOT = Path(__file__).resolve().parents[2]


def hanging_cluster(tmp_path: Path, port: int) -> Path:
    """A cluster file whose one node is an SSH port that accepts and never says a word."""
    file = tmp_path / "cluster.yaml"
    file.write_text(
        f"""cluster: {{name: hang}}
ssh: {{user: nobody, port: {port}, connect_timeout: 10m, known_hosts: {tmp_path / "known_hosts"}}}
gateway: {{host: localhost, listen: "127.0.0.1:8080", state_dir: {tmp_path / "state"}}}
nodes:
  - {{name: n1, address: 127.0.0.1}}
profiles: {{}}
models: []
"""
    )
    return file


def test_ctrl_c_exits_130_with_a_short_message_and_no_traceback(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(60)
        cluster = hanging_cluster(tmp_path, listener.getsockname()[1])
        command = subprocess.Popen(
            [sys.executable, "-m", "llmgw_cli", "status", "-f", str(cluster)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            # connected: llmgw now waits for an SSH banner that never comes
            connection, _ = listener.accept()
            with connection:
                command.send_signal(signal.SIGINT)
                out, err = command.communicate(timeout=30)
        finally:
            command.kill()
            command.wait()
    assert command.returncode == ExitCode.interrupted == 130
    assert err.splitlines() == ["interrupted"]
    assert "Traceback" not in err
    assert out == ""


def commands() -> typer.Typer:
    app = typer.Typer(cls=_Commands)

    @app.command()
    def stopped() -> None:
        raise KeyboardInterrupt

    @app.command()
    def prompt() -> None:
        # what a prompt does with Ctrl-C (typer.confirm): "Aborted!" and exit 1 otherwise
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise typer.Abort() from None

    @app.command()
    def declined() -> None:
        raise typer.Abort

    return app


@pytest.mark.parametrize("command", ["stopped", "prompt"])
def test_ctrl_c_anywhere_in_a_command_is_an_interruption(command: str) -> None:
    result = CliRunner().invoke(commands(), [command])
    assert isinstance(result.exception, Interrupted)
    assert Interrupted.exit_code == 130


def test_a_declined_confirmation_is_a_failure_not_an_interruption() -> None:
    result = CliRunner().invoke(commands(), ["declined"])
    assert result.exit_code == ExitCode.failed
    assert not isinstance(result.exception, Interrupted)


def test_help_says_what_each_exit_code_means() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "llmgw_cli", "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "300"},
        timeout=60,
    )
    assert done.returncode == 0
    assert EXIT_CODES in done.stdout
    for code in ExitCode:
        assert f"{code.value} " in EXIT_CODES


def test_the_documented_exit_codes_are_those_of_the_code() -> None:
    usage = (ROOT / "docs/usage.md").read_text()
    section = usage[usage.index("## Exit codes") :]
    for code in ExitCode:
        assert f"| {code.value} |" in section
