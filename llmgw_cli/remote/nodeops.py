"""The node helper's verbs, called from the control host or the gateway.

Two callers, one code path (see ``node/helper.py`` for the verbs and their checks):

- ``apply`` (the operator's transport) runs ``/usr/local/libexec/llmgw/node-helper VERB
  ARGS`` as root;
- the gateway logs in as ``llmgw-gateway`` with its own key; the node's
  ``authorized_keys`` forces the helper, which reads the same line from
  ``$SSH_ORIGINAL_COMMAND`` and elevates itself through its one sudo rule. On a
  ``connection: local`` node the gateway runs the helper directly; it elevates the same way.

The command line is built with ``shlex.join`` from words the helper checks again; no
value is ever pasted into a shell of ours.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from llmgw_cli.core.hosts.node_access import HELPER
from llmgw_cli.core.observe.parse.systemctl import parse_show, unit_state
from llmgw_cli.core.observe.unit_state import UnitState
from llmgw_cli.errors import NodeError
from llmgw_cli.node.helper import SHOW_PROPERTIES, unit_matches
from llmgw_cli.remote.transport import CommandResult, Transport


@dataclass
class NodeOps:
    """The helper's verbs on one node. ``root``: run it as root through the transport
    (the operator); else as the login account, which the helper elevates (the gateway)."""

    transport: Transport
    root: bool = True

    @property
    def node(self) -> str:
        return self.transport.node

    async def call(self, *words: str, stdin: str | None = None) -> CommandResult:
        return await self.transport.run(f"{HELPER} {shlex.join(words)}", root=self.root, stdin=stdin)

    async def must(self, *words: str, stdin: str | None = None) -> CommandResult:
        """``call``, with a non-zero exit raised as the node's error (the helper's reason)."""
        result = await self.call(*words, stdin=stdin)
        if not result.ok:
            why = (result.stderr or result.stdout).strip() or f"exit status {result.exit_status}"
            raise NodeError(self.node, "failed", f"node-helper {words[0]}: {why}")
        return result

    async def probe(self) -> CommandResult:
        return await self.call("probe")

    async def date(self) -> str:
        result = await self.call("date")
        return result.stdout.strip() if result.ok else ""

    async def show(self, unit: str) -> UnitState | None:
        result = await self.call("show", unit)
        blocks = parse_show(result.stdout)
        return unit_state(blocks[0]) if blocks else None

    async def journal(self, unit: str, since: str, lines: int) -> str:
        result = await self.call("journal", unit, since if since.isdigit() else "-", str(lines))
        return result.stdout

    async def stop(self, units: list[str]) -> None:
        if units:
            await self.call("stop", *units)

    async def remove(self, units: list[str]) -> None:
        if units:
            await self.must("remove", *units)

    async def write_unit(self, name: str, text: str) -> None:
        await self.must("write-unit", name, stdin=text)

    async def daemon_reload(self) -> None:
        await self.must("daemon-reload")

    async def start(self, units: list[str]) -> None:
        if units:
            await self.must("start", *units)


@dataclass
class ShellOps:
    """``show``, ``journal`` and ``date`` as plain root commands, for the gateway host when
    it is no node (it has no helper): the operator's transport runs them."""

    transport: Transport
    root: bool = True

    async def date(self) -> str:
        result = await self.transport.run("date +%s")
        return result.stdout.strip() if result.ok else ""

    async def show(self, unit: str) -> UnitState | None:
        result = await self.transport.run(f"systemctl show -p {SHOW_PROPERTIES} {shlex.quote(unit)}")
        blocks = parse_show(result.stdout)
        return unit_state(blocks[0]) if blocks else None

    async def journal(self, unit: str, since: str, lines: int) -> str:
        after = f"--since @{since}" if since.isdigit() else ""
        result = await self.transport.run(
            # --sync first: a failed start's own line may still be on its way to journald
            f"journalctl --sync 2>/dev/null; journalctl {shlex.join(unit_matches(unit))} {after} -n {int(lines)} --no-pager -o cat",
            root=True,
        )
        return result.stdout
