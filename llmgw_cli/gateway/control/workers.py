"""Several gateway processes on one host: the supervisor of ``llmgw gateway run`` with
``gateway.workers`` (or ``--workers``) above one.

One Python process serves on one core. With N workers the process started (by hand or by
systemd) is a small supervisor that serves nothing itself; it starts N workers, each the
same command line with ``--worker I`` added: a whole gateway with its own event loop,
keys, meter, controller and routes file (``<state_dir>/routes/<pid>.json``). The CLI
execs the supervisor's lean entry (gateway/supervisor.py), which imports this module and
the standard library alone: nothing here may import the serving stack (aiohttp,
pydantic, prometheus_client...), or the supervisor would hold it for nothing.

Listeners:

- started by hand, each worker binds the public listener itself with ``SO_REUSEPORT``:
  the kernel spreads new connections over the workers. A connection still waiting in the
  accept queue of a worker that dies is reset with it (one per listener at most, in
  practice: the workers accept at once);
- started by systemd (``LISTEN_FDS`` from ``llmgw-gateway.socket``), the supervisor
  passes the inherited sockets to every worker as fds 3, 4, ... and sets ``LISTEN_PID``
  to the worker's own pid in the child before it execs: all of them accept from the same
  kernel sockets, as the hand-over instance does during an upgrade;
- the admin and metrics listeners are served by worker 0 only: a scrape or a dashboard
  that landed on a different process each time would see its figures jump back and
  forth. ``/metrics`` still counts every worker's requests: the supervisor gives its
  workers a folder (``$PROMETHEUS_MULTIPROC_DIR``, ``<state_dir>/metrics/<its pid>``)
  where each keeps its counters and histograms in files, which worker 0 sums when
  scraped (a dead worker's counts stay in the sums: counters never go back). What is
  read at scrape time (requests in flight, queued) and the admin pages (the last hour
  of use, the controller's actions) are worker 0's own. A restarted worker 0 takes
  these listeners again.

Readiness: the workers' ``$NOTIFY_SOCKET`` is the supervisor's own datagram socket (an
abstract name; a datagram is believed only from a worker's pid, read from the kernel's
credentials). Once every worker said ``READY=1`` the supervisor says ``READY=1`` to
systemd (``NotifyAccess=main``: only it may), and ``STOPPING=1`` when asked to stop.

Signals: SIGTERM and SIGINT are passed to every worker (each drains, writes its usage and
exits) and the supervisor exits once all have; SIGHUP (reload the cluster file) and
SIGUSR1 (probe the nodes now) are passed on. A worker that exits on its own is started
again after a back-off (1 s, doubling up to 30 s; back to 1 s once a worker served for
a minute). A worker that exits before the first ``READY=1`` of all of them is a
configuration the others will not serve either: the supervisor stops the rest and
fails. Each worker gets SIGTERM when the supervisor dies (``PR_SET_PDEATHSIG``): no
worker outlives it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from llmgw_cli.gateway.control import systemd

log = logging.getLogger("llmgw.gateway.workers")

MAX_DEFAULT = 8  # workers when `gateway.workers` is unset: one per core, at most this many
FIRST_DELAY = 1.0  # seconds before a dead worker is started again, doubled per quick death
MAX_DELAY = 30.0
STEADY = 60.0  # a worker that served this long before dying starts again after FIRST_DELAY
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
PR_SET_PDEATHSIG = 1
METRICS_DIR_NAME = "metrics"  # in state_dir: a folder per supervisor, a file per worker in it
# Set for the workers (gateway/serving/metrics.py reads it): prometheus_client then keeps
# every counter and histogram in a file per process there (read when it is imported, so
# only ever in a fresh worker process), and a scrape sums the files of every worker.
# Defined here, not there: the supervisor imports neither prometheus_client nor metrics.py.
MULTIPROC_VAR = "PROMETHEUS_MULTIPROC_DIR"


def default_count() -> int:
    """One worker per core this process may run on, at most ``MAX_DEFAULT``."""
    return max(1, min(len(os.sched_getaffinity(0)), MAX_DEFAULT))


def listen_fds(environ: MutableMapping[str, str] | None = None, pid: int | None = None) -> int:
    """How many sockets systemd passed to this process (fds 3, 4, ...): 0 when none, or
    when they are another process's. ``LISTEN_*`` are removed from the environment."""
    env = os.environ if environ is None else environ
    values = {name: env.pop(name, None) for name in systemd.LISTEN_VARS}
    try:
        if int(values["LISTEN_PID"] or "") != (os.getpid() if pid is None else pid):
            return 0
        return max(0, int(values["LISTEN_FDS"] or ""))
    except ValueError:
        return 0


