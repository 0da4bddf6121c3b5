"""Runs ON A NODE, as root: the only thing the gateway's SSH key may run there.

Standard library only (the node has python3 and nothing of llmgw). ``llmgw apply``
installs this file as ``/usr/local/libexec/llmgw/node-helper`` (root, 0755) with the
node's python3 in its first line, and the gateway account's ``authorized_keys`` line as
``restrict,command="/usr/local/libexec/llmgw/node-helper" KEY``: whatever the gateway asks
for arrives in ``$SSH_ORIGINAL_COMMAND``, is split into words (never given to a shell),
checked, and refused unless it is one of the verbs below. A sudoers rule lets that
account run this program, and only it, as root: the helper checks its arguments first,
then runs itself again through ``sudo -n`` (``probe`` stays unprivileged: it only reads).

``apply`` drives the nodes through the same verbs, as root over the operator's own
transport, so both callers share one code path and one set of checks.

Verbs (unit names must be ``llmgw-<model>-<replica>.service``, except that ``show`` and
``journal`` also read the gateway's own unit):

- ``probe``: run the probe script ``apply`` installed for this node;
- ``kernel-xids``: NVIDIA's XID reports in this boot's kernel log (``XIDS_READ``): the
  probe runs unprivileged and asks this verb for them, since the kernel log is root's
  to read on most systems (``kernel.dmesg_restrict``, the journal's groups);
- ``date``: seconds since the epoch;
- ``show UNIT...``: a fixed set of ``systemctl show`` properties;
- ``journal UNIT SINCE LINES``: the unit's last LINES journal lines since SINCE (epoch
  seconds, or ``-``);
- ``stop|start|restart|remove UNIT...``: ``start`` enables too; ``remove`` disables and
  deletes the unit file and its drain marker (a replica ``apply`` retires; a unit
  written again under that name must not read as being retired);
- ``write-unit UNIT``: the unit text on stdin, checked line by line against what
  llmgw's replica template produces (see ``check_unit``), then written atomically;
- ``daemon-reload``;
- ``fetch``: a JSON job on stdin for the installed weights fetcher (fetch, poll, verify,
  serve; its file must lie directly in one of the node's weights folders; its URLs must be
  the cluster's origins or this node's fabric peers, and its servers listen on this
  node's own address with a long secret: see ``check_job_bounds``);
- ``held PATH...``: which of these files (in the weights folders) exist, not empty;
- ``exists PATH...``: what each path is, one JSON line ``{PATH: {"kind": K, "empty":
  B}}`` with K one of ``file``, ``dir``, ``other`` (a device, a FIFO, a socket),
  ``missing`` or ``unreadable``: whether a model's path source is there before its units
  start (see ``exists``); for a file or folder also ``"unreadable": {USER: ENTRY}``, for
  each engine account: the first folder or file in it that account cannot read (``{"path",
  "owner", "mode"}``, null when none), checked in a child process running as it. An
  engine program of the config (a path, or a bare name looked up on systemd's search
  path) is answered as the file it names, with ``"path"`` (what it resolved to) and
  ``"unrunnable": {USER: ENTRY}``: the first folder above it that account cannot enter,
  or the program itself when it may not execute it.

What the gateway may run is bounded by ``/etc/llmgw/node-helper.json`` (root, written by
``apply`` from the cluster file): the engine programs, the engine accounts, the weights
folders and the path sources of the cluster's models as this node sees them, the origins
weights are downloaded from, the addresses of this node's fabric peers and its own.

``fetch`` runs as root, so without those lists the gateway's key could have root download
``file:`` URLs, services on the node's loopback or the cloud's metadata address
(169.254.169.254) into a weights folder, and serve a folder on every interface.

``exists`` answers only about paths inside a weights folder, named exactly by a path
source of that file, or the cluster's engine programs exactly. It runs as root, so without
that bound the gateway's key could learn whether any file on the node exists, and whether
it is empty, in folders its own account cannot even list (home folders, ``/root``, other
services' state); with it, the key learns nothing about paths the cluster file does not
already name. The cost is that a path source added to the cluster file is answered only
once ``apply`` has written the new list, which it does before anything is started from
that file.

``apply`` reaches nodes on which the helper may not be installed yet, or holds an older
list: it pipes this file to ``python3 -I -`` as root with the list it is about to write
(``piped``), so both callers answer with this code and these bounds.
"""

from __future__ import annotations

import ipaddress
import json
import os
import pwd
import re
import shlex
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

