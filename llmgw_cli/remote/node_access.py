"""Install the node helper, its account and its one sudo rule on every node (as root,
over the operator's transport), when what is there differs from what is wanted.

``check`` compares digests the probe read (asking again, one command per node, only where
the probe could not read them; nothing changed); ``install`` writes what differs: accounts first, then the files atomically, the sudoers rule only after
``visudo -cf`` accepted it, the ``authorized_keys`` line last.
"""

from __future__ import annotations

import asyncio
import os
import shlex
from collections.abc import Mapping, Sequence

from llmgw_cli.core.clusterfile.spec import ClusterSpec, Node
from llmgw_cli.core.hosts.node_access import (
    AUTHORIZED_KEYS,
    GATEWAY_HOME,
    GATEWAY_USER,
    LIBEXEC,
    SUDOERS,
    NodeFile,
    engine_users,
    helper_stale,
    node_files,
    sudoers_rule,
)
from llmgw_cli.core.observe.facts import NodeAccess, NodeFacts
from llmgw_cli.core.observe.parse.probe import parse_section, probe_script, section_script
from llmgw_cli.errors import NodeError
from llmgw_cli.progress import Phase, Report
from llmgw_cli.remote.connect import Connections
from llmgw_cli.remote.execute import Outcome, ensure_account, must
from llmgw_cli.remote.node_code import HELPER_SOURCE, NODEFETCH_SOURCE
from llmgw_cli.remote.transport import Transport

SUBJECT = "node access"
NODE_ACCESS = "node-access"  # the probe's section


def wanted(spec: ClusterSpec, node: Node, public_keys: Sequence[str]) -> tuple[NodeFile, ...]:
    """The helper's files for ``node``; its config lets the node fetch from the Hub
    endpoint in use (``HF_ENDPOINT``, as the gateway's ``hub.env`` is written from it)."""
    return node_files(
        spec,
        node,
        helper_source=HELPER_SOURCE,
        nodefetch_source=NODEFETCH_SOURCE,
        probe_source=probe_script(spec, node),
        public_keys=public_keys,
        hub=os.environ.get("HF_ENDPOINT") or None,
    )


async def ensure_gateway_account(t: Transport) -> None:
    """``llmgw-gateway``: a system account that may log in by key only (``*``: no
    password, not locked, so sshd lets its key in), with a root-owned home so that it can
    never edit its own ``authorized_keys``.

    The home is taken first (its parent is root's: it cannot be swapped); from then on the
    account can change nothing in it, and a ``.ssh`` it left there as a link is not
    followed (``chown -h``; no ``chmod``, which would follow it): the key's write refuses
    it, naming it."""
    q = shlex.quote
    home, ssh = q(GATEWAY_HOME), q(f"{GATEWAY_HOME}/.ssh")
    await must(
        t,
        f"id -u {GATEWAY_USER} >/dev/null 2>&1 || useradd --system --home-dir {home} --no-create-home "
        f"--shell /bin/sh {GATEWAY_USER}; usermod -p '*' {GATEWAY_USER} && "
        f"{{ [ ! -L {home} ] || {{ echo {home} is a link >&2; exit 3; }}; }} && "
        f"mkdir -p {home} && chown root:root {home} && chmod 755 {home} && "
        f"{{ [ -L {ssh} ] || {{ mkdir -p {ssh} && chown root:root {ssh} && chmod 755 {ssh}; }}; }}",
        f"create the account {GATEWAY_USER}",
    )


async def _read_access(spec: ClusterSpec, conns: Connections, node: Node) -> NodeAccess | None:
    """The probe's node-access section, run on its own as root: for a node whose probe
    did not run as root (a ``become: sudo`` login)."""
    result = await conns.to(node.name).run("sh -s", root=True, stdin=section_script(NODE_ACCESS, spec, node))
    return parse_section(NODE_ACCESS, node, result.stdout).node_access


async def check(
    spec: ClusterSpec,
    conns: Connections,
    nodes: list[str],
    public_keys: Sequence[str],
    facts: Mapping[str, NodeFacts] | None = None,
) -> list[str]:
    """The nodes (of ``nodes``) whose helper, account, rule or key line is not as wanted,
    judged from the probe's ``facts`` where it read them (no round trip), else asked; a
    node that cannot be asked counts as needing it."""

    async def one(name: str) -> bool:
        node = spec.node(name)
        known = facts[name].node_access if facts and name in facts else None
        try:
            found = known or await _read_access(spec, conns, node)
        except NodeError:
            return True
        return found is None or helper_stale(wanted(spec, node, public_keys), found)

    needs = await asyncio.gather(*(one(n) for n in nodes))
    return [n for n, need in zip(nodes, needs, strict=True) if need]


async def _install_one(t: Transport, files: tuple[NodeFile, ...], users: list[str]) -> None:
    for user in users:
        await ensure_account(t, user)
    await ensure_gateway_account(t)
    await must(t, f"mkdir -p {LIBEXEC} /etc/llmgw && chmod 755 {LIBEXEC} /etc/llmgw", f"create {LIBEXEC}")
    for f in files:
        if f.path != AUTHORIZED_KEYS:
            await t.write_file(f.path, f.text, mode=f.mode, root=True)
    tmp = shlex.quote(f"{SUDOERS}.llmgw-tmp")  # sudo skips names with a dot: never read half-done
    result = await t.run(
        f"umask 077 && cat > {tmp} && chmod 440 {tmp} && visudo -cqf {tmp} && mv -f {tmp} {SUDOERS}"
        f" || {{ rc=$?; rm -f {tmp}; exit $rc; }}",
        root=True,
        stdin=sudoers_rule(),
    )
    if not result.ok:
        why = (result.stderr or result.stdout).strip()
        raise NodeError(t.node, "failed", f"the sudo rule for {GATEWAY_USER} was refused by visudo: {why}")
    key = next(f for f in files if f.path == AUTHORIZED_KEYS)
    await t.write_file(key.path, key.text, mode=key.mode, root=True)


async def install(
    spec: ClusterSpec, conns: Connections, nodes: list[str], public_keys: Sequence[str], report: Report
) -> list[Outcome]:
    """Put the helper and every gateway host's restricted key line on ``nodes``; one
    Outcome each."""
    users = engine_users(spec)

    async def one(node: Node, t: Transport) -> Outcome:
        try:
            await _install_one(t, wanted(spec, node, public_keys), users)
        except NodeError as exc:
            report(node.name, f"failed: {exc.reason}", Phase.failed)
            return Outcome(node.name, False, exc.reason)
        report(node.name, "node helper in place", Phase.done)
        return Outcome(node.name, True, "node helper in place")

    return await conns.each([spec.node(n) for n in nodes], one)
