"""Real processes for the gateway tests: simulated engines and `llmgw gateway run`, on loopback."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.ports import free_port
from tests.waiting import wait_until

ENGINE_KEY = "engine-secret"


def wait_http(
    url: str,
    proc: subprocess.Popen[bytes],
    log: Path,
    seconds: float = 30,
    verify: ssl.SSLContext | bool = True,
) -> None:
    """Wait until ``url`` answers 200, failing at once if ``proc`` (which serves it) exits."""

    def up() -> bool:
        assert proc.poll() is None, f"exited {proc.returncode}:\n{log.read_text()[-3000:]}"
        return httpx.get(url, timeout=2, verify=verify).status_code == 200

    wait_until(
        up,
        timeout=seconds,
        retry_on=(httpx.TransportError,),
        what=lambda: f"{url} to answer 200:\n{log.read_text()[-3000:]}",
    )


# --- fake engines written on raw sockets, for what a real one would not do -------------

HEALTHY = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
EVENT_STREAM = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    """``data`` as one chunk of a chunked body."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def trickle_until_closed(port: int, data: bytes, pause: float, give_up: float) -> float | None:
    """Send ``data`` to ``port`` on loopback a byte at a time, ``pause`` seconds apart
    (reading meanwhile); the seconds until the server closed the connection, or None if it
    was still open after ``give_up`` seconds or at the end of ``data``."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        started = time.monotonic()
        for byte in data:
            try:
                sock.sendall(bytes([byte]))
                sock.settimeout(pause)
                if sock.recv(1024) == b"":
                    return time.monotonic() - started
            except TimeoutError:
                pass
            except (ConnectionResetError, BrokenPipeError):
                return time.monotonic() - started
            if time.monotonic() - started > give_up:
                break
    return None


def read_head(conn: socket.socket) -> bytes:
    """What the client sent up to the end of its request head (and maybe some body after
    it), or less if it closed first: then the result has no blank line."""
    request = b""
    while b"\r\n\r\n" not in request:
        data = conn.recv(65536)
        if not data:
            break
        request += data
    return request


def fake_engine(serve: Callable[[socket.socket], None]) -> Iterator[int]:
    """For a fixture (``yield from``): a listening socket on a free loopback port that
    ``serve`` accepts from in a thread; yields the port, closes the socket after (which
    ends ``serve``'s accept)."""
    port = free_port()
    server = socket.create_server(("127.0.0.1", port))
    threading.Thread(target=serve, args=(server,), daemon=True).start()
    yield port
    server.close()


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, wait: float = 15) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(wait)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


def start_gateway(
    cluster: Path, log: Path, *options: str, port: int, tls: ssl.SSLContext | None = None
) -> subprocess.Popen[bytes]:
    """`llmgw gateway run -f cluster *options`, its output added to ``log``, returned once
    its /health on ``port`` answers 200 (over HTTPS trusting ``tls`` when given). A gateway
    that never answers is stopped, and the wait fails with the log's tail. One process
    unless ``options`` name ``--workers``: the tests count what that process did (its
    /metrics, its admin view, its routes file)."""
    argv = [sys.executable, "-m", "llmgw_cli", "gateway", "run", "-f", str(cluster), *options]
    if "--workers" not in options:
        argv += ["--workers", "1"]
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    scheme = "http" if tls is None else "https"
    try:
        wait_http(f"{scheme}://127.0.0.1:{port}/health", proc, log, verify=tls or True)
    except BaseException:
        stop(proc)
        raise
    return proc


