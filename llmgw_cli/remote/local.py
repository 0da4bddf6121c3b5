"""``connection: local``: the node is this machine; commands run as subprocesses."""

from __future__ import annotations

import asyncio
import os

from llmgw_cli.errors import NodeError
from llmgw_cli.remote.transport import CommandResult, write_through


class LocalTransport:
    def __init__(self, node: str, *, command_timeout: float, sudo: bool = False) -> None:
        self.node = node
        self._timeout = command_timeout
        self._sudo = sudo and os.geteuid() != 0

    async def run(self, command: str, *, root: bool = False, stdin: str | None = None) -> CommandResult:
        argv = ["sudo", "-n", "sh", "-c", command] if root and self._sudo else ["sh", "-c", command]
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            async with asyncio.timeout(self._timeout):
                out, err = await proc.communicate(stdin.encode() if stdin is not None else None)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise NodeError(self.node, "timeout", f"command timed out after {self._timeout:g}s") from None
        result = CommandResult(
            proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace")
        )
        if root and self._sudo and result.exit_status == 1 and "sudo:" in result.stderr:
            raise NodeError(self.node, "sudo", f"sudo refused: {result.stderr.strip()}")
        return result

    async def spawn(self, command: str, *, root: bool = False) -> LocalSpawned:
        """``command`` left running with its stdin a pipe (``transport.Spawned``); stderr
        goes with stdout. When this process dies, the pipe closes and the command sees
        the end of its stdin."""
        argv = ["sudo", "-n", "sh", "-c", command] if root and self._sudo else ["sh", "-c", command]
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        return LocalSpawned(proc)

    async def write_file(
        self, path: str, content: str, *, mode: int = 0o644, root: bool = False, group: str | None = None
    ) -> None:
        await write_through(self, path, content, mode=mode, root=root, group=group)

    async def close(self) -> None:
        return None


class LocalSpawned:
    """A command started by ``LocalTransport.spawn``."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self._proc = proc

    async def readline(self) -> str:
        assert self._proc.stdout is not None
        return (await self._proc.stdout.readline()).decode(errors="replace")

    async def close(self) -> None:
        """Close its stdin and wait a little for it to exit; kill it if it does not."""
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            async with asyncio.timeout(5):
                await self._proc.wait()
        except TimeoutError:
            self._proc.kill()
            await self._proc.wait()
