"""The cluster lock's pure parts: where the lock file is, what its holder writes into it,
what a waiter says, and the shell that `apply` runs on the gateway host to hold it.

One writer at a time: `llmgw apply` and the gateway each plan on a probe they made
themselves, so two of them writing units at once could pick the same free cards or
ports. Both take ``flock(2)`` on ``<gateway.state_dir>/cluster.lock`` on the gateway
host before they probe-and-plan and keep it until their units are written and started
(``remote/cluster_lock.py``). The holder writes one line saying who it is into the file;
a waiter reads it and names the holder.

The file is opened only as the owner of the state folder (the gateway's own account once
installed; 0700): an account that can plant a link there gains nothing it did not have.
"""

from __future__ import annotations

import shlex
from datetime import UTC, datetime

LOCK_FILE_NAME = "cluster.lock"
HOLDER_MAX = 200  # characters of the holder line shown to a waiter
UNKNOWN_HOLDER = "an unknown holder (it has not written its name yet)"


def lock_path(state_dir: str) -> str:
    """The lock file in the gateway's state folder."""
    return f"{state_dir.rstrip('/')}/{LOCK_FILE_NAME}"


def holder_record(who: str, why: str, since: float) -> str:
    """The one line a holder writes, e.g. ``apply by root@ops1 (pid 4242) since
    2026-12-01T02:50:00Z: applying cluster.yaml``."""
    when = datetime.fromtimestamp(since, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return shown_holder(f"{who} since {when}: {why}")


def shown_holder(text: str) -> str:
    """The holder as a waiter may print it: the first line, printable ASCII only (the
    file is written by another account), at most ``HOLDER_MAX`` characters."""
    first = text.strip().split("\n", 1)[0]
    clean = "".join(c for c in first if " " <= c <= "~").strip()
    if not clean:
        return UNKNOWN_HOLDER
    return clean if len(clean) <= HOLDER_MAX else clean[: HOLDER_MAX - 3] + "..."


def waiting_message(holder: str) -> str:
    return f"waiting for the cluster lock held by {holder}"


# What the shell below prints, one word first on each line.
BUSY, HELD, TIMEOUT, ERROR = "busy", "held", "timeout", "error"

# Runs as the state folder's owner: $1 the lock file, $2 seconds to wait, $3 the record.
# fd 9 holds the lock (flock(1) on an inherited descriptor locks the shell's open file);
# `cat` reads stdin to its end without fd 9, so the lock goes when the shell does: when
# the caller closes stdin, or its channel or pipe closes because it died.
# `command exec`: a redirection that fails on a bare `exec` ends sh before the message.
_HOLD = r"""umask 077
command exec 9<>"$1" || { echo "error cannot open $1"; exit 3; }
if ! flock -n 9; then
  echo "busy $(head -n 1 "$1" | head -c 300 | tr -cd '[:print:]')"
  flock -w "$2" 9 || { echo timeout; exit 4; }
fi
printf '%s\n' "$3" > "$1"
echo held
cat >/dev/null 9<&-
: > "$1"
"""


def hold_script(state_dir: str, wait: float, record: str, *, created_owner: str | None) -> str:
    """Shell (run as root) that waits up to ``wait`` seconds for the lock, prints ``busy
    <holder>`` once when it has to wait, then ``held`` (or ``timeout``, or ``error
    <why>``), and holds it until its stdin ends. A missing state folder is made 0700, owned
    by ``created_owner`` when that account exists (the installed gateway's), else root."""
    q = shlex.quote
    d, f = q(state_dir.rstrip("/") or "/"), q(lock_path(state_dir))
    owner = q(created_owner) if created_owner else "root"
    return (
        f"command -v flock >/dev/null || {{ echo 'error flock (util-linux) is not installed'; exit 3; }}; "
        f"if [ ! -d {d} ]; then mkdir -p {d} && chmod 700 {d} || {{ echo 'error cannot create {d}'; exit 3; }}; "
        f"id -u {owner} >/dev/null 2>&1 && chown {owner}: {d}; fi; "
        f"o=$(stat -c %U {d}) || {{ echo 'error cannot read {d}'; exit 3; }}; "
        f"set -- {f} {wait:g} {q(record)}; "
        f'if [ "$o" = "$(id -un)" ]; then exec sh -c {q(_HOLD)} sh "$@"; '
        f'else exec runuser -u "$o" -- sh -c {q(_HOLD)} sh "$@"; fi'
    )