VERSION = 1  # the interface's (node/__init__.py): shipped in this text, so in its digest
HELPER = "/usr/local/libexec/llmgw/node-helper"
# A copy of ``core/observe/parse/kernel_log.py``'s: this file is shipped alone (a test
# checks that the two are the same text).
XID_LINES = 256  # the last XID reports read
XID_LINE_BYTES = 512  # of each
XIDS_READ = f"""\
# NVIDIA's XID reports of this boot: from the journal's kernel messages when it has any,
# else from the kernel's ring buffer; only their lines, the last {XID_LINES}, each cut at
# {XID_LINE_BYTES} bytes and behind "@xid " (so none can start a line of its own).
x='NVRM: Xid'
if command -v journalctl >/dev/null 2>&1 && [ -n "$(journalctl -k -b -q -n 1 --no-pager 2>/dev/null)" ]; then
  echo "@source journal"
  journalctl -k -b -q --no-pager -o short-monotonic 2>/dev/null | grep -a -F "$x" | tail -n {XID_LINES} |
    cut -b 1-{XID_LINE_BYTES} | tr -c '\\n[:print:]' '?' | sed 's/^/@xid /'
elif command -v dmesg >/dev/null 2>&1 && dmesg >/dev/null 2>&1; then
  echo "@source dmesg"
  dmesg 2>/dev/null | grep -a -F "$x" | tail -n {XID_LINES} | cut -b 1-{XID_LINE_BYTES} |
    tr -c '\\n[:print:]' '?' | sed 's/^/@xid /'
else
  echo "@source unreadable"
fi
"""
PROBE = "/usr/local/libexec/llmgw/probe.sh"
NODEFETCH = "/usr/local/libexec/llmgw/nodefetch.py"
CONFIG = "/etc/llmgw/node-helper.json"
UNIT_DIR = "/etc/systemd/system"
DRAIN_DIR = "/var/lib/llmgw-drain"  # core/planning/drain.py's
SUDO = "/usr/bin/sudo"
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

ANY_UNIT = re.compile(r"^llmgw-[a-z0-9.-]+\.service$")
REPLICA_UNIT = re.compile(r"^llmgw-([a-z0-9.-]+)-[0-9]+\.service$")
SHOW_PROPERTIES = "Id,LoadState,ActiveState,SubState,Result,MainPID,NRestarts,ExecMainCode,ExecMainStatus"
MAX_UNIT_BYTES = 64 * 1024
MAX_JOURNAL_LINES = 1000
MAX_PATHS = 64  # core/weights/path_sources.py's
MAX_PATH_CHARS = 4096
# What systemd (PID 1) looks a bare ExecStart= program up on; /sbin and /bin are the same
# folders on a merged /usr, and searched last where they are not.
EXEC_SEARCH = PATH.split(":")
PROGRAM_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]{0,254}")

# Exactly the directives llmgw's replica template writes, section by section. Anything
# else (ExecStartPost, PAMName, RootDirectory, BindPaths, LoadCredential, a drop-in's
# worth of surprises) is refused: systemd ignores no directive it knows, so a list of what
# to refuse would miss the next one it learns.
SECTIONS: dict[str, frozenset[str]] = {
    "Unit": frozenset({"Description", "After", "Wants", "StartLimitIntervalSec", "StartLimitBurst"}),
    "Service": frozenset(
        {
            "Type",
            "User",
            "EnvironmentFile",
            "Environment",
            "ExecStartPre",
            "ExecStart",
            "Restart",
            "RestartSec",
            "TimeoutStartSec",
            "TimeoutStopSec",
            "KillMode",
            "LimitMEMLOCK",
            "LimitNOFILE",
            "IPAddressAllow",
            "IPAddressDeny",
        }
    ),
    "Install": frozenset({"WantedBy"}),
}
LABEL = re.compile(r"^X-Llmgw-[A-Za-z-]+$")
EXEC_PREFIXES = "+!@-:|"
# systemd's WHITESPACE: what it strips around a line, a key and a value, and splits Exec
# words on. Python's own strip() also takes NBSP and other Unicode spaces, which systemd
# keeps: " User=x" with an NBSP would count here and be an unknown key there.
WHITESPACE = " \t\n\r"
# The files the template hands an engine through EnvironmentFile= (core/hosts/paths.py's and
# core/engine/engine_access.py's): the node's engine key and this unit's model's secrets.
ENGINE_ENV_FILE = "/etc/llmgw/engine.env"
SECRET_ENV_DIR = "/etc/llmgw/env"
# Wants= would start any unit (a root shell on a console, a rescue target) along with the
# replica: only what the template names.
DEPENDENCIES = frozenset({"network-online.target"})
INSTALL_TARGETS = frozenset({"multi-user.target"})
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
PATH_CONTROL = re.compile(r"[\x00-\x1f\x7f]")  # tabs and newlines too


class Refused(Exception):
    """A request outside what the helper allows; the message says which part."""


def load_config(path: str = CONFIG) -> dict[str, list[str]]:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:
        raise Refused(f"cannot read {path} ({exc}): run llmgw apply") from None
    return config_from(data, path)


