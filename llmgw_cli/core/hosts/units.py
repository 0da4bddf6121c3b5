"""systemd units rendered from the spec (pure: spec in, text out)."""

from __future__ import annotations

import ipaddress

from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.engine.templates import render
from llmgw_cli.errors import InputError

GATEWAY_UNIT = "llmgw-gateway.service"
# The gateway's listening sockets: systemd holds them, so the gateway restarts without
# refusing a connection.
GATEWAY_SOCKET = "llmgw-gateway.socket"
# A second instance of the gateway, run beside the first while apply upgrades it.
GATEWAY_HANDOVER_UNIT = "llmgw-gateway-handover.service"
GATEWAY_DIR = "/etc/llmgw/gateway"  # core/hosts/gateway_install.py imports this module: the path lives here


HUB_ENV_NAME = "hub.env"  # HF_ENDPOINT and HF_TOKEN for the gateway's own repository fetches


def gateway_unit(
    spec: ClusterSpec,
    *,
    llmgw_bin: str,
    config_path: str,
    user: str = "llmgw",
    ssh_key: str | None = None,
    known_hosts: str | None = None,
    handover: bool = False,
) -> str:
    """The ``llmgw-gateway.service`` unit that runs ``llmgw gateway run`` for ``spec``,
    with ``ssh_key`` and ``known_hosts`` (files on the gateway host) for reaching the nodes;
    with ``handover``, ``llmgw-gateway-handover.service``: the same service, never enabled,
    started by apply only while it restarts the first. Both take their listeners from
    ``llmgw-gateway.socket`` (``gateway_socket_unit``)."""
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
        hub_env_file=f"{GATEWAY_DIR}/{HUB_ENV_NAME}",
        ssh_key=ssh_key,
        known_hosts=known_hosts,
        handover=handover,
        socket_unit=GATEWAY_SOCKET,
        # systemd kills what is left after this: the drain bound, and time to write usage
        stop_timeout=max(60, int(spec.gateway.drain_timeout) + 30),
    )


def socket_address(listen: str) -> str:
    """A listener (``host:port``) as ``ListenStream=`` takes it: an IP address and a port.
    systemd resolves no host name: ``localhost`` is 127.0.0.1; another name is refused."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    if host == "localhost":
        host = "127.0.0.1"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise InputError(
            f"gateway listener {listen}: the installed gateway's listeners are held by "
            f"{GATEWAY_SOCKET}, which needs an IP address (or localhost), not a host name: "
            "write the address instead"
        ) from None
    return f"[{address}]:{port}" if address.version == 6 else f"{address}:{port}"


def gateway_socket_unit(spec: ClusterSpec) -> str:
    """``llmgw-gateway.socket``: one ``ListenStream=`` per listener of ``spec.gateway``."""
    g = spec.gateway
    listens = [g.listen, g.admin_listen] + ([g.metrics_listen] if g.metrics_listen else [])
    return render(
        "llmgw-gateway.socket.j2",
        cluster=spec.cluster.name,
        listen=[socket_address(x) for x in listens],
        service=GATEWAY_UNIT,
    )
