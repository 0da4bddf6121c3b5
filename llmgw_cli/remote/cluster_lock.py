"""The cluster-wide writer lock: one writer of units at a time, `apply` or the gateway.

Both plan on a probe of their own, so two writers at once could pick the same free cards
or ports. The lock is ``flock(2)`` on ``<gateway.state_dir>/cluster.lock`` on the gateway
host (``core/planning/cluster_lock.py``), held around probe, plan, unit writes and starts; never
during a readiness wait.

- ``FileLock``: the gateway's, in its own process (it runs on that host). A non-blocking
  retry loop on the event loop, never a blocking call; the file is opened without
  following a link and must be a regular file. One holder at a time in the process too.
- ``take_for_apply``: `apply`'s, through each gateway host's transport (SSH, or this
  machine's). A shell there takes the lock and holds it while its stdin is open: closing
  it (``ApplyHold.release``), or apply dying and its channel closing, frees the lock, so a
  killed apply never leaves it held. With several gateway hosts, apply takes the lock of
  every one of them, in sorted order (two applies never hold one each and wait for the
  other's), since the leading gateway may run on any of them and takes its own host's.
- ``LocalLock``: an in-process lock with the same ``hold`` (a gateway without the file,
  tests).

A holder writes one line into the file saying who it is; a waiter says once
"waiting for the cluster lock held by <holder>".
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import getpass
import logging
import os
import socket
import stat
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.hosts.gateway_install import GATEWAY_ACCOUNT
from llmgw_cli.core.planning.cluster_lock import (
    BUSY,
    HELD,
    TIMEOUT,
    hold_script,
    holder_record,
    lock_path,
    shown_holder,
    waiting_message,
)
from llmgw_cli.errors import LlmgwError, LockTimeout, NodeError
from llmgw_cli.progress import quiet
from llmgw_cli.remote.connect import Connections
from llmgw_cli.remote.gateway_install import gateway_transport
from llmgw_cli.remote.transport import Spawned, Spawns

log = logging.getLogger("llmgw.lock")

POLL = 0.1  # seconds between tries of a busy lock in the gateway


class Hold(Protocol):
    """What the gateway's starts and stops take: ``async with lock.hold("starting X")``."""

    def hold(self, why: str) -> AbstractAsyncContextManager[None]: ...