def config_from(data: object, where: str) -> dict[str, list[str]]:
    """The config's lists (``paths``, ``origins``, ``peers`` and ``addresses`` absent in a
    config written before they existed: nothing allowed)."""
    out: dict[str, list[str]] = {}
    for key in ("programs", "users", "weights", "paths", "origins", "peers", "addresses"):
        value = data.get(key, []) if isinstance(data, dict) else []
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise Refused(f"{where}: {key} must be a list of strings")
        out[key] = value
    return out


def check_unit_name(name: str, *, replica: bool = True) -> str:
    pattern = REPLICA_UNIT if replica else ANY_UNIT
    if not pattern.fullmatch(name):  # match() would let a trailing newline through
        raise Refused(f"unit name {name!r} is not an llmgw replica unit ({pattern.pattern})")
    return name


def _words(value: str) -> list[str]:
    """``value`` split where systemd splits it: on its WHITESPACE only."""
    return [w for w in re.split(f"[{WHITESPACE}]+", value) if w]


def _exec_words(key: str, value: str, programs: list[str], lineno: int) -> None:
    if not value or value[0] in EXEC_PREFIXES:
        raise Refused(f"line {lineno}: {key}= may not start with a prefix ({EXEC_PREFIXES}) or be empty")
    # The program is compared as written, so it must be a word that systemd reads the same
    # way: no quotes, backslash escapes, %-specifiers or $-variables, which systemd would
    # turn into another path than the one checked here. The arguments are the engine's.
    words = _words(value)
    program = words[0]
    if any(c in program for c in "\\\"'%$"):
        raise Refused(f"line {lineno}: {key}= names its program with quotes, escapes or variables")
    if program not in programs:
        raise Refused(
            f"line {lineno}: {key}= runs {program!r}, which is not an engine program of this cluster"
        )
    # An unquoted lone ';' starts a second command in systemd's reading of the line.
    if ";" in words:
        raise Refused(f"line {lineno}: {key}= holds a second command (';')")


def environment_files(unit: str) -> frozenset[str]:
    """The files ``unit`` may name in ``EnvironmentFile=``, exactly as the template writes
    them: the node's engine key and the secrets of the unit's own model (its slug is the
    unit name's, core/engine/engines.py's ``unit_name``). systemd reads these as root, expands
    globs and ``%``-specifiers in them and skips a missing one when it starts with ``-``:
    anything but these exact strings could hand an engine another model's secrets."""
    match = REPLICA_UNIT.fullmatch(unit)
    if match is None:
        raise Refused(f"unit name {unit!r} is not an llmgw replica unit ({REPLICA_UNIT.pattern})")
    return frozenset({ENGINE_ENV_FILE, f"{SECRET_ENV_DIR}/{match.group(1)}.env"})


def _assignments(text: str) -> Iterator[tuple[int, str, str, str]]:
    """(line, section, key, value) of every assignment, read as systemd's unit parser
    reads them (comments, sections, ``KEY=VALUE`` stripped of its WHITESPACE). What the
    two could read differently is refused: control characters (systemd also ends a line
    at CR or NUL), line continuations, a repeated or unknown section."""
    section = ""
    seen: set[str] = set()
    for lineno, raw in enumerate(text.split("\n"), 1):
        if CONTROL.search(raw):
            raise Refused(f"line {lineno}: control character")
        line = raw.strip(WHITESPACE)
        if line.endswith("\\"):
            raise Refused(f"line {lineno}: line continuations are not allowed")
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = line[1:-1] if line.endswith("]") else line
            if section not in SECTIONS or section in seen:
                raise Refused(f"line {lineno}: section {line!r} is not allowed here")
            seen.add(section)
            continue
        key, eq, value = line.partition("=")
        if not eq or not section:
            raise Refused(f"line {lineno}: expected KEY=VALUE inside a section")
        yield lineno, section, key.strip(WHITESPACE), value.strip(WHITESPACE)
    if "Service" not in seen:
        raise Refused("the unit has no [Service] section")


def _names_only(key: str, value: str, names: frozenset[str], lineno: int) -> None:
    if not value or not set(_words(value)) <= names:
        raise Refused(f"line {lineno}: {key}= may name only {', '.join(sorted(names))}")


def _check_value(
    key: str, value: str, config: dict[str, list[str]], env_files: frozenset[str], n: int
) -> None:
    if key in ("ExecStart", "ExecStartPre"):
        _exec_words(key, value, config["programs"], n)
    elif key in ("Wants", "After"):
        _names_only(key, value, DEPENDENCIES, n)
    elif key == "WantedBy":
        _names_only(key, value, INSTALL_TARGETS, n)
    elif key == "EnvironmentFile" and value not in env_files:
        raise Refused(
            f"line {n}: EnvironmentFile={value[:200]!r} is not one this unit may read: only "
            f"{' or '.join(sorted(env_files))}, exactly (no '-', glob, %-specifier or folder)"
        )


