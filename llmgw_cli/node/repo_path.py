"""What a file path inside a repository snapshot may be, judged one way on both sides: by
the control host when the Hub lists it (``core/weights/snapshot.py``) and by the node fetcher
when a job names it (the Hub chose it, so the node checks it again whatever the control
host checked)."""

from __future__ import annotations

SNAPSHOT_MAX_PATH_CHARS = 1024
"""Longest repository path accepted (in characters; the Hub's real ones are far shorter)."""
SNAPSHOT_MAX_COMPONENT_BYTES = 255
"""A file name's limit on Linux file systems, in bytes of UTF-8."""


def repo_path_problem(path: object) -> str | None:
    """Why ``path`` may not name a file inside a snapshot folder, or None when it may.

    Relative, ``/``-separated, no empty, ``.`` or ``..`` component, no backslash (a
    separator elsewhere), no NUL or other control character (nor U+2028/U+2029, line
    separators to line-based tools), no lone surrogate (not a name on disk), at most
    SNAPSHOT_MAX_PATH_CHARS characters and SNAPSHOT_MAX_COMPONENT_BYTES bytes a name.
    """
    if not isinstance(path, str):
        return f"{path!r}: a path is a string"
    shown = repr(path[:200])
    if not path:
        return "empty path"
    if len(path) > SNAPSHOT_MAX_PATH_CHARS:
        return f"{shown}...: {len(path)} characters, at most {SNAPSHOT_MAX_PATH_CHARS}"
    if path.startswith("/"):
        return f"{shown}: absolute; a repository path is relative to the snapshot folder"
    if "\\" in path:
        return f"{shown}: holds a backslash"
    if any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F or c in "\u2028\u2029" for c in path):
        return f"{shown}: holds a control character or a line separator"
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return f"{shown}: not valid Unicode (a lone surrogate)"
    for component in path.split("/"):
        if component in {"", ".", ".."}:
            return f"{shown}: has an empty, '.' or '..' component"
        if len(component.encode("utf-8")) > SNAPSHOT_MAX_COMPONENT_BYTES:
            return f"{shown}: a name longer than {SNAPSHOT_MAX_COMPONENT_BYTES} bytes"
    return None
