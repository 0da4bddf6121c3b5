"""Look, on a gateway host, at the llmgw its unit would run, before anything is installed
(``core/hosts/gateway_sight.py`` says what is looked at and why)."""

from __future__ import annotations

import shlex

from llmgw_cli import __version__
from llmgw_cli.core.hosts.gateway_install import GATEWAY_ACCOUNT
from llmgw_cli.core.hosts.gateway_sight import SIGHT_SCRIPT, read_sight, sight_problems, sight_refusal
from llmgw_cli.errors import NodeError
from llmgw_cli.remote.transport import Transport


async def check_sight(t: Transport, host: str, llmgw_bin: str, unit_text: str) -> None:
    """NodeError, naming each path and what hides it or who cannot read it, when the unit
    (``unit_text``, as it would be installed) could not run ``llmgw_bin`` on ``host``."""
    command = f"sh -s -- {shlex.quote(llmgw_bin)} {GATEWAY_ACCOUNT}"
    result = await t.run(command, root=True, stdin=SIGHT_SCRIPT)
    sight = read_sight(result.stdout)
    if not sight.account:
        why = (result.stderr or result.stdout).strip() or f"exit {result.exit_status}"
        raise NodeError(
            host, "failed", f"could not look at {llmgw_bin} as the gateway's account would: {why}"
        )
    problems = sight_problems(unit_text, sight)
    if problems:
        raise NodeError(host, "failed", sight_refusal(host, llmgw_bin, problems, __version__))