def check_unit(text: str, config: dict[str, list[str]], unit: str) -> None:
    """Refuse a unit that could do more than run an allowed engine program as an allowed
    engine account with its own secrets. Checked: the whole text (UTF-8, printable, no
    line continuation), every section and directive (only the template's), ``User=``
    (exactly once, an engine account, never root), the program of every ``Exec`` line (no
    ``+ ! @ - :`` prefixes, no second command), the units it pulls in, and
    ``EnvironmentFile=`` (only ``environment_files(unit)``, exactly)."""
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise Refused("the unit is not UTF-8 text") from None
    if size > MAX_UNIT_BYTES:
        raise Refused(f"the unit is larger than {MAX_UNIT_BYTES} bytes")
    env_files = environment_files(unit)
    users: list[str] = []
    for lineno, section, key, value in _assignments(text):
        allowed = key in SECTIONS[section] or (section == "Unit" and LABEL.fullmatch(key) is not None)
        if not allowed:
            raise Refused(f"line {lineno}: {key}= is not allowed in [{section}]")
        if key == "User":
            users.append(value)
        else:
            _check_value(key, value, config, env_files, lineno)
    if len(users) != 1:
        raise Refused("the unit must name exactly one User= (an engine account)")
    if users[0] in ("root", "0") or users[0] not in config["users"]:
        raise Refused(f"User={users[0]!r} is not an engine account of this cluster")


def _under_weights(path: str, config: dict[str, list[str]]) -> str:
    if not path.startswith("/") or os.path.normpath(path) != path:
        raise Refused(f"{path!r} is not a plain absolute path")
    for folder in config["weights"]:
        root = folder.rstrip("/") + "/"
        if path.startswith(root) and "/" not in path[len(root) :]:
            return path
    raise Refused(f"{path!r} is not a file directly in a weights folder of this node")


def plain_path(path: str) -> bool:
    """Absolute and normalised (no ``.``, ``..``, ``//``, trailing ``/``), no control
    character or NUL, at most MAX_PATH_CHARS (core/weights/path_sources.py's rule)."""
    return (
        path.startswith("/")
        and len(path) <= MAX_PATH_CHARS
        and not PATH_CONTROL.search(path)
        and "//" not in path
        and (path == "/" or not path.endswith("/"))
        and all(part not in (".", "..") for part in path.split("/"))
    )


def _may_ask(path: str, config: dict[str, list[str]]) -> str:
    """``path`` when ``exists`` may answer about it: a path source or an engine program of
    the cluster file exactly, or anything inside a weights folder; else Refused."""
    if path in config["paths"] or path in config["programs"]:
        return path
    for folder in config["weights"]:
        root = folder.rstrip("/") + "/"
        if path.startswith(root) and len(path) > len(root):
            return path
    raise Refused(f"{path!r} is neither in a weights folder nor a path source or engine program of this node")


