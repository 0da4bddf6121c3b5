"""SSH transport on asyncssh: the only module that imports asyncssh.

Host keys are checked strictly against the configured known_hosts. A host missing from
it is refused unless ``accept_unknown_hosts`` is set (then its key is recorded); a host
whose key differs from the recorded one is always refused, with a message that says
how to check and fix it.

A transport holds its connection until closed, and is made to be held long (the gateway
keeps one per node between discovery rounds). A connection that dropped (the node
rebooted, sshd restarted) is opened again on the next command; so is one that stopped
answering: a session it cannot open within ``connect_timeout`` means the link is gone.
A command is never sent twice: only one that could not start is tried on a new connection.
"""

from __future__ import annotations

import asyncio
import shlex
from dataclasses import dataclass
from pathlib import Path

import asyncssh

from llmgw_cli.core.clusterfile.spec import Become, SshSettings
from llmgw_cli.errors import NodeError
from llmgw_cli.remote.transport import CommandResult, write_through


@dataclass(frozen=True)
class SshTarget:
    """Everything needed to reach one node, paths already resolved."""

    node: str
    host: str
    settings: SshSettings
    known_hosts: Path
    identity_file: Path | None


def _split_jump(jump: str, default_user: str) -> tuple[str, str, int]:
    user, _, rest = jump.rpartition("@")
    host, _, port = rest.partition(":")
    return (user or default_user, host, int(port) if port.isdigit() else 22)


_parsed: dict[bytes, asyncssh.SSHKnownHosts] = {}


def _known_hosts(path: Path) -> asyncssh.SSHKnownHosts | None:
    """``path`` parsed, once per process for the same content: a probe of many nodes
    would otherwise parse the same file for every connection. Keyed on the bytes read
    now, so a file changed in between is parsed again. None when it cannot be read or
    parsed."""
    try:
        text = path.read_bytes()
        parsed = _parsed.get(text)
        if parsed is None:
            parsed = asyncssh.import_known_hosts(text.decode())
            if len(_parsed) > 16:  # a file rewritten over and over (accept_unknown_hosts)
                _parsed.clear()
            _parsed[text] = parsed
        return parsed
    except (OSError, ValueError):
        return None


def _matches(parsed: asyncssh.SSHKnownHosts | None, host: str, port: int) -> bool:
    return parsed is not None and bool(parsed.match(host, "", port)[0])


