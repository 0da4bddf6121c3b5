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
from pathlib import Path
from typing import Protocol, runtime_checkable

from llmgw_cli.errors import NodeError
from llmgw_cli.remote import rootwrite


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

    async def write_file(
        self, path: str, content: str, *, mode: int = 0o644, root: bool = False, group: str | None = None
    ) -> None:
        """Write ``content`` to ``path`` atomically (``write_command``: a temporary file
        beside it, then a rename, never through a folder another account can change);
        ``group``: the file's group, set before it appears under its name."""
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


SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _rootwrite_source() -> str:
    return Path(rootwrite.__file__).read_text(encoding="utf-8")


def write_command(path: str, mode: int, *, group: str | None = None, as_user: str | None = None) -> str:
    """Shell that copies stdin into ``path`` through a temporary file and a rename inside
    the folder's own descriptor (``rootwrite``: no folder on the way may be changeable by
    another account, no link is followed), so a reader never sees a half-written file and
    an account that owns a folder on the way cannot turn root's write into a write
    elsewhere. ``group``: the file's group, set before it takes its name (a secret shared
    with one account); ``as_user``: written as that account (``runuser``), for a folder it
    owns. Missing folders are made 0755."""
    words = ["python3", "-I", "-c", _rootwrite_source(), "write", path, f"{mode:o}"]
    if group:
        words.append(group)
    if as_user:
        # a system PATH: the caller's may name folders the account cannot read, or owns
        words = ["runuser", "-u", as_user, "--", "env", f"PATH={SYSTEM_PATH}", *words]
    return shlex.join(words)


async def write_through(
    t: Transport, path: str, content: str, *, mode: int, root: bool, group: str | None
) -> None:
    """``write_file`` of a transport that runs shell: ``write_command`` with ``content`` on
    its stdin, a failure raised as the node's ``NodeError``."""
    result = await t.run(write_command(path, mode, group=group), root=root, stdin=content)
    if not result.ok:
        raise NodeError(t.node, "failed", f"cannot write {path}: {result.stderr.strip()}")


def remove_command(*paths: str) -> str:
    """Shell that removes the files ``paths`` by the same rule as ``write_command``."""
    return shlex.join(["python3", "-I", "-c", _rootwrite_source(), "remove", *paths])
