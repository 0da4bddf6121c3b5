"""``connection: local``: the node is this machine; commands run as subprocesses."""

from __future__ import annotations

import asyncio
import os

from llmgw_cli.errors import NodeError
from llmgw_cli.remote.transport import CommandResult, atomic_write_command


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
            out, err = await asyncio.wait_for(
                proc.communicate(stdin.encode() if stdin is not None else None), self._timeout
            )
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

    async def write_file(self, path: str, content: str, *, mode: int = 0o644, root: bool = False) -> None:
        result = await self.run(atomic_write_command(path, mode), root=root, stdin=content)
        if not result.ok:
            raise NodeError(self.node, "failed", f"cannot write {path}: {result.stderr.strip()}")

    async def close(self) -> None:
        return None