class Engine:
    """A simulated vLLM serving ``name`` on 127.0.0.1, requiring the engine key."""

    def __init__(
        self,
        directory: Path,
        name: str,
        tokens_per_second: float = 0,
        key: str = ENGINE_KEY,
        port: int = 0,
        *,
        lora: bool = False,
    ) -> None:
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log = directory / f"engine-{name}-{self.port}.log"
        env = {
            **os.environ,
            "LLMGW_LAB_LOAD_SECONDS": "0",
            "LLMGW_LAB_GPUS": "/nonexistent",
            "LLMGW_LAB_TOKENS_PER_SECOND": str(tokens_per_second),
        }
        argv = [sys.executable, "-m", "llmgw_cli.lab.engine_sim", "vllm", "serve", f"org/{name}"]
        argv += ["--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", name]
        argv += ["--api-key", key]
        if lora:  # LoRA on, adapters loaded at run time (as llmgw's units start vLLM)
            argv.append("--enable-lora")
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        wait_http(f"http://{self.address}/health", self.proc, self.log)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        stop(self.proc, sig)


class Gateway:
    """`llmgw gateway run` with a cluster file, a static replica file and an engine key file."""

    def __init__(
        self,
        directory: Path,
        models: list[dict[str, object]],
        replicas: dict[str, list[str]],
        engine_key: str = ENGINE_KEY,
        **gateway: object,
    ) -> None:
        self.dir = directory
        self.port, self.admin_port, self.metrics_port = free_port(), free_port(), free_port()
        self.settings = {
            "listen": f"127.0.0.1:{self.port}",
            "admin_listen": f"127.0.0.1:{self.admin_port}",
            "metrics_listen": f"127.0.0.1:{self.metrics_port}",
            "state_dir": str(directory / "state"),
            "load_wait": "1s",
            "workers": 1,  # one process: tests/gateway/test_workers.py runs several
            **gateway,
        }
        self.cluster = directory / "cluster.yaml"
        self.replicas = directory / "replicas.yaml"
        self.write(models, replicas)
        (directory / "engine.env").write_text(f"LLMGW_ENGINE_KEY={engine_key}\n")
        self.log = directory / "gateway.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.clients: list[openai.OpenAI] = []

    def write(self, models: list[dict[str, object]], replicas: dict[str, list[str]]) -> None:
        spec = {
            "cluster": {"name": "gw"},
            "gateway": self.settings,
            "nodes": [{"name": "n1", "address": "127.0.0.1", "connection": "local"}],
            "profiles": {"sim": {"engine": "vllm"}},
            "models": models,
        }
        self.cluster.write_text(yaml.safe_dump(spec))
        self.replicas.write_text(yaml.safe_dump(replicas))

    def cli(self, *args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "llmgw_cli", *args, "-f", str(self.cluster)],
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    def start(self) -> None:
        self.proc = start_gateway(
            self.cluster,
            self.log,
            *("--replicas", str(self.replicas), "--engine-key-file", str(self.dir / "engine.env")),
            *("--health-every", "0.3", "--flush-every", "0.5"),
            port=self.port,
        )

    def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.proc is not None
        self.close_clients()
        return stop(self.proc, sig)

    def client(self, key: str, **kwargs: object) -> openai.OpenAI:
        """An openai client, closed with ``close_clients`` (or ``stop``): an unclosed one
        leaks sockets that fail a later test under ``-W error``."""
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.port}/v1",
            api_key=key,
            max_retries=0,
            timeout=30,
            **kwargs,  # type: ignore[arg-type]
        )
        self.clients.append(client)
        return client

    def close_clients(self) -> None:
        for client in self.clients:
            client.close()
        self.clients.clear()

    def access_lines(self) -> list[dict[str, object]]:
        """The access log's lines written so far (one JSON object a line, on stderr)."""
        return [json.loads(x) for x in self.log.read_text(errors="replace").splitlines() if x.startswith("{")]

    def admin(self, path: str, key: str) -> httpx.Response:
        return httpx.get(
            f"http://127.0.0.1:{self.admin_port}{path}",
            headers={"Authorization": f"Bearer {key}"},
            timeout=10,
        )


def self_signed_cert(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (its own CA) and its key, as PEM files."""

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "llmgw test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "gateway.crt", directory / "gateway.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    key_path.chmod(0o600)
    return cert_path, key_path
