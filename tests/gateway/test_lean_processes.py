"""What the gateway's processes load (gateway/supervisor.py, gateway/control/workers.py):
the supervisor of several workers runs without the serving stack, and a worker loads what
only reaching nodes, fetching weights, installing gateways or rendering pages needs when
it first does so, never to route requests.

Memory itself is measured by bench/workers.py (bench/RESULTS.md), not asserted here: the
modules a process loads are what these tests hold on to."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from llmgw_cli.gateway import supervisor
from tests.gateway.harness import Engine, Gateway

# Packages of the serving stack and of the CLI: a supervisor that imported one of them
# would hold tens of MiB for nothing (it serves no request and reads no cluster file).
SERVING_STACK = (
    "aiohttp",
    "asyncssh",
    "cryptography",
    "pydantic",
    "pydantic_core",
    "prometheus_client",
    "typer",
    "click",
    "rich",
    "yaml",
    "jinja2",
    "httpx",
    "uvloop",
    "huggingface_hub",
    "llmgw_cli.cli",
    "llmgw_cli.core",
    "llmgw_cli.remote",
    "llmgw_cli.gateway.serving",
    "llmgw_cli.gateway.store",
)
# Loaded by a worker only when it reaches a node (SSH), resolves a model's snapshot on the
# Hub, installs a gateway on a host (its health check) or renders a template or the
# dashboard: a worker that routes requests of fixed replicas does none of these.
NOT_FOR_ROUTING = ("asyncssh", "cryptography", "huggingface_hub", "httpx", "jinja2", "pygments")
MODELS: list[dict[str, object]] = [{"name": "m", "source": "org/m", "fetch": "engine", "profile": "sim"}]
IMPORTED = re.compile(r"^import time:\s+\d+ \|\s+\d+ \| +(\S+)$", re.M)


def loaded_by(module: str) -> set[str]:
    """The modules a fresh interpreter holds after importing ``module``, started the way
    `llmgw gateway run` starts the supervisor (``-P``, this package's folder first)."""
    probe = "import importlib, sys; sys.path.insert(0, sys.argv[1]); importlib.import_module(sys.argv[2]); print(*sys.modules)"
    done = subprocess.run(
        [sys.executable, "-P", "-c", probe, supervisor.package_root(), module],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return set(done.stdout.split())


def among(modules: set[str], packages: tuple[str, ...]) -> set[str]:
    return {m for m in modules for p in packages if m == p or m.startswith(p + ".")}


def test_the_supervisor_imports_no_serving_stack() -> None:
    modules = loaded_by("llmgw_cli.gateway.supervisor")
    assert "llmgw_cli.gateway.control.workers" in modules  # what it runs is there
    assert among(modules, SERVING_STACK) == set()


def test_the_probe_sees_a_serving_import() -> None:
    """The check above can fail: the metrics of a worker pull prometheus_client in."""
    assert "prometheus_client" in among(loaded_by("llmgw_cli.gateway.serving.metrics"), SERVING_STACK)


def test_the_supervisor_runs_the_package_that_started_it() -> None:
    argv = supervisor.command(["python", "-m", "llmgw_cli", "gateway", "run"], 3, "/var/lib/x")
    assert argv[:3] == [sys.executable, "-P", "-c"]  # never the working directory's copy
    root = Path(argv[4])
    assert (root / "llmgw_cli" / "gateway" / "supervisor.py").resolve() == Path(supervisor.__file__).resolve()
    assert argv[5:] == [
        "--workers",
        "3",
        "--state-dir",
        "/var/lib/x",
        "--",
        "python",
        "-m",
        "llmgw_cli",
        "gateway",
        "run",
    ]


def test_a_worker_that_served_requests_never_loaded_ssh_or_the_hub(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real gateway on fixed replicas answers a completion, a stream and a scrape;
    Python's own import trace (``PYTHONPROFILEIMPORTTIME``, one line per module the
    process imported, on its stderr) shows what it loaded."""
    engine = Engine(tmp_path, "m")
    gw = Gateway(tmp_path, MODELS, {"m": [engine.address]})
    key = gw.cli("keys", "create", "--name", "client")
    monkeypatch.setenv("PYTHONPROFILEIMPORTTIME", "1")
    gw.start()
    try:
        client = gw.client(key)
        answer = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert answer.choices
        chunks = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True
        )
        assert list(chunks)
        assert httpx.get(f"http://127.0.0.1:{gw.metrics_port}/metrics", timeout=10).status_code == 200
        assert gw.stop() == 0
    finally:
        if gw.proc is not None and gw.proc.poll() is None:
            gw.stop()
        engine.stop()
    modules = set(IMPORTED.findall(gw.log.read_text()))
    assert {"aiohttp", "llmgw_cli.gateway.serving.proxy"} <= modules  # the trace is complete
    assert among(modules, NOT_FOR_ROUTING) == set()
