"""The folders on a node where root (``apply``, the node helper, the node fetcher) writes,
and the rule each of them must keep: owned by root and not writable by group or others,
and so each folder above it up to ``/`` (pure).

Why the folders above too: an account that may write a folder's parent can rename the
root-owned folder away and put its own in its place, and root then writes into a folder
that account controls (a planted link in it turns root's next write into one on any file).
A folder that does not exist yet is fine: ``apply`` makes it, owned by root; the folders
above it are still checked, since they hold it once it is made.
"""

from __future__ import annotations

import posixpath
import shlex

from llmgw_cli.core.engine.engine_access import SECRET_ENV_DIR
from llmgw_cli.core.engine.engines import UNIT_DIR
from llmgw_cli.core.hosts.node_access import GATEWAY_HOME, LIBEXEC, SUDOERS
from llmgw_cli.core.observe.facts import Fact
from llmgw_cli.core.planning.drain import DRAIN_DIR

ROOT_FOLDERS: tuple[str, ...] = (
    "/etc/llmgw",
    SECRET_ENV_DIR,
    LIBEXEC,
    UNIT_DIR,
    posixpath.dirname(SUDOERS),
    DRAIN_DIR,
    # the gateway account's keys: root's, so that account cannot add a key of its own
    f"{GATEWAY_HOME}/.ssh",
)
"""Every folder root writes in on a node; the doctor checks each and every folder above it."""

GROUP_OR_OTHERS_WRITE = 0o022


class Owned(Fact):
    """One path on a node as ``stat`` (without following a link) saw it."""

    path: str
    uid: int
    owner: str  # the account's name on the node ("UNKNOWN" when it has none)
    mode: int  # permission bits, e.g. 0o755
    link: bool = False


def ancestors(path: str) -> list[str]:
    """``path`` and every folder above it, up to ``/``."""
    chain = [posixpath.normpath(path)]
    while chain[-1] != "/":
        chain.append(posixpath.dirname(chain[-1]))
    return chain


def problem(entry: Owned) -> str | None:
    """What is wrong with a folder root writes in (or one above it); None when nothing.
    A link's own mode means nothing (it is always 777): only who owns it counts."""
    wrong = []
    if entry.uid != 0:
        wrong.append(f"owned by {entry.owner} (uid {entry.uid})")
    if not entry.link and entry.mode & GROUP_OR_OTHERS_WRITE:
        wrong.append(f"mode {entry.mode:o}, writable by {_writers(entry.mode)}")
    return ", ".join(wrong) or None


def _writers(mode: int) -> str:
    return " and ".join(who for who, bit in (("group", 0o020), ("others", 0o002)) if mode & bit)


def fix(entry: Owned) -> str:
    """The command that makes ``entry`` root's alone."""
    path = shlex.quote(entry.path)
    if entry.link:
        return f"chown -h root:root {path}"
    return f"chown root:root {path} && chmod go-w {path}"