class _Dropped(Exception):
    """The connection could not open a session for a command: it is gone."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind, self.reason = kind, reason


class SshTransport:
    """One asyncssh connection to one node, opened on first use, reused, and opened again
    when it dropped. ``connects`` counts the connections opened."""

    def __init__(self, target: SshTarget) -> None:
        self.node = target.node
        self.connects = 0
        self._target = target
        self._conn: asyncssh.SSHClientConnection | None = None
        self._jump: asyncssh.SSHClientConnection | None = None
        self._lock = asyncio.Lock()

    async def _connect_options(self, known_hosts: asyncssh.SSHKnownHosts | None) -> dict[str, object]:
        t = self._target
        s = t.settings
        options: dict[str, object] = {
            "port": s.port,
            "username": s.user,
            "connect_timeout": s.connect_timeout,
            "known_hosts": known_hosts or str(t.known_hosts),
            "agent_path": None if t.identity_file else (),
        }
        if t.identity_file:
            options["client_keys"] = [str(t.identity_file)]
        if s.jump_host:
            user, host, port = _split_jump(s.jump_host, s.user)
            self._jump = await asyncssh.connect(
                host,
                port=port,
                username=user,
                known_hosts=str(t.known_hosts),
                connect_timeout=s.connect_timeout,
                **({"client_keys": [str(t.identity_file)]} if t.identity_file else {}),
            )
            options["tunnel"] = self._jump
        return options

    async def _open(self) -> asyncssh.SSHClientConnection:
        t = self._target
        # Read once: the key checked here is the one the connection is verified against.
        parsed = _known_hosts(t.known_hosts)
        known = _matches(parsed, t.host, t.settings.port)
        try:
            options = await self._connect_options(parsed)
            if not known and t.settings.accept_unknown_hosts:
                options["known_hosts"] = None
            conn = await asyncssh.connect(t.host, **options)
        except asyncssh.HostKeyNotVerifiable as exc:
            if known:
                raise NodeError(
                    self.node,
                    "hostkey-changed",
                    f"host key of {t.host} does not match {t.known_hosts}: the machine was reinstalled "
                    "or someone is in between. Check the new key out of band, then replace its line "
                    f"(ssh-keygen -R {t.host} -f {t.known_hosts}). llmgw never bypasses a changed key.",
                ) from None
            raise NodeError(
                self.node,
                "hostkey-unknown",
                f"{t.host} is not in {t.known_hosts}: add its key (ssh-keyscan, checked out of band) "
                f"or set ssh.accept_unknown_hosts: true to record it on first contact ({exc.reason})",
            ) from None
        except asyncssh.PermissionDenied:
            raise NodeError(
                self.node, "auth", f"authentication refused for {t.settings.user}@{t.host} (check the key)"
            ) from None
        except (TimeoutError, asyncssh.TimeoutError):
            raise NodeError(
                self.node, "timeout", f"no answer from {t.host} within {t.settings.connect_timeout:g}s"
            ) from None
        except (OSError, asyncssh.Error) as exc:
            raise NodeError(self.node, "unreachable", f"cannot connect to {t.host}: {exc}") from None
        if not known and t.settings.accept_unknown_hosts:
            self._record_host_key(conn)
        return conn

    def _record_host_key(self, conn: asyncssh.SSHClientConnection) -> None:
        key = conn.get_server_host_key()
        if key is None:
            return
        t = self._target
        name = t.host if t.settings.port == 22 else f"[{t.host}]:{t.settings.port}"
        t.known_hosts.parent.mkdir(parents=True, exist_ok=True)
        with t.known_hosts.open("a", encoding="ascii") as fh:
            fh.write(f"{name} {key.export_public_key('openssh').decode().strip()}\n")

    async def _connection(self) -> tuple[asyncssh.SSHClientConnection, bool]:
        """The connection, opened when there is none or it closed; True when just opened."""
        async with self._lock:
            if self._conn is not None and not self._conn.is_closed():
                return self._conn, False
            await self._drop(self._conn)
            try:
                self._conn = await self._open()
            except BaseException:
                await self._drop(None)  # none is held now: closes a jump host opened for it
                raise
            self.connects += 1
            return self._conn, True

    async def _drop(self, conn: asyncssh.SSHClientConnection | None) -> None:
        """Close ``conn`` (and its jump host) when it is still the one held."""
        if conn is not self._conn:
            return
        held, jump = self._conn, self._jump
        self._conn = self._jump = None
        for c in (held, jump):
            if c is not None:
                c.close()
                await c.wait_closed()

    async def _start(
        self, conn: asyncssh.SSHClientConnection, command: str, stdin: str | None
    ) -> asyncssh.SSHClientProcess[str]:
        """A session running ``command``; ``_Dropped`` when the connection cannot open one."""
        limit = self._target.settings.connect_timeout
        try:
            async with asyncio.timeout(limit):
                proc = await conn.create_process(command, input=stdin)
            if stdin == "":
                # asyncssh feeds `input` and ends it only when it is non-empty: an empty one
                # would leave the command waiting for an end of input that never comes
                proc.stdin.write_eof()
            return proc
        except (TimeoutError, asyncssh.TimeoutError):
            raise _Dropped("timeout", f"{self._target.host} opened no session within {limit:g}s") from None
        except (OSError, asyncssh.Error) as exc:
            if conn.is_closed() or isinstance(exc, (OSError, asyncssh.DisconnectError)):
                raise _Dropped("unreachable", f"connection lost: {exc}") from None
            raise NodeError(self.node, "unreachable", f"cannot start a command: {exc}") from None

    async def _session(self, command: str, stdin: str | None) -> asyncssh.SSHClientProcess[str]:
        """``command`` started on the connection held; when that connection turns out to be
        gone, started once more on a new one (the command never ran on the old one)."""
        while True:
            conn, new = await self._connection()
            try:
                return await self._start(conn, command, stdin)
            except _Dropped as exc:
                await self._drop(conn)
                if new:  # a connection opened for this command: the node is not reachable
                    raise NodeError(self.node, exc.kind, exc.reason) from None

    async def run(self, command: str, *, root: bool = False, stdin: str | None = None) -> CommandResult:
        sudo = root and self._target.settings.become is Become.sudo
        full = f"sudo -n sh -c {shlex.quote(command)}" if sudo else command
        timeout = self._target.settings.command_timeout
        proc = await self._session(full, stdin)
        try:
            done = await proc.wait(check=False, timeout=timeout)
        except (TimeoutError, asyncssh.TimeoutError):
            proc.close()
            raise NodeError(self.node, "timeout", f"command timed out after {timeout:g}s") from None
        except (OSError, asyncssh.Error) as exc:
            raise NodeError(self.node, "unreachable", f"connection lost: {exc}") from None
        out = done.stdout if isinstance(done.stdout, str) else ""
        err = done.stderr if isinstance(done.stderr, str) else ""
        status = done.exit_status if done.exit_status is not None else 255
        if sudo and status == 1 and "sudo:" in err and ("password" in err or "not allowed" in err):
            raise NodeError(
                self.node, "sudo", f"sudo -n refused for {self._target.settings.user}: {err.strip()}"
            )
        return CommandResult(status, out, err)

    async def spawn(self, command: str, *, root: bool = False) -> SshSpawned:
        """``command`` left running with its stdin open (``transport.Spawned``); its stderr
        is merged into its stdout. No command timeout: the caller bounds its waits."""
        sudo = root and self._target.settings.become is Become.sudo
        merged = f"exec 2>&1; {command}"
        full = f"sudo -n sh -c {shlex.quote(merged)}" if sudo else f"sh -c {shlex.quote(merged)}"
        return SshSpawned(self.node, await self._session(full, None))

    async def write_file(
        self, path: str, content: str, *, mode: int = 0o644, root: bool = False, group: str | None = None
    ) -> None:
        await write_through(self, path, content, mode=mode, root=root, group=group)

    async def close(self) -> None:
        async with self._lock:
            await self._drop(self._conn)


class SshSpawned:
    """A command started by ``SshTransport.spawn``."""

    def __init__(self, node: str, proc: asyncssh.SSHClientProcess[str]) -> None:
        self.node = node
        self._proc = proc

    async def readline(self) -> str:
        try:
            return await self._proc.stdout.readline()
        except (OSError, asyncssh.Error) as exc:
            raise NodeError(self.node, "unreachable", f"connection lost: {exc}") from None

    async def close(self) -> None:
        """End its stdin and wait a little for it to exit; then close the channel."""
        try:
            self._proc.stdin.write_eof()
            async with asyncio.timeout(5):
                await self._proc.wait_closed()
        except (OSError, TimeoutError, asyncssh.Error):
            pass
        finally:
            self._proc.close()