def exists(path: str) -> dict[str, Any]:
    """What is at ``path``, as data: its kind and whether it is empty. Only metadata is
    read: ``stat`` (following links, as the engine will) and, for a folder, whether it
    has one entry. Nothing at the path is opened, read or run, so a path naming a device,
    a FIFO or a program does nothing (a device or FIFO answers ``other``)."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return {"kind": "missing", "empty": True}
    except OSError:  # a loop of links, an unreachable mount
        return {"kind": "unreadable", "empty": True}
    if stat.S_ISREG(st.st_mode):
        return {"kind": "file", "empty": st.st_size == 0}
    if not stat.S_ISDIR(st.st_mode):
        return {"kind": "other", "empty": True}
    try:
        with os.scandir(path) as entries:
            empty = next(entries, None) is None
    except OSError:
        return {"kind": "unreadable", "empty": True}
    return {"kind": "dir", "empty": empty}


MAX_READ_WALK = 20_000  # entries of a path source looked at for each engine account


def first_unreadable(path: str) -> dict[str, str] | None:
    """As the account this process runs as: the first folder above or at ``path`` it
    cannot enter, or entry under it it cannot read (a folder: list and enter), with its
    owner and mode; None when it may read all (up to ``MAX_READ_WALK`` entries). Only
    ``stat`` and ``access``: nothing is opened."""
    parts = path.split("/")
    for i in range(2, len(parts)):
        above = "/".join(parts[:i])
        if not os.access(above, os.X_OK):
            return _entry(above)
    todo, seen = [path], 0
    while todo and seen < MAX_READ_WALK:
        here = todo.pop()
        seen += 1
        try:
            folder = stat.S_ISDIR(os.stat(here).st_mode)
        except OSError:
            continue  # gone, or a dangling link: not this check's to judge
        if not os.access(here, os.R_OK | os.X_OK if folder else os.R_OK):
            return _entry(here)
        if folder:
            with os.scandir(here) as entries:
                todo += sorted((e.path for e in entries), reverse=True)
    return None


def _entry(path: str) -> dict[str, str]:
    st = os.stat(path)
    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        owner = str(st.st_uid)
    return {"path": path, "owner": owner, "mode": f"{stat.S_IMODE(st.st_mode):04o}"}


def as_account(
    user: str, paths: list[str], check: Callable[[str], dict[str, str] | None]
) -> dict[str, Any] | None:
    """``check`` (``first_unreadable``, ``first_unrunnable``) of each of ``paths`` in a
    child that runs as ``user`` (its groups too), so the answer is the engine's own; None
    when the account is missing (``apply`` makes it later) or this process cannot become
    it."""
    try:
        account = pwd.getpwnam(user)
    except KeyError:
        return None
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            os.close(read)
            os.setgroups(os.getgrouplist(user, account.pw_gid))
            os.setgid(account.pw_gid)
            os.setuid(account.pw_uid)
            with os.fdopen(write, "w") as out:
                json.dump({p: check(p) for p in paths}, out)
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as answer:
        text = answer.read()
    _, status = os.waitpid(pid, 0)
    if status != 0:
        return None
    data = json.loads(text)
    return data if isinstance(data, dict) else None


def resolve_program(program: str) -> str | None:
    """The file systemd runs for ``program``: itself when it is a path, else the first
    executable of that name on systemd's search path (as root decides it, as PID 1 does);
    None when there is none."""
    if "/" in program:
        return program
    for folder in EXEC_SEARCH:
        candidate = f"{folder}/{program}"
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def first_unrunnable(path: str) -> dict[str, str] | None:
    """As the account this process runs as: the first folder above ``path`` it cannot
    enter, or ``path`` itself when it may not execute it, with owner and mode; None when
    it may run it. Only ``access``: nothing is opened or run."""
    parts = path.split("/")
    for i in range(2, len(parts)):
        above = "/".join(parts[:i])
        if not os.access(above, os.X_OK):
            return _entry(above)
    return None if os.access(path, os.X_OK) else _entry(path)


def exists_answer(paths: list[str], config: dict[str, list[str]]) -> dict[str, Any]:
    """``exists`` of each path, and for those that are there, whether each engine account
    of the config may read everything in it (``{"unreadable": {USER: entry or None}}``);
    for an engine program, what it resolves to and whether each account may run that
    file (``{"path": P, "unrunnable": {USER: entry or None}}``)."""
    programs = {p: resolve_program(p) for p in paths if p in config["programs"]}
    answer: dict[str, dict[str, Any]] = {}
    for p in paths:
        if p in programs:
            found = programs[p]
            answer[p] = exists(found) if found else {"kind": "missing", "empty": True}
            answer[p]["path"] = found
        else:
            answer[p] = exists(p)
    there = [p for p in paths if p not in programs and answer[p]["kind"] in ("file", "dir")]
    runnable = sorted({f for p, f in programs.items() if f and answer[p]["kind"] == "file"})
    for user in config["users"] if there or runnable else []:
        read = (as_account(user, there, first_unreadable) if there else None) or {}
        run = (as_account(user, runnable, first_unrunnable) if runnable else None) or {}
        for p in there if read else []:
            answer[p].setdefault("unreadable", {})[user] = read.get(p)
        for p, f in programs.items() if run else []:
            if f in runnable:
                answer[p].setdefault("unrunnable", {})[user] = run.get(f)
    return answer


def _systemctl(*args: str) -> int:
    return subprocess.call(["systemctl", *args])


def _write_unit(name: str, text: str) -> None:
    path = os.path.join(UNIT_DIR, name)
    tmp = os.path.join(UNIT_DIR, f".{name}.llmgw-tmp")
    if os.path.lexists(tmp):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


MAX_DRAIN_SECONDS = 7 * 24 * 3600
DRAIN_SECONDS = re.compile(r"^[0-9]{1,7}(\.[0-9]{1,3})?$")


def _drain_dir() -> str:
    """The markers' folder, made root's 0755 if missing; refused when it is a link, not a
    folder, not root's or writable by others (root must not write where another account
    could swap a file for a link)."""
    if not os.path.lexists(DRAIN_DIR):
        os.mkdir(DRAIN_DIR, 0o755)
    st = os.lstat(DRAIN_DIR)
    # the helper runs its verbs as root (main elevates first): its own uid is root's
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise Refused(f"{DRAIN_DIR} is not a folder of root's alone")
    return DRAIN_DIR


def drain_mark(unit: str, seconds: str) -> float:
    """The drain marker of ``unit``: its deadline, this node's clock plus ``seconds``,
    one line (``core/planning/drain.py`` reads it back); written whole or not at all."""
    deadline = time.time() + float(seconds)
    folder = _drain_dir()
    path, tmp = os.path.join(folder, unit), os.path.join(folder, f".{unit}.llmgw-tmp")
    if os.path.lexists(tmp):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(f"{deadline:.3f}\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
    return deadline


def drain_clear(units: list[str]) -> None:
    for unit in units:
        path = os.path.join(DRAIN_DIR, unit)
        if os.path.lexists(path):
            os.unlink(path)


FETCH_MODES = {
    "fetch": "target",
    "poll": "target",
    "verify": "target",
    "serve": "file",
    # whole repositories: the job names the repository's folder, W/hf/<org>--<name>
    "snapshot": "folder",
    "poll-snapshot": "folder",
    "verify-snapshot": "folder",
    "serve-snapshot": "folder",
}
_REPO_FOLDER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*--[A-Za-z0-9_][A-Za-z0-9_.-]*")


def _repo_folder_under_weights(path: str, config: dict[str, list[str]]) -> str:
    """``path`` when it is ``<a weights folder>/hf/<org>--<name>``, else Refused: a snapshot
    job writes only inside a repository's own folder of a weights folder."""
    if not path.startswith("/") or os.path.normpath(path) != path:
        raise Refused(f"{path!r} is not a plain absolute path")
    for folder in config["weights"]:
        root = folder.rstrip("/") + "/hf/"
        rest = path[len(root) :]
        if path.startswith(root) and _REPO_FOLDER.fullmatch(rest) and ".." not in rest:
            return path
    raise Refused(f"{path!r} is not a repository folder (hf/<org>--<name>) of a weights folder of this node")


