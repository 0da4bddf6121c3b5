"""Where `llmgw keys` and `llmgw usage` reach the gateway's store from the machine they run on.

- PostgreSQL (``gateway.store``): directly, from anywhere that reaches the database (with
  ``gateway.store_password_file`` or ``$LLMGW_STORE_PASSWORD`` there).
- SQLite (the default) lives in ``gateway.state_dir`` on the gateway host: on that host the
  file is opened directly; anywhere else the command runs there, over the operator's SSH
  (the same connection `apply` uses), as the owner of the state folder (the gateway's own
  account once apply installed it), with the hidden option ``--store-dir DIR``: "this
  host's SQLite store in DIR, no cluster file, never over SSH again". What it prints comes
  back as JSON and is parsed here: it is another machine's output, never printed as is.

"This machine" is ``localhost``, a node with ``connection: local``, or a host whose
address this machine can bind to (it is one of its own addresses).
"""

from __future__ import annotations

import contextlib
import shlex
import socket

from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.remote.connect import Connections
from llmgw_cli.remote.gateway_install import LOCAL_NAMES, gateway_transport
from llmgw_cli.remote.transport import CommandResult

STORE_DIR_OPTION = "--store-dir"


def _own_address(address: str) -> bool:
    """Whether ``address`` (a name or an IP) is one of this machine's: binding to it works."""
    try:
        infos = socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    for family, kind, _, _, sockaddr in infos:
        with contextlib.suppress(OSError), socket.socket(family, kind) as probe:
            probe.bind((sockaddr[0], 0))
            return True
    return False


def this_machine(spec: ClusterSpec, host: str) -> bool:
    """Whether the gateway host ``host`` is the machine this runs on."""
    if host in LOCAL_NAMES or host == socket.gethostname():
        return True
    node = next((n for n in spec.nodes if n.name == host), None)
    if node is not None and node.connection == "local":
        return True
    return _own_address(node.address if node is not None else host)


def store_host(spec: ClusterSpec) -> str | None:
    """The gateway host to run the command on, or None: the store is reached from here
    (PostgreSQL, or SQLite on this machine)."""
    if spec.gateway.store is not None:
        return None
    host = spec.gateway.host
    return None if this_machine(spec, host) else host


def remote_command(spec: ClusterSpec, command: list[str], args: list[str]) -> str:
    """Shell (run as root on the gateway host) that runs ``llmgw COMMAND --store-dir
    STATE_DIR ARGS`` as the state folder's owner; exit 3 with a message when there is
    none. ``ARGS`` may end with ``--`` and arguments: the option comes before them."""
    q = shlex.quote
    state_dir = spec.gateway.state_dir.rstrip("/") or "/"
    binary = q(spec.gateway.llmgw_bin) if spec.gateway.llmgw_bin else '"$(command -v llmgw)"'
    words = " ".join(q(a) for a in [*command, STORE_DIR_OPTION, state_dir, *args])
    return (
        f"d={q(state_dir)}; b={binary}; "
        '[ -d "$d" ] || { echo "error: no gateway state folder $d on this host: run llmgw apply, '
        'or start the gateway there, first" >&2; exit 3; }; '
        '[ -n "$b" ] && [ -x "$b" ] || { echo "error: llmgw is not installed on the gateway host '
        '(or set gateway.llmgw_bin)" >&2; exit 3; }; '
        'o=$(stat -c %U "$d") || exit 3; '
        f'exec runuser -u "$o" -- "$b" {words}'
    )


async def on_gateway_host(
    spec: ClusterSpec, conns: Connections, host: str, command: list[str], args: list[str]
) -> CommandResult:
    """Run ``llmgw COMMAND ARGS`` against the gateway host's own store (``remote_command``)."""
    return await gateway_transport(conns, host).run(remote_command(spec, command, args), root=True)


def shown(text: str, most: int = 2000) -> str:
    """Another machine's message as it may be printed: printable characters and newlines
    only, at most ``most`` characters."""
    clean = "".join(c for c in text if c == "\n" or (c.isprintable() and c != "\x1b")).strip()
    return clean if len(clean) <= most else clean[: most - 3] + "..."
