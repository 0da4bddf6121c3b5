"""systemd units rendered from the spec (pure: spec in, text out)."""

from __future__ import annotations

from llmgw_cli.core.spec import ClusterSpec
from llmgw_cli.core.templates import render

GATEWAY_UNIT = "llmgw-gateway.service"
GATEWAY_DIR = "/etc/llmgw/gateway"  # core/gateway_install.py imports this module: the path lives here


def gateway_unit(
    spec: ClusterSpec,
    *,
    llmgw_bin: str,
    config_path: str,
    user: str = "llmgw",
    ssh_key: str | None = None,
    known_hosts: str | None = None,
) -> str:
    """The ``llmgw-gateway.service`` unit that runs ``llmgw gateway run`` for ``spec``,
    with ``ssh_key`` and ``known_hosts`` (files on the gateway host) for reaching the nodes."""
    state_dir = spec.gateway.state_dir.rstrip("/")
    managed = state_dir.removeprefix("/var/lib/") if state_dir.startswith("/var/lib/") else None
    return render(
        "llmgw-gateway.service.j2",
        cluster=spec.cluster.name,
        llmgw_bin=llmgw_bin,
        config_path=config_path,
        user=user,
        state_dir=state_dir,
        state_directory=managed,
        engine_keys_file=f"{GATEWAY_DIR}/engine-keys.json",
        ssh_key=ssh_key,
        known_hosts=known_hosts,
    )