SECRET = re.compile(
    r"[A-Za-z0-9_-]{32,256}"
)  # the fetcher's (fetch_serve.py): what secrets.token_urlsafe(24) makes
INET_ATON = re.compile(r"(0[xX][0-9a-fA-F]*|[0-9]+)(\.(0[xX][0-9a-fA-F]*|[0-9]+)){0,3}")
URL_CHARS = re.compile(r"[\x21-\x7e]{1,8192}")  # printable ASCII, no space: quoted as llmgw quotes


def literal_host_refused(host: str) -> str | None:
    """Why a URL's host, as written, names this node or the cloud's metadata service
    (loopback, link-local, unspecified), or None. Numbers in the forms the resolver also
    reads (``127.1``, ``2130706433``, ``0x7f.0.0.1``) count as the address they spell."""
    if host.lower().rstrip(".") == "localhost" or host.lower().endswith(".localhost"):
        return "names this node itself (localhost)"
    address: ipaddress.IPv4Address | ipaddress.IPv6Address
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        if not INET_ATON.fullmatch(host):
            return None  # a host name: the origins and peers listed in the config decide
        try:
            address = ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        address = address.ipv4_mapped
    if address.is_loopback or address.is_unspecified:
        return f"{host} is this node itself (loopback or unspecified)"
    if address.is_link_local:
        return f"{host} is link-local (where clouds answer metadata and credentials)"
    return None


