"""Gateways installed by `apply` on lab nodes, sharing one PostgreSQL on this machine:
the server on the lab's bridge, the cluster file that names the gateway hosts, and the
clean-up of what apply installed there. Shared by the tests of several gateway hosts and
bench/failover.py."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from tests import pg

from .conftest import Lab
from .lab_helpers import reset
from .visible_llmgw import LLMGW

BRIDGE = "10.213.0.1"  # this machine on the lab's bridge: where the nodes reach PostgreSQL
LAB_NETWORK = "10.213.0.0/24"
GATEWAY_FILES = "/etc/llmgw/gateway"
GATEWAY_STATE = "/var/lib/llmgw-gw"


def store_url(server: pg.Postgres) -> str:
    """``gateway.store`` for ``server``, as the lab's nodes reach it (no password in it)."""
    return f"postgresql://{pg.ROLE}@{BRIDGE}:{server.port}/{pg.DATABASE}"


@contextmanager
def store_on_the_bridge() -> Iterator[pg.Postgres]:
    """PostgreSQL listening on the lab's bridge too, letting the lab's nodes log in (a
    skip where PostgreSQL is not installed)."""
    reason = pg.unavailable()
    if reason:
        pytest.skip(reason)
    server = pg.start(listen=[BRIDGE], allow=[LAB_NETWORK])
    try:
        yield server
    finally:
        server.stop()


def cluster_file(lab: Lab, folder: Path, **gateway: object) -> Path:
    """The lab's cluster file with a gateway section of its own: the public listener on
    every address of the gateway host, llmgw from this venv, ``gateway`` on top."""
    data = yaml.safe_load(lab.cluster_file.read_text())
    data["gateway"] = {
        "listen": "0.0.0.0:8080",
        "admin_listen": "127.0.0.1:9090",
        "state_dir": GATEWAY_STATE,
        "llmgw_bin": LLMGW,
        "load_wait": "20s",
        **gateway,
    }
    path = folder / "cluster.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def clean_command(password_dir: Path) -> str:
    """Shell that removes what apply installed for the gateway on a host."""
    return (
        "for u in llmgw-gateway.socket llmgw-gateway-handover llmgw-gateway; do systemctl disable --now $u; "
        "done 2>/dev/null; "
        "rm -rf /etc/systemd/system/llmgw-gateway.service /etc/systemd/system/llmgw-gateway.socket "
        "/etc/systemd/system/llmgw-gateway-handover.service "
        f"{GATEWAY_FILES} {GATEWAY_STATE} {password_dir}; systemctl daemon-reload; true"
    )


@contextmanager
def clean_hosts(lab: Lab, hosts: list[str], password_dir: Path) -> Iterator[None]:
    """A clean lab and gateway hosts before and after: no fault, no llmgw unit, no
    installed gateway, no password folder (this machine's and the hosts')."""
    reset(lab)
    for host in hosts:
        lab.ssh(host, clean_command(password_dir))
    try:
        yield
    finally:
        for host in hosts:
            lab.ssh(host, clean_command(password_dir))
        shutil.rmtree(password_dir, ignore_errors=True)
        reset(lab)
