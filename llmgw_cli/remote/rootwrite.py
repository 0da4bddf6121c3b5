"""Root's writes on a node or the gateway host: only inside folders no other account can
change, and never by a path that another account could redirect.

Runs where it writes, from the standard library only: the transports send this file's
text to ``python3 -I -c`` (``command``), with the content on stdin. Why a program and not
``mkdir -p && cat > tmp && chmod && mv``: each of those resolves its path again, so an
account that owns any folder on the way can swap in a link or a FIFO between two of them
and make root create, truncate or chmod a file of its choosing.

The rule, for every folder from ``/`` down to the one written in:

- it is reached through a descriptor opened relative to its parent's with
  ``O_DIRECTORY|O_NOFOLLOW`` (a link anywhere is refused, never followed);
- ``fstat`` on that descriptor says it is owned by a trusted account (root, or the account
  this program runs as: ``runuser -u OWNER`` writes in a folder that account owns, as that
  account, so root never acts there for it) and writable by no one else (no group or
  other ``w``). A root-owned sticky folder (``/tmp``) may stand above the last one: no
  other account can rename or remove what root made in it, and what it made itself is
  refused at the next step by its owner;
- a missing folder is made there (``mkdirat``, 0755) and then checked like the others.

The file is then written under a new random name in that folder (``O_CREAT|O_EXCL|
O_NOFOLLOW``), given its mode and group through its descriptor (``fchmod``, ``fchown``),
synced, and renamed over the target with ``renameat`` inside the same folder descriptor.
A failure removes the temporary file and leaves the target as it was.

Exit status: 0 done; 3 refused (a folder another account can change, a link, not a
folder), the reason on stderr; 1 any other failure (the ``OSError``'s text on stderr).
"""

from __future__ import annotations

import contextlib
import errno
import grp
import os
import secrets
import stat
import sys

REFUSED = 3
FOLDER_MODE = 0o755


class Refused(Exception):
    """A path root must not write through; the message names the folder and why."""


def trusted_owners() -> frozenset[int]:
    return frozenset({0, os.geteuid()})


def _check_folder(fd: int, shown: str, *, last: bool) -> None:
    st = os.fstat(fd)
    if not stat.S_ISDIR(st.st_mode):
        raise Refused(f"{shown} is not a folder")
    if st.st_uid not in trusted_owners():
        raise Refused(
            f"{shown} is owned by uid {st.st_uid}: another account could swap what is written "
            f"there (fix: chown root:root {shown})"
        )
    sticky_above = not last and st.st_uid == 0 and st.st_mode & stat.S_ISVTX
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not sticky_above:
        raise Refused(
            f"{shown} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}): another "
            f"account could swap what is written there (fix: chmod go-w {shown})"
        )


def open_folder(path: str, *, create: bool) -> int:
    """A descriptor on the folder ``path`` (absolute, normalized), reached from ``/`` one
    component at a time and checked at each; ``create`` makes the missing ones."""
    if not path.startswith("/") or os.path.normpath(path) != path or "\x00" in path:
        raise Refused(f"{path!r} is not a plain absolute path")
    parts = [p for p in path.split("/") if p]
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
    try:
        _check_folder(fd, "/", last=not parts)
        shown = ""
        for i, part in enumerate(parts):
            shown += "/" + part
            try:
                nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                os.mkdir(part, FOLDER_MODE, dir_fd=fd)
                nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                os.fchmod(nxt, FOLDER_MODE)  # whatever the umask
            except OSError as exc:
                # O_NOFOLLOW on a link: ELOOP; O_DIRECTORY on a file, FIFO or device: ENOTDIR
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise Refused(f"{shown} is a link or not a folder") from None
                raise
            os.close(fd)
            fd = nxt
            _check_folder(fd, shown, last=i == len(parts) - 1)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _split(path: str) -> tuple[str, str]:
    folder, name = os.path.split(path)
    if not name or name in (".", "..") or not folder:
        raise Refused(f"{path!r} does not name a file in a folder")
    return folder, name


def write(path: str, data: bytes, mode: int, group: str | None = None) -> None:
    """Replace the file ``path`` with ``data`` (mode ``mode``; group ``group``, a name or a
    number, when given) by the rule above."""
    folder, name = _split(path)
    gid = -1 if not group else int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
    fd = open_folder(folder, create=True)
    tmp = f".{name}.llmgw-{secrets.token_hex(8)}"
    try:
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=fd)
        try:
            with os.fdopen(out, "wb", closefd=False) as fh:
                fh.write(data)
                fh.flush()
                if gid >= 0:
                    os.fchown(out, -1, gid)
                os.fchmod(out, mode)
                os.fsync(out)
        finally:
            os.close(out)
        os.rename(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=fd)
        raise
    finally:
        os.close(fd)


def remove(path: str) -> None:
    """Remove the file ``path`` (nothing when it or its folder is not there), by the same
    rule: an account that could change a folder on the way must not choose what root
    removes."""
    folder, name = _split(path)
    try:
        fd = open_folder(folder, create=False)
    except FileNotFoundError:
        return
    try:
        os.unlink(name, dir_fd=fd)
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)


def main(argv: list[str]) -> int:
    """``write PATH MODE [GROUP]`` (the content on stdin) or ``remove PATH...``."""
    try:
        if len(argv) in (3, 4) and argv[0] == "write":
            write(argv[1], sys.stdin.buffer.read(), int(argv[2], 8), argv[3] if len(argv) == 4 else None)
        elif len(argv) >= 2 and argv[0] == "remove":
            for path in argv[1:]:
                remove(path)
        else:
            print("usage: write PATH MODE [GROUP] | remove PATH...", file=sys.stderr)
            return 2
    except Refused as exc:
        print(f"refused: {exc}", file=sys.stderr)
        return REFUSED
    except (OSError, KeyError) as exc:
        print(str(exc), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
