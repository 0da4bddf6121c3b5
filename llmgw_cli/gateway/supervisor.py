"""The lean entry of the workers' supervisor (gateway/control/workers.py).

``llmgw gateway run`` with several workers reads and checks the cluster file with the
whole CLI loaded (typer, pydantic, YAML: about 50 MiB), then replaces itself (``exec``,
the same pid, so systemd's ``LISTEN_PID``, ``$NOTIFY_SOCKET`` and ``MAINPID`` still hold)
with a fresh interpreter that runs ``main`` here. That process imports the standard
library and workers.py alone: never the serving stack (aiohttp, pydantic, asyncssh,
prometheus_client, typer, rich), which each worker loads for itself. It holds about
20 MiB where the whole CLI held 92.

The fresh interpreter runs ``python -P -c BOOT ROOT ...``: ``-P`` keeps the current
folder out of ``sys.path`` and ``ROOT`` is the folder this very ``llmgw_cli`` was loaded
from, so the supervisor runs the same code as the command that started it (never a copy
found elsewhere, nor one planted in the working directory).

Its command line (``ps``)::

    python -P -c BOOT ROOT --workers N --state-dir DIR -- WORKER_ARGV...

Each worker runs ``WORKER_ARGV --worker I``: the command line that was started.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import NoReturn

from llmgw_cli.gateway.control.workers import supervise

# sys.argv of `python -c BOOT ROOT ...` is ["-c", ROOT, ...]
BOOT = (
    "import sys; sys.path.insert(0, sys.argv.pop(1)); from llmgw_cli.gateway.supervisor import main; main()"
)


def package_root() -> str:
    """The folder that holds the ``llmgw_cli`` package running now."""
    return str(Path(__file__).resolve().parents[2])


def command(worker_argv: list[str], count: int, state_dir: str) -> list[str]:
    """The supervisor's command line for ``count`` workers running ``worker_argv``."""
    return [
        sys.executable,
        "-P",
        "-c",
        BOOT,
        package_root(),
        "--workers",
        str(count),
        "--state-dir",
        state_dir,
        "--",
        *worker_argv,
    ]


def become_supervisor(worker_argv: list[str], count: int, state_dir: str) -> NoReturn:
    """Replace this process (its pid kept, its inherited file descriptors and environment
    with it) by the lean supervisor of ``count`` workers."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.execv(sys.executable, command(worker_argv, count, state_dir))


def main(argv: list[str] | None = None) -> NoReturn:
    parser = argparse.ArgumentParser(
        prog="llmgw-gateway-supervisor",
        description="Run WORKER_ARGV --worker I for I in 0..N-1 and supervise them "
        "(started by `llmgw gateway run` with several workers; see gateway/control/workers.py).",
    )
    parser.add_argument("--workers", type=int, required=True, help="How many workers.")
    parser.add_argument(
        "--state-dir", required=True, help="gateway.state_dir: the metrics folder goes there."
    )
    parser.add_argument("worker_argv", nargs="+", help="The command line each worker runs, after --.")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")
    sys.exit(supervise(args.worker_argv, args.workers, args.state_dir))
