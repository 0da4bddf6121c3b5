"""The connections to the nodes of a cluster file, and who holds them.

``transport_for`` makes the transport of one node, its SSH settings resolved.
``Connections`` is the one owner of those transports for a run of llmgw: every stage of
``apply`` (probe, node setup, engine keys, execute, readiness waits, the gateway's
install), and every discovery round of the gateway, asks it for a node's transport
instead of making one, so each node is connected to once and the connection is reused
until the owner closes it (a dropped connection is opened again by its transport).
Stages take the owner as a parameter, so a test can hand them a fake one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TypeVar

from llmgw_cli.core.clusterfile.spec import Become, ClusterSpec, Node, SshSettings
from llmgw_cli.core.hosts.node_access import GATEWAY_USER
from llmgw_cli.remote.local import LocalTransport
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
    # asyncssh and cryptography under it (about 15 MiB) load with the first SSH transport:
    # a gateway that never reaches a node (fixed replicas, a follower) never loads them
    from llmgw_cli.remote.ssh import SshTarget, SshTransport  # noqa: PLC0415

    return SshTransport(
        SshTarget(
            node=node.name,
            host=node.address,
            settings=settings,
            known_hosts=known_hosts,
            identity_file=identity,
        )
    )


T = TypeVar("T")
Opener = Callable[[ClusterSpec, Node, Path, GatewayAccess | None], Transport]
"""Makes the transport of a node: ``transport_for``, or a test's fake."""


class Connections:
    """Holds one transport per node, made on first use (``to``) and closed together
    (``close``, or leaving ``async with``). The transports connect lazily and open a
    dropped connection again, so what is held stays usable for as long as it is held.

    ``access``: the gateway's own key (``GatewayAccess``); None: the operator's settings."""

    def __init__(
        self,
        spec: ClusterSpec,
        base: Path,
        access: GatewayAccess | None = None,
        *,
        opener: Opener = transport_for,
    ) -> None:
        self.spec = spec
        self.base = base
        self.access = access
        self._opener = opener
        self._held: dict[str, tuple[Node, SshSettings, Transport]] = {}
        self._retired: list[Transport] = []

    def to(self, node: str | Node) -> Transport:
        """The transport of ``node`` (a node's name, or a host that is not one, such as the
        gateway host): the one held, or a new one when none is held or the node's address
        or SSH settings changed since."""
        target = node if isinstance(node, Node) else self.spec.node(node)
        settings = self.spec.ssh_for(target)
        held = self._held.get(target.name)
        if held is not None:
            if held[0] == target and held[1] == settings:
                return held[2]
            self._retired.append(held[2])
        transport = self._opener(self.spec, target, self.base, self.access)
        self._held[target.name] = (target, settings, transport)
        return transport

    async def use(self, spec: ClusterSpec) -> None:
        """Go on with ``spec`` (the gateway read its cluster file again): the connections of
        hosts that are not its nodes, and of nodes whose address or SSH settings it
        changed, are closed."""
        self.spec = spec
        nodes = {n.name: n for n in spec.nodes}
        for name, (node, settings, transport) in list(self._held.items()):
            now = nodes.get(name)
            if now is None or now != node or spec.ssh_for(now) != settings:
                del self._held[name]
                self._retired.append(transport)
        await self._close_retired()

    async def each(self, nodes: Sequence[Node], work: Callable[[Node, Transport], Awaitable[T]]) -> list[T]:
        """``work(node, transport)`` on every node of ``nodes`` at once, at most
        ``ssh.max_parallel`` at a time; the results in the order of ``nodes``. ``work``
        turns a node's failure into that node's result: one node's error is not every
        node's."""
        limit = asyncio.Semaphore(self.spec.ssh.max_parallel)

        async def bounded(node: Node) -> T:
            async with limit:
                return await work(node, self.to(node))

        return list(await asyncio.gather(*(bounded(n) for n in nodes)))

    async def close(self) -> None:
        """Close every connection held; a later ``to`` opens them again."""
        self._retired += [t for _, _, t in self._held.values()]
        self._held.clear()
        await self._close_retired()

    async def _close_retired(self) -> None:
        retired, self._retired = self._retired, []
        await asyncio.gather(*(t.close() for t in retired), return_exceptions=True)

    async def __aenter__(self) -> Connections:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