@dataclass
class Worker:
    index: int
    proc: subprocess.Popen[bytes] | None = None
    ready: bool = False
    started: float = 0.0  # monotonic
    delay: float = FIRST_DELAY  # before the next start after a death
    due: float | None = None  # monotonic time of a pending restart


class Supervisor:
    """Runs ``count`` workers (``argv`` + ``--worker I``) until SIGTERM or SIGINT."""

    def __init__(
        self,
        argv: list[str],
        count: int,
        metrics_dir: Path | None = None,
        environ: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.argv = argv
        self.metrics_dir = metrics_dir
        self.workers = [Worker(i) for i in range(count)]
        env = dict(os.environ if environ is None else environ)
        names = env.get("LISTEN_FDNAMES")
        self.fds = listen_fds(env)  # inherited from systemd: passed to every worker
        self.fdnames = names if self.fds else None
        self.systemd_notify = env.pop("NOTIFY_SOCKET", None)
        self.env = env
        self.clock = clock
        self.stopping = False
        self.all_ready = False
        self.pending: list[int] = []  # signals received, handled by the loop
        self._libc: ctypes.CDLL | None = None
        self._notify: socket.socket | None = None
        self._notify_name = f"@llmgw-workers-{os.getpid()}-{secrets.token_hex(8)}"

    # --- the child, between fork and exec --------------------------------------------

    def _child_setup(self, env: dict[str, str]) -> Callable[[], None]:
        """What the child does before it execs: die with the supervisor, and take ``env``
        with LISTEN_PID its own pid (known only now)."""
        parent = os.getpid()
        libc = self._libc
        fds = self.fds

        def setup() -> None:
            if libc is not None:
                libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
            if os.getppid() != parent:  # the supervisor died before prctl took effect
                os._exit(1)
            # exec without an explicit environment takes this (the child's) one
            os.environ.clear()
            os.environ.update(env)
            if fds:
                os.environ["LISTEN_PID"] = str(os.getpid())

        return setup

    def _start(self, worker: Worker) -> None:
        env = {**self.env, "NOTIFY_SOCKET": self._notify_name}
        if self.metrics_dir is not None:
            env[MULTIPROC_VAR] = str(self.metrics_dir)
        if self.fds:
            env["LISTEN_FDS"] = str(self.fds)
            if self.fdnames is not None:
                env["LISTEN_FDNAMES"] = self.fdnames
        worker.proc = subprocess.Popen(
            [*self.argv, "--worker", str(worker.index)],
            pass_fds=range(systemd.LISTEN_FDS_START, systemd.LISTEN_FDS_START + self.fds),
            preexec_fn=self._child_setup(env),  # noqa: PLW1509 (the supervisor runs no thread)
        )
        worker.ready = False
        worker.started = self.clock()
        worker.due = None
        log.info("worker %d started (pid %d)", worker.index, worker.proc.pid)

    # --- signals and notifications ---------------------------------------------------

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.pending.append(signum)

    def _forward(self, signum: int) -> None:
        for worker in self.workers:
            if worker.proc is not None and worker.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.proc.send_signal(signum)

    def _read_notifications(self) -> None:
        assert self._notify is not None
        pids = {w.proc.pid: w for w in self.workers if w.proc is not None}
        while True:
            try:
                data, ancdata, _flags, _addr = self._notify.recvmsg(
                    4096, socket.CMSG_SPACE(3 * 4), socket.MSG_DONTWAIT
                )
            except BlockingIOError:
                return
            sender = None
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(payload) >= 4:
                    sender = int.from_bytes(payload[:4], sys.byteorder)
            worker = pids.get(sender) if sender is not None else None
            if worker is None:
                continue  # not one of ours: ignored
            if b"READY=1" in data.split(b"\n") and not worker.ready:
                worker.ready = True
                log.info("worker %d ready", worker.index)

    def _notify_systemd(self, state: str) -> None:
        if self.systemd_notify:
            systemd.notify(state, {"NOTIFY_SOCKET": self.systemd_notify})

    # --- the loop --------------------------------------------------------------------

    def run(self) -> int:
        """Start the workers and supervise them; the exit status for the process."""
        try:
            self._libc = ctypes.CDLL(None, use_errno=True)
        except OSError:
            self._libc = None
        if self.metrics_dir is not None:
            self.metrics_dir.mkdir(mode=0o700, parents=True)
        self._notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._notify.bind("\0" + self._notify_name[1:])
        self._notify.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        previous = signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        handlers = {s: signal.signal(s, self._on_signal) for s in (*FORWARDED, signal.SIGCHLD)}
        try:
            log.info(
                "supervising %d gateway workers%s",
                len(self.workers),
                f" on {self.fds} sockets from {systemd.SOCKET_UNIT}" if self.fds else "",
            )
            for worker in self.workers:
                self._start(worker)
            return self._loop(wake_r)
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)
            signal.set_wakeup_fd(previous)
            os.close(wake_r)
            os.close(wake_w)
            self._notify.close()
            for worker in self.workers:  # only after a failure: normally all exited already
                if worker.proc is not None and worker.proc.poll() is None:
                    worker.proc.kill()
                    worker.proc.wait()
            if self.metrics_dir is not None:
                shutil.rmtree(self.metrics_dir, ignore_errors=True)

    def _loop(self, wake: int) -> int:
        assert self._notify is not None
        failed = 0
        while True:
            now = self.clock()
            dues = [w.due for w in self.workers if w.due is not None]
            timeout = max(0.0, min(dues) - now) if dues else 1.0
            try:
                readable, _, _ = select.select([self._notify.fileno(), wake], [], [], min(timeout, 1.0))
            except InterruptedError:
                readable = []
            if wake in readable:
                try:
                    while os.read(wake, 512):
                        pass
                except BlockingIOError:
                    pass
            if self._notify.fileno() in readable:
                self._read_notifications()
            pending, self.pending = self.pending, []
            for signum in pending:
                if signum == signal.SIGCHLD:
                    continue
                if signum in (signal.SIGTERM, signal.SIGINT) and not self.stopping:
                    self.stopping = True
                    log.info("stopping: %s passed to every worker", signal.Signals(signum).name)
                    self._notify_systemd("STOPPING=1")
                    for worker in self.workers:
                        worker.due = None
                self._forward(signum)
            failed = max(failed, self._reap())
            if failed and not self.all_ready and not self.stopping:
                log.error("a worker failed before every worker was ready: stopping the others")
                self.stopping = True
                self._forward(signal.SIGTERM)
            if self.stopping:
                if all(w.proc is None for w in self.workers):
                    return 1 if failed else 0
                continue
            if not self.all_ready and all(w.ready for w in self.workers):
                self.all_ready = True
                log.info("all %d workers ready", len(self.workers))
                self._notify_systemd("READY=1")
            now = self.clock()
            for worker in self.workers:
                if worker.due is not None and now >= worker.due:
                    self._start(worker)

    def _reap(self) -> int:
        """Collect the workers that exited; a restart is scheduled for each (unless
        stopping). The worst exit status seen (0 when all were clean)."""
        worst = 0
        for worker in self.workers:
            proc = worker.proc
            if proc is None:
                continue
            try:
                code = proc.poll()
            except ChildProcessError:  # pragma: no cover (reaped elsewhere)
                code = -1
            if code is None:
                continue
            worker.proc = None
            worker.ready = False
            if self.stopping:
                log.info("worker %d exited (%s)", worker.index, _status(code))
                # killed by the signal passed on (it came before its handler was set): clean
                clean = code in (0, -signal.SIGTERM, -signal.SIGINT)
                worst = max(worst, 0 if clean else 1)
                continue
            if not self.all_ready:
                log.error("worker %d exited (%s) before it was ready", worker.index, _status(code))
                worst = 1
                continue
            lived = self.clock() - worker.started
            if lived >= STEADY:
                worker.delay = FIRST_DELAY
            worker.due = self.clock() + worker.delay
            log.warning(
                "worker %d exited (%s) after %.0fs: starting it again in %gs",
                worker.index,
                _status(code),
                lived,
                worker.delay,
            )
            worker.delay = min(worker.delay * 2, MAX_DELAY)
        return worst


def _status(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"status {code}"


def metrics_dir(state_dir: str) -> Path:
    """This supervisor's folder for its workers' metric files,
    ``<state_dir>/metrics/<pid>``, after removing those of supervisors that are gone
    (a SIGKILL leaves its folder behind)."""
    parent = Path(state_dir) / METRICS_DIR_NAME
    parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    for entry in parent.iterdir():
        if entry.name.isdigit() and entry.is_dir() and not entry.is_symlink() and not alive(int(entry.name)):
            shutil.rmtree(entry, ignore_errors=True)
    own = parent / str(os.getpid())
    shutil.rmtree(own, ignore_errors=True)  # a folder of a process that had this pid before
    return own


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (another account's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another account's process
    return True


def supervise(argv: list[str], count: int, state_dir: str) -> int:
    """``Supervisor(argv, count).run()``, the exit status; an error starting a worker
    (the program cannot be executed) is the supervisor's own."""
    try:
        return Supervisor(argv, count, metrics_dir(state_dir)).run()
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.EACCES):
            log.error("cannot start a gateway worker: %s", exc)
            return 1
        raise