def check_url(url: object, config: dict[str, list[str]]) -> str:
    """``url`` when a fetch job may download it as root, else Refused with why: http or
    https only, no user name or password, no loopback, link-local or unspecified address
    as its host, and either one of the cluster's origins (``origins``: a URL exactly, or
    any URL under a prefix that ends in ``/``) or a peer of this node's fabric (``peers``:
    ``http://<peer>:<port>/<secret>/...``, a secret such as the servers are given). Both
    lists come from the config apply wrote as root, never from the job."""
    if not isinstance(url, str) or not URL_CHARS.fullmatch(url):
        raise Refused(f"fetch: {str(url)[:200]!r} is not a URL of printable characters")
    try:
        parts = urlsplit(url)
        host, port = parts.hostname or "", parts.port
    except ValueError as exc:
        raise Refused(f"fetch: {url[:200]!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not host:
        raise Refused(f"fetch: {url[:200]!r}: only http and https URLs are fetched")
    if "@" in parts.netloc:
        raise Refused(f"fetch: {url[:200]!r} carries a user name or password")
    if why := literal_host_refused(host):
        raise Refused(f"fetch: {url[:200]!r}: {why}")
    for prefix in config["origins"]:
        if url == prefix or (prefix.endswith("/") and url.startswith(prefix)):
            return url
    secret = parts.path.split("/")[1] if parts.path.count("/") >= 2 else ""
    if host.lower() in (p.lower() for p in config["peers"]):
        if parts.scheme != "http" or port is None or parts.query or parts.fragment:
            raise Refused(f"fetch: {url[:200]!r}: a peer is asked at http://<peer>:<port>/<secret>/<name>")
        if not SECRET.fullmatch(secret):
            raise Refused(f"fetch: {url[:200]!r}: a peer's URL carries a secret of 32 to 256 characters")
        return url
    raise Refused(
        f"fetch: {url[:200]!r} is neither an origin of this cluster's models nor a peer of this "
        "node's fabric (run llmgw apply after changing the cluster file or HF_ENDPOINT)"
    )


def check_job_bounds(job: dict[str, Any], config: dict[str, list[str]]) -> None:
    """What a fetch job may reach, from the config: every URL it downloads (``check_url``),
    and for a server, its address (this node's own, ``addresses``) and secret."""
    mode = job.get("mode")
    if mode == "fetch":
        check_url(job.get("url"), config)
    elif mode == "snapshot":
        files = job.get("files")
        if not isinstance(files, list):
            raise Refused("fetch: a snapshot job's files are a list")
        for entry in files:
            check_url(entry.get("url") if isinstance(entry, dict) else None, config)
    elif mode in ("serve", "serve-snapshot"):
        if job.get("bind") not in config["addresses"]:
            raise Refused(
                f"fetch: {mode} listens on this node's own address ({', '.join(config['addresses'])}) only"
            )
        secret = job.get("secret")
        if not isinstance(secret, str) or not SECRET.fullmatch(secret):
            raise Refused(f"fetch: {mode} needs a secret of 32 to 256 characters of A-Z a-z 0-9 _ -")


def _fetch(job: dict[str, Any], config: dict[str, list[str]]) -> int:
    mode = job.get("mode")
    if not isinstance(mode, str) or mode not in FETCH_MODES:
        raise Refused(f"fetch mode {mode!r} is not one of {', '.join(FETCH_MODES)}")
    where = str(job.get(FETCH_MODES[mode], ""))
    if FETCH_MODES[mode] == "folder":
        _repo_folder_under_weights(where, config)
    else:
        _under_weights(where, config)
    check_job_bounds(job, config)
    namespace: dict[str, Any] = {"__name__": "llmgw_nodefetch"}
    # The root-owned copy apply installed, run in this process as ``python3 -`` would.
    with open(NODEFETCH, encoding="utf-8") as fh:
        exec(compile(fh.read(), NODEFETCH, "exec"), namespace)
    namespace["main"](job)
    return 0


def parse_words(argv: list[str], original: str | None) -> list[str]:
    """The verb and its arguments: from argv (apply, and the sudo re-run), else from the
    SSH command line (the forced command), where a leading helper path is dropped."""
    if argv:
        return argv
    if not original:
        raise Refused("no command given")
    try:
        words = shlex.split(original)
    except ValueError as exc:
        raise Refused(f"cannot split the command: {exc}") from None
    if words and words[0] == HELPER:
        words = words[1:]
    if not words:
        raise Refused("no command given")
    return words


def check_words(words: list[str]) -> None:
    """Everything that can be checked without root: the verb and the shape of its arguments."""
    verb, args = words[0], words[1:]
    if verb in ("probe", "kernel-xids", "date", "daemon-reload", "fetch"):
        if args:
            raise Refused(f"{verb} takes no arguments")
    elif verb == "show":
        if not args:
            raise Refused("show needs at least one unit")
        for a in args:
            check_unit_name(a, replica=False)
    elif verb == "journal":
        if len(args) != 3:
            raise Refused("journal takes UNIT SINCE LINES")
        check_unit_name(args[0], replica=False)
        if not (args[1] == "-" or args[1].isdigit()) or not args[2].isdigit():
            raise Refused("journal: SINCE is epoch seconds or '-', LINES a number")
        if not 1 <= int(args[2]) <= MAX_JOURNAL_LINES:
            raise Refused(f"journal: LINES must be 1 to {MAX_JOURNAL_LINES}")
    elif verb in ("stop", "start", "restart", "remove"):
        if not args:
            raise Refused(f"{verb} needs at least one unit")
        for a in args:
            check_unit_name(a)
    elif verb == "write-unit":
        if len(args) != 1:
            raise Refused("write-unit takes one unit name (the text on stdin)")
        check_unit_name(args[0])
    elif verb == "drain-mark":
        if len(args) != 2:
            raise Refused("drain-mark takes UNIT SECONDS")
        check_unit_name(args[0])
        if not DRAIN_SECONDS.fullmatch(args[1]) or float(args[1]) > MAX_DRAIN_SECONDS:
            raise Refused(f"drain-mark: SECONDS is a number of seconds up to {MAX_DRAIN_SECONDS}")
    elif verb == "drain-clear":
        if not args:
            raise Refused("drain-clear needs at least one unit")
        for a in args:
            check_unit_name(a)
    elif verb == "held":
        if not args or not all(a.startswith("/") for a in args):
            raise Refused("held takes absolute paths")
    elif verb == "exists":
        if not 1 <= len(args) <= MAX_PATHS:
            raise Refused(f"exists takes 1 to {MAX_PATHS} paths")
        for a in args:  # a bare name: an engine program systemd looks up on its search path
            if not (plain_path(a) or PROGRAM_NAME.fullmatch(a)):
                raise Refused(f"exists: {a[:200]!r} is not a plain absolute path (nor a program name)")
    else:
        raise Refused(f"{verb!r} is not a node-helper verb")


def unit_matches(unit: str) -> list[str]:
    """journalctl matches for a unit's lines: its processes' (``_SYSTEMD_UNIT``) or lines
    about it (``UNIT``). Not ``-u``: that takes ``UNIT`` only from PID 1, and the line
    systemd's forked child logs when it cannot execute the engine ("Failed to execute
    ...: No such file or directory") carries ``UNIT`` but comes from the child, which is
    often gone before journald can read its cgroup for ``_SYSTEMD_UNIT``."""
    return [f"_SYSTEMD_UNIT={unit}", "+", f"UNIT={unit}"]


def run_verb(words: list[str], config: dict[str, list[str]]) -> int:
    verb, args = words[0], words[1:]
    if verb == "probe":
        return subprocess.call(["sh", PROBE])
    if verb == "kernel-xids":
        return subprocess.call(["sh", "-c", XIDS_READ])
    if verb == "date":
        print(int(time.time()))
        return 0
    if verb == "show":
        return _systemctl("show", "-p", SHOW_PROPERTIES, *args)
    if verb == "journal":
        # journald takes messages asynchronously: the line systemd logs for a start that
        # failed can still be on its way when the job's failure is reported. --sync
        # returns once everything sent before it is stored, so the tail below holds it.
        subprocess.call(["journalctl", "--sync"], stderr=subprocess.DEVNULL)
        since = ["--since", f"@{args[1]}"] if args[1] != "-" else []
        cmd = ["journalctl", *unit_matches(args[0]), *since, "-n", args[2], "--no-pager", "-o", "cat"]
        return subprocess.call(cmd)
    if verb == "stop":
        return _systemctl("stop", *args)
    if verb == "start":
        return _systemctl("enable", "--now", *args)
    if verb == "restart":
        return _systemctl("restart", *args)
    if verb == "remove":
        subprocess.call(["systemctl", "disable", *args], stderr=subprocess.DEVNULL)
        for a in args:
            for path in (os.path.join(UNIT_DIR, a), os.path.join(DRAIN_DIR, a)):
                if os.path.lexists(path):
                    os.unlink(path)
        return 0
    if verb == "write-unit":
        text = sys.stdin.read(MAX_UNIT_BYTES + 1)
        check_unit(text, config, args[0])
        _write_unit(args[0], text)
        return 0
    if verb == "drain-mark":
        print(f"{drain_mark(args[0], args[1]):.3f}")
        return 0
    if verb == "drain-clear":
        drain_clear(args)
        return 0
    if verb == "daemon-reload":
        return _systemctl("daemon-reload")
    if verb == "fetch":
        try:
            job = json.loads(sys.stdin.read(1 << 20))
        except ValueError as exc:
            raise Refused(f"fetch: the job is not JSON: {exc}") from None
        if not isinstance(job, dict):
            raise Refused("fetch: the job is not a JSON object")
        return _fetch(job, config)
    if verb == "held":
        for a in args:
            path = _under_weights(a, config)
            if os.path.isfile(path) and os.path.getsize(path) > 0:
                print(path)
        return 0
    if verb == "exists":
        paths = [_may_ask(a, config) for a in args]  # all, before any is looked at
        print(json.dumps(exists_answer(paths, config), sort_keys=True))
        return 0
    raise Refused(f"{verb!r} is not a node-helper verb")


def main(argv: list[str]) -> int:
    os.environ["PATH"] = PATH
    try:
        words = parse_words(argv, os.environ.get("SSH_ORIGINAL_COMMAND"))
        check_words(words)
        if os.geteuid() != 0 and words[0] != "probe":  # kernel-xids too: it reads root's log
            sys.stdout.flush()
            os.execv(SUDO, ["sudo", "-n", HELPER, *words])
        needs = ("write-unit", "fetch", "held", "exists")
        config = load_config() if words[0] in needs else {}
        return run_verb(words, config)
    except Refused as exc:
        print(f"node-helper: refused: {exc}", file=sys.stderr)
        return 2


PIPED_VERBS = ("exists",)


def piped(words: list[str], config_text: str) -> int:
    """``apply``'s way to a verb that only reads, as root: this file's code, piped to
    ``python3 -I -``, with the config ``apply`` is about to write in place of the file
    (which may be missing or older). The same checks as ``main``; no sudo (already root)."""
    try:
        if not words or words[0] not in PIPED_VERBS:
            raise Refused(f"only {', '.join(PIPED_VERBS)} may be piped")
        check_words(words)
        try:
            data = json.loads(config_text)
        except ValueError as exc:
            raise Refused(f"the piped config is not JSON: {exc}") from None
        return run_verb(words, config_from(data, "the piped config"))
    except Refused as exc:
        print(f"node-helper: refused: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
