"""A real OpenSSH server on loopback for transport tests: its own host key, one
authorized client key, started and stopped by the test (never the machine's sshd)."""

from __future__ import annotations

import shutil
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.ports import free_port
from tests.waiting import wait_until

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


def keygen(path: Path) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return path.with_suffix(".pub").read_text().strip()


@dataclass
class Sshd:
    folder: Path
    port: int
    client_key: Path
    known_hosts: Path
    host_key: Path
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        config = self.folder / "sshd_config"
        config.write_text(
            f"Port {self.port}\nListenAddress 127.0.0.1\nHostKey {self.host_key}\n"
            f"AuthorizedKeysFile {self.folder}/authorized_keys\nPidFile none\nUsePAM no\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\n"
            "StrictModes no\nAllowTcpForwarding yes\n"
        )
        # sshd insists on its privilege-separation directory (Debian's unit creates it)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        self.process = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)], stderr=subprocess.DEVNULL)

        def greets() -> bool:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                return s.recv(4).startswith(b"SSH-")

        try:
            wait_until(greets, timeout=10, retry_on=(OSError,), what=f"sshd's greeting on port {self.port}")
        except AssertionError:
            self.stop()
            raise

    def stop(self) -> None:
        if self.process:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None

    def rotate_host_key(self) -> None:
        self.stop()
        for p in (self.host_key, self.host_key.with_suffix(".pub")):
            p.unlink()
        keygen(self.host_key)
        self.start()


@contextmanager
def running_sshd(folder: Path) -> Iterator[Sshd]:
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    client_pub = keygen(folder / "client")
    (folder / "authorized_keys").write_text(client_pub + "\n")
    host_pub = keygen(folder / "host")
    port = free_port()
    known = folder / "known_hosts"
    known.write_text(f"[127.0.0.1]:{port} {host_pub}\n")
    server = Sshd(folder, port, folder / "client", known, folder / "host")
    server.start()
    try:
        yield server
    finally:
        server.stop()