class LocalLock:
    """One holder at a time within this process only."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def hold(self, why: str) -> AsyncIterator[None]:
        async with self._lock:
            yield


def _open(path: Path) -> int:
    """The lock file opened read-write (made 0600 when missing), never through a link,
    never a FIFO or device (opened non-blocking, then checked)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        raise LlmgwError(f"cluster lock {path}: {exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise LlmgwError(f"cluster lock {path}: not a regular file")
    return fd


def _holder(fd: int) -> str:
    try:
        return shown_holder(os.pread(fd, 512, 0).decode("ascii", errors="replace"))
    except OSError:
        return shown_holder("")


class FileLock:
    """``flock(2)`` on ``path`` from this process: the gateway's side of the lock.

    ``who``: this holder, e.g. "gateway pid 4242 on gw1"; ``hold(why)`` writes
    "<who> since <time>: <why>" into the file while held. ``on_wait`` gets the waiting
    message once per hold that has to wait (the log by default)."""

    def __init__(
        self,
        path: str | Path,
        who: str,
        *,
        on_wait: Callable[[str], None] = log.info,
        poll: float = POLL,
    ) -> None:
        self.path = Path(path)
        self.who = who
        self.on_wait = on_wait
        self.poll = poll
        self._local = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def hold(self, why: str) -> AsyncIterator[None]:
        async with self._local:
            fd = _open(self.path)
            try:
                await self._take(fd)
                os.ftruncate(fd, 0)
                os.pwrite(fd, (holder_record(self.who, why, time.time()) + "\n").encode(), 0)
                try:
                    yield
                finally:
                    with contextlib.suppress(OSError):
                        os.ftruncate(fd, 0)
            finally:
                os.close(fd)  # releases the flock

    async def _take(self, fd: int) -> None:
        said = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if not said:
                    self.on_wait(waiting_message(_holder(fd)))
                    said = True
                await asyncio.sleep(self.poll)


def gateway_lock(spec: ClusterSpec) -> FileLock:
    """The lock the gateway takes around its starts and stops, in its state folder."""
    who = f"the gateway (pid {os.getpid()} on {socket.gethostname()})"
    return FileLock(lock_path(spec.gateway.state_dir), who)


def apply_holder() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return f"apply by {user}@{socket.gethostname()} (pid {os.getpid()})"


@dataclass
class ApplyHold:
    """The lock as apply holds it: the shell on each gateway host that holds it there."""

    hosts: list[str]
    procs: list[Spawned]
    released: bool = False

    async def release(self) -> None:
        """Free the locks (once; a second call does nothing), the last taken first."""
        if not self.released:
            self.released = True
            for proc in reversed(self.procs):
                with contextlib.suppress(Exception):
                    await proc.close()


async def _rest(proc: Spawned, first: str, most: int = 10) -> str:
    """What the lock's shell said when it failed: ``first`` and the lines after it."""
    lines = [first]
    while lines[-1] and len(lines) < most:
        try:
            async with asyncio.timeout(5):
                lines.append(await proc.readline())
        except TimeoutError:
            break
    said = [shown_holder(line).removeprefix("error ") for line in lines if line.strip()]
    return "; ".join(said) or "the command ended"


def lock_order(hosts: list[str]) -> list[str]:
    """The order apply takes the gateway hosts' locks in: sorted, the same for every apply."""
    return sorted(set(hosts))


@dataclass(frozen=True)
class LockTerms:
    """How apply takes the cluster lock again for each write step of a rolling
    replacement, as data the executor's steps use themselves: how long each take may
    wait, the holder's note (``why``, the step's own reason appended) and where the
    waiting message goes (a progress sink; the CLI shows it)."""

    wait: float
    why: str
    on_wait: Callable[[str], None] = quiet

    async def take(self, spec: ClusterSpec, conns: Connections, step: str) -> ApplyHold:
        """The lock for one step, ``step`` saying which (``take_for_apply``)."""
        return await take_for_apply(
            spec, conns, wait=self.wait, why=f"{self.why}: {step}", on_wait=self.on_wait
        )


async def take_for_apply(
    spec: ClusterSpec,
    conns: Connections,
    *,
    wait: float,
    why: str,
    on_wait: Callable[[str], None],
) -> ApplyHold:
    """Take the cluster lock on every gateway host (``gateway.all_hosts``, in sorted order)
    for apply, waiting up to ``wait`` seconds in all; ``on_wait`` gets the waiting message
    once for each host where it is held by someone else. ``LockTimeout`` when one stays
    held; ``NodeError`` when a host cannot be reached or the lock cannot be taken there.
    On any failure the locks taken already are released."""
    deadline = time.monotonic() + wait
    held = ApplyHold([], [])
    try:
        for host in lock_order(spec.gateway.all_hosts):
            left = max(0.0, deadline - time.monotonic())
            held.procs.append(await _take_one(spec, conns, host, wait=left, why=why, on_wait=on_wait))
            held.hosts.append(host)
    except BaseException:
        await held.release()
        raise
    return held


async def _take_one(
    spec: ClusterSpec,
    conns: Connections,
    host: str,
    *,
    wait: float,
    why: str,
    on_wait: Callable[[str], None],
) -> Spawned:
    t = gateway_transport(conns, host)
    if not isinstance(t, Spawns):
        raise NodeError(host, "failed", "this connection cannot hold the cluster lock")
    record = holder_record(apply_holder(), why, time.time())
    script = hold_script(
        spec.gateway.state_dir,
        wait,
        record,
        created_owner=GATEWAY_ACCOUNT if spec.gateway.install else None,
    )
    several = len(spec.gateway.all_hosts) > 1
    try:
        proc = await t.spawn(script, root=True)
    except NodeError as exc:
        raise NodeError(host, exc.kind, exc.reason) from None
    try:
        while True:
            try:
                async with asyncio.timeout(wait + spec.ssh.command_timeout):
                    line = await proc.readline()
            except TimeoutError:
                raise LockTimeout(f"the cluster lock on {host} did not answer within {wait:g}s") from None
            word, _, rest = line.strip().partition(" ")
            if word == HELD:
                return proc
            if word == BUSY:
                message = waiting_message(shown_holder(rest))
                on_wait(f"{message} (on {host})" if several else message)
            elif word == TIMEOUT:
                raise LockTimeout(
                    f"the cluster lock on {host} ({lock_path(spec.gateway.state_dir)}) "
                    f"was still held after {wait:g}s"
                )
            else:
                said = await _rest(proc, line)
                raise NodeError(host, "failed", f"cannot take the cluster lock: {said}")
    except BaseException:
        await proc.close()
        raise
