"""A stand-in for Ray's CLI on lab nodes, enough for vLLM's Ray multi-node layout.

- ``ray start --head --port P [--node-ip-address A]``: starts a "GCS" in the background
  (a TCP listener on A:P, every interface without A, detached like Ray's daemons, so it
  lives in the unit's cgroup until the unit stops) and returns once it listens.
- ``ray start --address HOST:P --block``: joins the head (retrying while it starts),
  then blocks until SIGTERM, as a worker node does.
- ``ray stop``: nothing to do here (the unit's cgroup is killed on stop).

Standard library only; the lab's wrapper ``/opt/vllm/bin/ray`` runs it.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time


def _serve(host: str, port: int) -> None:
    server = socket.create_server((host, port), reuse_port=False)
    while True:
        conn, _ = server.accept()
        conn.sendall(b"ray-sim-gcs\n")
        conn.close()


def _head(host: str | None, port: int) -> int:
    if os.fork() == 0:  # detach like Ray's daemons: the unit's main process comes next
        os.setsid()
        _serve(host or "0.0.0.0", port)
    for _ in range(100):
        try:
            socket.create_connection((host or "127.0.0.1", port), timeout=0.2).close()
            print(f"Ray runtime started (simulated GCS on port {port}).", flush=True)
            return 0
        except OSError:
            time.sleep(0.05)
    print(f"ray start --head: GCS did not come up on port {port}", file=sys.stderr)
    return 1


def _worker(address: str, block: bool) -> int:
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            break
        except OSError as exc:
            if time.monotonic() > deadline:
                print(f"ray start: could not reach the head at {address}: {exc}", file=sys.stderr)
                return 1
            time.sleep(0.5)
    print(f"Ray runtime started (joined {address}).", flush=True)
    if block:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        while True:
            time.sleep(3600)
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ray")
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start")
    start.add_argument("--head", action="store_true")
    start.add_argument("--port", type=int, default=6379)
    start.add_argument("--address")
    start.add_argument("--block", action="store_true")
    start.add_argument("--node-ip-address")
    start.add_argument("--disable-usage-stats", action="store_true")
    sub.add_parser("stop")
    args = parser.parse_args(argv)
    if args.command == "stop":
        return 0
    if args.head:
        return _head(args.node_ip_address, args.port)
    if not args.address:
        parser.error("ray start needs --head or --address")
    return _worker(args.address, args.block)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
