"""A transport for each node of a cluster file, with its SSH settings resolved."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from llmgw_cli.core.node_access import GATEWAY_USER
from llmgw_cli.core.spec import Become, ClusterSpec, Node
from llmgw_cli.remote.local import LocalTransport
from llmgw_cli.remote.ssh import SshTarget, SshTransport
from llmgw_cli.remote.transport import Transport


@dataclass(frozen=True)
class GatewayAccess:
    """How the gateway reaches nodes: as ``llmgw-gateway`` with its own key, which each
    node's ``authorized_keys`` restricts to the node helper. Never the operator's key."""

    identity_file: Path
    known_hosts: Path | None = None


def resolve_path(value: str, base: Path) -> Path:
    """``~`` expanded; a relative path is relative to the cluster file's folder."""
    path = Path(value).expanduser()
    return path if path.is_absolute() else (base / path)


def transport_for(
    spec: ClusterSpec, node: Node, base: Path, access: GatewayAccess | None = None
) -> Transport:
    settings = spec.ssh_for(node)
    if node.connection == "local":
        # The gateway on a node of its own runs the helper directly (it elevates itself
        # through its one sudo rule); the operator gets sudo for root actions as configured.
        sudo = access is None and settings.become is Become.sudo
        return LocalTransport(node.name, command_timeout=settings.command_timeout, sudo=sudo)
    known_hosts = resolve_path(settings.known_hosts, base)
    identity = resolve_path(settings.identity_file, base) if settings.identity_file else None
    if access is not None:
        settings = settings.model_copy(update={"user": GATEWAY_USER, "become": Become.none})
        identity = access.identity_file
        known_hosts = access.known_hosts or known_hosts
    return SshTransport(
        SshTarget(
            node=node.name,
            host=node.address,
            settings=settings,
            known_hosts=known_hosts,
            identity_file=identity,
        )
    )
