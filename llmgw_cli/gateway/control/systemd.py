"""What the gateway shares with systemd: the listening sockets it inherits and the state
it reports.

``llmgw-gateway.socket`` holds the listeners; systemd passes them to
``llmgw-gateway.service`` and to ``llmgw-gateway-handover.service`` as file descriptors
3, 4, ... (``LISTEN_FDS``, for the process ``LISTEN_PID``). Both processes accept from
the same kernel sockets, so while one drains and the other starts no connection is
refused: the kernel queues them until one of them accepts. ``inherited_sockets`` takes
them (and clears ``LISTEN_*``, so no child inherits them); ``assign`` matches each to the
configured listener whose address it is bound to.

``notify`` sends a state line to ``$NOTIFY_SOCKET`` (``Type=notify``): ``READY=1`` once
the gateway serves, so ``systemctl start`` returns only then; ``STOPPING=1`` on SIGTERM.
Without ``$NOTIFY_SOCKET`` (not started by systemd) it does nothing.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping, MutableMapping

from llmgw_cli.errors import LlmgwError

LISTEN_FDS_START = 3  # SD_LISTEN_FDS_START
LISTEN_VARS = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")
SOCKET_UNIT = "llmgw-gateway.socket"  # named in messages only (core/hosts/units.py renders it)


def inherited_sockets(
    environ: MutableMapping[str, str] | None = None, pid: int | None = None
) -> list[socket.socket]:
    """The listening sockets systemd passed to this process (none when it passed none, or
    passed them to another process), as non-inheritable socket objects. ``LISTEN_*`` are
    removed from the environment either way, so no child process sees them."""
    env = os.environ if environ is None else environ
    values = {name: env.pop(name, None) for name in LISTEN_VARS}
    listen_pid, listen_fds = values["LISTEN_PID"], values["LISTEN_FDS"]
    if listen_pid is None or listen_fds is None:
        return []
    try:
        if int(listen_pid) != (os.getpid() if pid is None else pid):
            return []
        count = int(listen_fds)
    except ValueError:
        return []
    found = []
    for fd in range(LISTEN_FDS_START, LISTEN_FDS_START + max(count, 0)):
        os.set_inheritable(fd, False)
        found.append(socket.socket(fileno=fd))
    return found


def _addresses(listen: str) -> set[tuple[str, int]]:
    """The (IP address, port) pairs ``listen`` (``host:port``) stands for: the address
    itself, or what a host name resolves to."""
    host, _, port_text = listen.rpartition(":")
    host, port = host.strip("[]"), int(port_text)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return set()
    return {(str(ipaddress.ip_address(str(info[4][0]).partition("%")[0])), port) for info in infos}


def _bound(sock: socket.socket) -> tuple[str, int] | None:
    """The (IP address, port) a TCP socket is bound to; None for anything else."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
        return None
    name = sock.getsockname()
    return str(ipaddress.ip_address(str(name[0]).partition("%")[0])), int(name[1])


def _shown(sock: socket.socket) -> str:
    bound = _bound(sock)
    if bound is None:
        return f"a socket that is not TCP (fd {sock.fileno()})"
    address, port = bound
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def assign(sockets: list[socket.socket], listeners: Mapping[str, str]) -> dict[str, list[socket.socket]]:
    """Each configured listener (name -> ``host:port``) with the inherited sockets bound
    to its address. Refuses (``LlmgwError``) a listener no socket is bound to, and a socket
    that is no listener's: the socket unit and the cluster file disagree."""
    wanted = {name: _addresses(listen) for name, listen in listeners.items()}
    found: dict[str, list[socket.socket]] = {name: [] for name in listeners}
    stray = []
    for sock in sockets:
        bound = _bound(sock)
        owner = next((name for name, addrs in wanted.items() if bound in addrs), None)
        if owner is None:
            stray.append(sock)
        else:
            found[owner].append(sock)
    passed = ", ".join(_shown(s) for s in sockets) or "none"
    fix = f"run `llmgw apply` to rewrite {SOCKET_UNIT}, or restart it after editing it"
    missing = [name for name, socks in found.items() if not socks]
    if missing:
        named = ", ".join(f"gateway.{name} {listeners[name]}" for name in missing)
        raise LlmgwError(f"{SOCKET_UNIT} passed no socket for {named} (it passed {passed}): {fix}")
    if stray:
        named = ", ".join(_shown(s) for s in stray)
        raise LlmgwError(f"{SOCKET_UNIT} passed {named}, which is no listener of the cluster file: {fix}")
    return found


def notify(state: str, environ: Mapping[str, str] | None = None) -> bool:
    """Send ``state`` (``READY=1``, ``STOPPING=1``...) to systemd's notification socket;
    False when there is none or it cannot be reached (never raises: systemd not listening
    must not stop the gateway). ``@`` at the start of the path is the abstract namespace."""
    path = (os.environ if environ is None else environ).get("NOTIFY_SOCKET", "")
    if not path or path[0] not in "/@":
        return False
    address = "\0" + path[1:] if path.startswith("@") else path
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(state.encode(), address)
    except OSError:
        return False
    return True
