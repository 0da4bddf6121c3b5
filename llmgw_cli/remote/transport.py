"""How llmgw talks to a node: run a command, write a file atomically.

Two implementations: ``ssh.SshTransport`` (asyncssh, one connection per node, reused for
every command and opened again when it dropped) and ``local.LocalTransport``
(``connection: local``). Stages do not make transports: they get them from the one owner,
``connect.Connections``, which holds them for a whole run and closes them.

Contract: several tasks may use one transport at once (asyncssh multiplexes sessions over
the node's one connection, opened under a lock on first use); ``run`` never raises for a
non-zero exit (the caller reads ``exit_status``) but raises ``NodeError`` when the node
could not be reached, the command timed out, or a root action was refused by sudo.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class CommandResult:
    exit_status: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.exit_status == 0


class Transport(Protocol):
    node: str

    async def run(self, command: str, *, root: bool = False, stdin: str | None = None) -> CommandResult:
        """Run ``command`` with ``sh -c`` semantics; ``root`` runs it through ``sudo -n`` when
        the node's login is not root."""
        ...

    async def write_file(self, path: str, content: str, *, mode: int = 0o644, root: bool = False) -> None:
        """Write ``content`` to ``path`` atomically: a temporary file beside it, then rename."""
        ...

    async def close(self) -> None: ...


class Spawned(Protocol):
    """A command left running with its stdin open (``spawn`` of the SSH and local
    transports): it reads its lines as it prints them, and ``close`` ends its stdin, so
    a command that reads stdin to its end stops then. When the caller dies, the channel
    or pipe closes all the same."""

    async def readline(self) -> str:
        """The next line of its output (stdout and stderr together), "" once it ended."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class Spawns(Protocol):
    """A transport that can leave a command running (the SSH and local ones)."""

    async def spawn(self, command: str, *, root: bool = False) -> Spawned: ...


def atomic_write_command(path: str, mode: int) -> str:
    """Shell that copies stdin into ``path`` through a temporary file and a rename, so a
    reader (or an interrupted run) never sees a half-written file. Missing parent folders
    get the usual umask (a 0700 /etc/llmgw would lock the gateway's account out); only the
    temporary file is private until its mode is set."""
    q = shlex.quote(path)
    tmp = shlex.quote(f"{path}.llmgw-tmp")
    return (
        f'mkdir -p "$(dirname {q})" && umask 077 && cat > {tmp} && chmod {mode:o} {tmp} '
        f"&& mv -f {tmp} {q} || {{ rc=$?; rm -f {tmp}; exit $rc; }}"
    )
