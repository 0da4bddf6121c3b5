"""`llmgw doctor` run for real against this machine (`connection: local`) and over SSH on
loopback: an engine binary whose shared library was removed, a port of the profile's range
held by a real listening socket, a weights folder that does not exist. Then the same node
healed: the findings go and the exit code is 0."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from .sshd import Sshd, running_sshd

pytestmark = pytest.mark.integration

ENGINE_C = "extern int doctor_gone(void);\nint main(void) { return doctor_gone(); }\n"
LIBRARY_C = "int doctor_gone(void) { return 0; }\n"


def build_engine(folder: Path) -> Path:
    """A real ELF linked against libdoctorgone.so, which stays next to it (for now)."""
    if shutil.which("gcc") is None:
        pytest.fail("gcc is missing: install scripts/doctor-packages.txt")
    (folder / "gone.c").write_text(LIBRARY_C)
    (folder / "engine.c").write_text(ENGINE_C)
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-o", folder / "libdoctorgone.so", folder / "gone.c"], check=True
    )
    engine = folder / "fake-engine"
    subprocess.run(
        ["gcc", "-o", engine, folder / "engine.c", f"-L{folder}", "-ldoctorgone", f"-Wl,-rpath,{folder}"],
        check=True,
    )
    return engine


def cluster(folder: Path, engine: Path, port: int, node: str, ssh: str = "") -> Path:
    path = folder / "cluster.yaml"
    path.write_text(
        f"""\
cluster: {{name: doctor-test}}
{ssh}
nodes:
  - {{name: here, address: 127.0.0.1, {node}
     weights: [{folder / "weights"}]}}
profiles:
  fake: {{engine: llama-server, command: [{engine}], ports: {port}-{port}}}
models:
  - {{name: m, source: {folder / "weights" / "m.gguf"}, profile: fake, scaling: {{min: 0, max: 1}}}}
"""
    )
    return path


def doctor(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    return subprocess.run(
        [sys.executable, "-m", "llmgw_cli", "doctor", "-f", str(path), *args],
        capture_output=True, text=True, timeout=120, check=False, env=env,
    )  # fmt: skip


def errors(done: subprocess.CompletedProcess[str]) -> dict[str, str]:
    report = json.loads(done.stdout)
    return {f["check"]: f["message"] for f in report["findings"] if f["severity"] == "error"}


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    try:
        yield sock
    finally:
        sock.close()


def broken_then_healed(folder: Path, path: Path, engine: Path, sock: socket.socket) -> None:
    port = sock.getsockname()[1]
    (folder / "libdoctorgone.so").unlink()  # the libgomp1 case: the binary is there, its library not
    done = doctor(path, "--json")
    assert done.returncode == 1, done.stdout + done.stderr
    found = errors(done)
    assert set(found) == {"engine.libraries", "ports.taken", "weights.missing"}, found
    assert "ldd finds no libdoctorgone.so" in found["engine.libraries"]
    assert f"port {port} (profile fake {port}-{port}) is taken by" in found["ports.taken"]
    assert str(folder / "weights") in found["weights.missing"]

    table = doctor(path)  # the table a person reads: each finding with its fix
    assert table.returncode == 1
    assert "ports.taken" in table.stdout and "move the profile's `ports` range" in table.stdout
    assert "serving would break" in table.stdout

    build_engine(folder)
    (folder / "weights").mkdir()
    sock.close()
    healed = doctor(path, "--json")
    assert healed.returncode == 0, healed.stdout + healed.stderr
    assert errors(healed) == {}


def test_doctor_on_this_machine(tmp_path: Path, listener: socket.socket) -> None:
    engine = build_engine(tmp_path)
    path = cluster(tmp_path, engine, listener.getsockname()[1], "connection: local,")
    broken_then_healed(tmp_path, path, engine, listener)


@pytest.fixture
def sshd(tmp_path: Path) -> Iterator[Sshd]:
    if os.geteuid() != 0 or not Path("/usr/sbin/sshd").exists():
        pytest.skip("sshd for root logins on loopback needs root and openssh-server")
    with running_sshd(tmp_path / "sshd") as server:
        yield server


def test_doctor_over_ssh_on_loopback(tmp_path: Path, listener: socket.socket, sshd: Sshd) -> None:
    engine = build_engine(tmp_path)
    ssh = (
        f"ssh: {{port: {sshd.port}, identity_file: {sshd.client_key}, known_hosts: {sshd.known_hosts}, "
        "connect_timeout: 5s}"
    )
    path = cluster(tmp_path, engine, listener.getsockname()[1], "", ssh)
    broken_then_healed(tmp_path, path, engine, listener)
