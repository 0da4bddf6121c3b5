"""Pure parts of running several gateway workers: what the supervisor takes from systemd's
environment, how many workers it runs by default, and the access log's writes that no
other worker's can cut."""

from __future__ import annotations

import io
import json
import os
import select
import subprocess
import sys

from llmgw_cli.gateway.control.workers import MAX_DEFAULT, Supervisor, alive, default_count, listen_fds
from llmgw_cli.gateway.serving.accesslog import LIMIT, AccessLog


def test_the_supervisor_takes_the_count_of_sockets_passed_to_it_only() -> None:
    env = {"LISTEN_PID": "42", "LISTEN_FDS": "3", "LISTEN_FDNAMES": "a:b:c", "PATH": "/bin"}
    assert listen_fds(env, pid=42) == 3
    assert env == {"PATH": "/bin"}  # a worker gets its own LISTEN_* from the supervisor
    assert listen_fds({"LISTEN_PID": "41", "LISTEN_FDS": "3"}, pid=42) == 0
    assert listen_fds({"LISTEN_PID": "42", "LISTEN_FDS": "-1"}, pid=42) == 0
    assert listen_fds({"LISTEN_PID": "x", "LISTEN_FDS": "3"}, pid=42) == 0
    assert listen_fds({}, pid=42) == 0


def test_one_worker_per_core_at_most_eight() -> None:
    assert default_count() == min(len(os.sched_getaffinity(0)), MAX_DEFAULT)


class Writes(io.RawIOBase):
    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, data: object) -> int:
        assert isinstance(data, bytes)
        self.writes.append(data)
        return len(data)


def test_a_workers_access_log_writes_whole_lines_of_at_most_pipe_buf() -> None:
    stream = Writes()
    log = AccessLog(stream, select.PIPE_BUF)  # type: ignore[arg-type]
    records = [{"n": n, "path": "/v1/chat/completions", "pad": "x" * (n % 300)} for n in range(200)]
    records.append({"n": 200, "pad": "y" * 2 * select.PIPE_BUF})  # a line longer than PIPE_BUF: alone
    for record in records:
        log.write(record)
    log.flush()
    assert stream.writes
    for data in stream.writes:
        assert data.endswith(b"\n")
        assert len(data) <= select.PIPE_BUF or data.count(b"\n") == 1
    lines = b"".join(stream.writes).splitlines()
    assert [json.loads(line) for line in lines] == records


def test_one_process_writes_its_batch_at_once() -> None:
    stream = Writes()
    log = AccessLog(stream)  # type: ignore[arg-type]
    for n in range(100):
        log.write({"n": n})
    log.flush()
    assert len(stream.writes) == 1 and stream.writes[0].count(b"\n") == 100
    assert log.chunk == LIMIT


def test_the_supervisor_passes_on_what_systemd_passed_it_and_nothing_else() -> None:
    env = {"LISTEN_PID": str(os.getpid()), "LISTEN_FDS": "3", "LISTEN_FDNAMES": "a:b:c", "HOME": "/h"}
    env["NOTIFY_SOCKET"] = "/run/systemd/notify"
    supervisor = Supervisor(["llmgw"], 2, environ=env)
    assert (supervisor.fds, supervisor.fdnames, supervisor.systemd_notify) == (
        3,
        "a:b:c",
        "/run/systemd/notify",
    )
    assert supervisor.env == {"HOME": "/h"}  # the workers get their own LISTEN_* and NOTIFY_SOCKET
    other = Supervisor(["llmgw"], 2, environ={**env, "LISTEN_PID": "1"})
    assert (other.fds, other.fdnames) == (0, None)


def test_alive_is_true_for_a_running_process_and_false_once_it_is_reaped() -> None:
    """The one check both the metrics folders and the routes files are cleaned up by."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert alive(os.getpid())
    assert not alive(child.pid)
