"""The nginx configuration docs/gateway.md gives for a TLS proxy in front of the gateway,
run as written (paths and ports replaced): the official openai client, trusting only the
proxy's certificate, gets plain and streamed answers through it."""

from __future__ import annotations

import re
import shutil
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.gateway.harness import Engine, Gateway, free_port, self_signed_cert
from tests.waiting import connects, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.any_loop]  # the documented nginx configuration

ROOT = Path(__file__).resolve().parents[2]
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"


def documented_snippet() -> str:
    text = (ROOT / "docs/gateway.md").read_text()
    found = re.search(r"```nginx\n(.*?)```", text, re.S)
    assert found, "docs/gateway.md has no nginx block"
    return found.group(1)


def nginx_conf(directory: Path, gateway_port: int, port: int, cert: Path, key: Path) -> str:
    snippet = documented_snippet()
    for documented, here in [
        ("server 127.0.0.1:8080;", f"server 127.0.0.1:{gateway_port};"),
        ("listen 443 ssl;", f"listen 127.0.0.1:{port} ssl;"),
        ("/etc/ssl/gateway.crt", str(cert)),
        ("/etc/ssl/gateway.key", str(key)),
    ]:
        assert documented in snippet, f"the documented snippet no longer has {documented!r}"
        snippet = snippet.replace(documented, here)
    temp = directory / "tmp"
    temp.mkdir()
    return f"""
user root;
daemon off;
worker_processes 1;
pid {directory}/nginx.pid;
error_log {directory}/error.log warn;
events {{ worker_connections 256; }}
http {{
  access_log off;
  client_body_temp_path {temp}; proxy_temp_path {temp}; fastcgi_temp_path {temp};
  uwsgi_temp_path {temp}; scgi_temp_path {temp};
{snippet}
}}
"""


@pytest.fixture
def proxied(tmp_path: Path) -> Iterator[tuple[Gateway, str, int, Path]]:
    if not Path(NGINX).exists():
        pytest.fail("nginx is not installed (Debian's nginx package)")
    engine = Engine(tmp_path, "m", tokens_per_second=200)
    model = {
        "name": "m",
        "source": "org/m",
        "fetch": "engine",
        "profile": "sim",
        "scaling": {"min": 1, "max": 1},
    }
    gw = Gateway(tmp_path, [model], {"m": [engine.address]})
    key = gw.cli("keys", "create", "--name", "user")
    gw.start()
    cert, private = self_signed_cert(tmp_path)
    port = free_port()
    proxy_dir = tmp_path / "nginx"
    proxy_dir.mkdir()
    (proxy_dir / "nginx.conf").write_text(nginx_conf(proxy_dir, gw.port, port, cert, private))
    proc = subprocess.Popen(
        [NGINX, "-p", str(proxy_dir), "-c", str(proxy_dir / "nginx.conf")],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def listening() -> bool:
            if connects("127.0.0.1", port, 0.2):
                return True
            assert proc.poll() is None, (proxy_dir / "error.log").read_text()
            return False

        wait_until(listening, timeout=10, what="nginx to listen")
        yield gw, key, port, cert
    finally:
        proc.terminate()
        proc.wait(10)
        gw.stop()
        engine.stop()


def test_documented_nginx_tls_proxy_serves_plain_and_streamed_answers(
    proxied: tuple[Gateway, str, int, Path],
) -> None:
    _gw, key, port, cert = proxied
    trusted = ssl.create_default_context(cafile=str(cert))
    with httpx.Client(verify=trusted) as http:
        client = openai.OpenAI(
            base_url=f"https://127.0.0.1:{port}/v1", api_key=key, max_retries=0, http_client=http
        )
        answer = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert answer.choices[0].message.content
        stream = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=20, stream=True
        )
        arrivals = [time.monotonic() for chunk in stream if chunk.choices and chunk.choices[0].delta.content]
        # 20 tokens at 200/s: unbuffered, they arrive over ~0.1s, not all at once at the end.
        assert len(arrivals) >= 10 and arrivals[-1] - arrivals[0] > 0.03
        client.close()
