"""A real HTTPS origin for weight downloads: Debian's nginx on 127.0.0.1 with a
self-signed certificate, Range support, a rate-limited path, a gated path and a Hugging
Face-like resolve redirect. Its access log (JSON lines) says what it really served.

Paths under the served folder ``www``:

- ``/<file>``: plain, full speed.
- ``/slow/<file>``: the same file at 24 MB/s per connection (to interrupt a download).
- ``/gated/<file>``: 401 unless ``Authorization: Bearer <TOKEN>``.
- ``/org/repo/resolve/main/<file>``: 302 to ``/cdn/<file>`` with ``X-Linked-Etag`` =
  the sha256 written in ``linked/<file>`` (what Hugging Face does for LFS files).
- ``/to-http/<file>``: 302 to ``http://<host>:<http_port>/<file>``, a plain-http listener
  of the same host serving the same folder (a downgrade, as a hostile origin or a
  misconfigured proxy answers).
- ``/to-other/<file>`` and ``/to-localhost/<file>``: 302 to ``https://<host>:<other_port>/<file>``
  and ``https://localhost:<other_port>/<file>``: another origin (another port, another
  host name) serving the same folder, as a CDN does.

Every listener logs the Authorization header it received, with its scheme and port.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.ports import free_port
from tests.waiting import connects, wait_until

TOKEN = "test-token-d0d0"

_CONF = """
user root;
daemon off;
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 256; }}
http {{
  types {{ }}
  default_type application/octet-stream;
  log_format origin escape=json '{{"method":"$request_method","uri":"$uri","status":$status,'
    '"sent":$body_bytes_sent,"range":"$http_range","if_range":"$http_if_range",'
    '"auth":"$http_authorization","scheme":"$scheme","port":"$server_port","host":"$host"}}';
  access_log {d}/access.log origin;
  client_body_temp_path {d}/tmp; proxy_temp_path {d}/tmp; fastcgi_temp_path {d}/tmp;
  uwsgi_temp_path {d}/tmp; scgi_temp_path {d}/tmp;
  sendfile on;
  server {{
    listen {host}:{port} ssl;
    ssl_certificate {d}/cert.pem;
    ssl_certificate_key {d}/key.pem;
    root {d}/www;
    location /slow/ {{ alias {d}/www/; limit_rate 24m; }}
    location /gated/ {{
      alias {d}/www/;
      if ($http_authorization != "Bearer {token}") {{ return 401; }}
    }}
    location /cdn/ {{ alias {d}/www/; }}
    location ~ ^/org/repo/resolve/main/(?<name>[^/]+)$ {{
      add_header X-Linked-Etag $linked always;
      return 302 /cdn/$name;
    }}
    location ~ ^/to-http/(?<name>[^/]+)$ {{ return 302 http://{host}:{http_port}/$name; }}
{hub}    location ~ ^/to-other/(?<name>[^/]+)$ {{ return 302 https://{host}:{other_port}/$name; }}
    location ~ ^/to-localhost/(?<name>[^/]+)$ {{ return 302 https://localhost:{other_port}/$name; }}
  }}
  server {{
    listen {host}:{http_port};
    root {d}/www;
  }}
  server {{
    listen {host}:{other_port} ssl;
    ssl_certificate {d}/cert.pem;
    ssl_certificate_key {d}/key.pem;
    root {d}/www;
  }}
  map $uri $linked {{
    include {d}/linked.map;
  }}
}}
"""


@dataclass
class Origin:
    root: Path
    port: int
    proc: subprocess.Popen[bytes]
    host: str = "127.0.0.1"
    http_port: int = 0
    other_port: int = 0

    @property
    def www(self) -> Path:
        return self.root / "www"

    @property
    def cert(self) -> Path:
        return self.root / "cert.pem"

    def url(self, path: str) -> str:
        return f"https://{self.host}:{self.port}/{path.lstrip('/')}"

    def add(self, name: str, size: int, *, seed: int = 0) -> str:
        """Write ``size`` pseudo-random bytes as ``name``; returns their sha256."""
        rng, h = random.Random(f"{name}-{seed}"), hashlib.sha256()
        with open(self.www / name, "wb") as f:
            for start in range(0, size, 64 << 20):  # randbytes takes at most 2**31 bits
                data = rng.randbytes(min(64 << 20, size - start))
                f.write(data)
                h.update(data)
        return h.hexdigest()

    def link(self, name: str, sha256: str) -> None:
        """Announce ``sha256`` as the X-Linked-Etag of ``/org/repo/resolve/main/name``."""
        with open(self.root / "linked.map", "a") as f:
            f.write(f'/org/repo/resolve/main/{name} "\\"{sha256}\\"";\n')
        subprocess.run(
            ["nginx", "-p", str(self.root), "-c", str(self.root / "nginx.conf"), "-s", "reload"], check=True
        )
        time.sleep(0.3)

    def log(self) -> list[dict[str, object]]:
        path = self.root / "access.log"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def gets(self, name: str) -> list[dict[str, object]]:
        """GET requests that asked for ``name`` (any location)."""
        return [e for e in self.log() if e["method"] == "GET" and str(e["uri"]).endswith("/" + name)]

    def clear_log(self) -> None:
        (self.root / "access.log").write_text("")
        os.kill(self.proc.pid, 10)  # SIGUSR1: reopen the log
        time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_origin(root: Path, host: str = "127.0.0.1", hub_port: int | None = None) -> Origin:
    """nginx serving ``root/www`` over TLS on ``host`` (loopback, or the lab's bridge).
    ``hub_port``: the Hub's API (``/api/``) and its ``/lab/<name>/resolve/`` URLs are passed
    to a Hub stand-in on that port of 127.0.0.1, so nodes reach it over TLS on ``host``."""
    if shutil.which("nginx") is None and not Path("/usr/sbin/nginx").exists():
        raise RuntimeError("nginx is missing (install scripts/weights-packages.txt)")
    (root / "www").mkdir(parents=True)
    (root / "tmp").mkdir()
    (root / "linked.map").write_text('default "";\n')
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={host}",
         "-addext", f"subjectAltName=IP:{host},DNS:localhost", "-keyout", str(root / "key.pem"), "-out", str(root / "cert.pem")],
        check=True, capture_output=True,
    )  # fmt: skip
    port, http_port, other_port = free_port(), free_port(), free_port()
    hub = ""
    if hub_port is not None:
        to = f"proxy_pass http://127.0.0.1:{hub_port}; proxy_buffering off;"
        hub = f"    location /api/ {{ {to} }}\n    location ~ ^/lab/[^/]+/resolve/ {{ {to} }}\n"
    conf = _CONF.format(
        d=root, host=host, port=port, token=TOKEN, http_port=http_port, other_port=other_port, hub=hub
    )
    (root / "nginx.conf").write_text(conf)
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    proc = subprocess.Popen(
        [nginx, "-p", str(root), "-c", str(root / "nginx.conf")],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def listening() -> bool:
        if connects(host, port, 0.2):
            return True
        if proc.poll() is not None:
            raise RuntimeError((root / "error.log").read_text())
        return False

    try:
        wait_until(listening, timeout=10, what=f"nginx to listen on {host}:{port}")
    except AssertionError:
        proc.kill()
        raise
    return Origin(root, port, proc, host, http_port, other_port)


def trusted_origin(folder: Path, why_root: str) -> Iterator[Origin]:
    """For a module's fixture (``yield from``): the origin in ``folder``, trusted by the
    node program (``SSL_CERT_FILE``), stopped after. Skips without root (saying
    ``why_root``) or without nginx."""
    if os.geteuid() != 0:
        pytest.skip(why_root)
    try:
        origin = start_origin(folder)
    except (RuntimeError, FileNotFoundError) as exc:
        pytest.skip(f"no nginx origin: {exc} (install scripts/weights-packages.txt)")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SSL_CERT_FILE", str(origin.cert))  # the node program trusts the test CA
        yield origin
    origin.stop()
