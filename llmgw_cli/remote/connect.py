"""A transport for each node of a cluster file, with its SSH settings resolved."""

from __future__ import annotations

from pathlib import Path

from llmgw_cli.core.spec import Become, ClusterSpec, Node
from llmgw_cli.remote.local import LocalTransport
from llmgw_cli.remote.ssh import SshTarget, SshTransport
from llmgw_cli.remote.transport import Transport


def resolve_path(value: str, base: Path) -> Path:
    """``~`` expanded; a relative path is relative to the cluster file's folder."""
    path = Path(value).expanduser()
    return path if path.is_absolute() else (base / path)


def transport_for(spec: ClusterSpec, node: Node, base: Path) -> Transport:
    settings = spec.ssh_for(node)
    if node.connection == "local":
        return LocalTransport(
            node.name, command_timeout=settings.command_timeout, sudo=settings.become is Become.sudo
        )
    return SshTransport(
        SshTarget(
            node=node.name,
            host=node.address,
            settings=settings,
            known_hosts=resolve_path(settings.known_hosts, base),
            identity_file=resolve_path(settings.identity_file, base) if settings.identity_file else None,
        )
    )
