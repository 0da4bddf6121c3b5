"""What a systemd unit's sandbox hides from its service (pure: unit text and paths in).

A unit's service sees the host's files through the mounts its sandbox makes: a path the
sandbox hides (``PrivateTmp=`` gives the service empty ``/tmp`` and ``/var/tmp`` of its
own, ``ProtectHome=yes`` or ``tmpfs`` empties ``/home``, ``/root`` and ``/run/user``,
``InaccessiblePaths=`` and ``TemporaryFileSystem=`` hide what they name) does not exist
for it, whatever root sees. A program or interpreter there never starts (systemd answers
``203/EXEC``); a Python package there is never imported. ``ProtectSystem=`` and
``ProtectHome=read-only`` make paths read-only, which hides nothing.

``read_sandbox`` takes those directives from a unit's text, so the check reads the very
unit that is installed; ``hidden_by`` says which directive hides a path.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable
from dataclasses import dataclass

# What each directive hides: systemd.exec(5)
TMP_DIRS = ("/tmp", "/var/tmp")
HOME_DIRS = ("/home", "/root", "/run/user")
_TRUE = frozenset({"yes", "true", "on", "1"})
_TMP_HIDDEN = frozenset({*_TRUE, "disconnected"})
_HOME_HIDDEN = frozenset({*_TRUE, "tmpfs"})  # read-only keeps them visible


@dataclass(frozen=True)
class Sandbox:
    """The directives of a unit's ``[Service]`` section that hide paths, as systemd reads
    them: the last assignment of a setting wins; an empty one resets a list."""

    private_tmp: str = "no"
    protect_home: str = "no"
    inaccessible: tuple[str, ...] = ()
    temporary: tuple[str, ...] = ()


def read_sandbox(unit_text: str) -> Sandbox:
    """The sandbox of a unit file's ``[Service]`` section."""
    settings: dict[str, str] = {}
    lists: dict[str, list[str]] = {"InaccessiblePaths": [], "TemporaryFileSystem": []}
    section = ""
    for raw in unit_text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
            continue
        key, eq, value = line.partition("=")
        key, value = key.strip(), value.strip()
        if section != "[Service]" or not eq:
            continue
        if key in lists:
            if not value:
                lists[key].clear()
            lists[key] += value.split()
        else:
            settings[key] = value.lower()
    return Sandbox(
        private_tmp=settings.get("PrivateTmp", "no"),
        protect_home=settings.get("ProtectHome", "no"),
        inaccessible=tuple(_plain(p) for p in lists["InaccessiblePaths"]),
        # "PATH[:OPTIONS]": the options follow the first colon
        temporary=tuple(_plain(p.split(":", 1)[0]) for p in lists["TemporaryFileSystem"]),
    )


def _plain(entry: str) -> str:
    """A path of a list directive without its prefixes (``-``: a missing path is not an
    error; ``+``: relative to ``RootDirectory=``, which llmgw's units never set)."""
    return entry.lstrip("-+")


def _under(path: str, folder: str) -> bool:
    folder = folder.rstrip("/") or "/"
    return folder in ("/", path) or path.startswith(folder + "/")


def hidden_by(sandbox: Sandbox, path: str) -> str | None:
    """The directive (as ``Name=value``) that hides the absolute ``path`` from the unit's
    service, or None when the service sees it."""
    path = posixpath.normpath(path)
    if sandbox.private_tmp in _TMP_HIDDEN and any(_under(path, d) for d in TMP_DIRS):
        return f"PrivateTmp={sandbox.private_tmp}"
    if sandbox.protect_home in _HOME_HIDDEN and any(_under(path, d) for d in HOME_DIRS):
        return f"ProtectHome={sandbox.protect_home}"
    for folder in sandbox.inaccessible:
        if _under(path, posixpath.normpath(folder)):
            return f"InaccessiblePaths={folder}"
    for folder in sandbox.temporary:
        if _under(path, posixpath.normpath(folder)):
            return f"TemporaryFileSystem={folder}"
    return None


def unseen(unit_text: str, paths: Iterable[tuple[str, str]]) -> list[tuple[str, str, str]]:
    """The paths (``(what, path)`` pairs) the unit's service cannot see: ``(what, path,
    directive)`` each, in the order given."""
    sandbox = read_sandbox(unit_text)
    found = []
    for what, path in paths:
        directive = hidden_by(sandbox, path)
        if directive:
            found.append((what, path, directive))
    return found
