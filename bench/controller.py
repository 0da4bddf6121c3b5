#!/usr/bin/env python3
"""How fast the gateway's model controller reacts, on a 2-node lab, median of several runs:

- node lost: an always-on model (`min: 1`) runs on one node; that node becomes
  unreachable (`llmgw lab fault NODE node unreachable`); the time until the model answers
  again through the gateway (from the other node). Then the node is healed and the time
  until the gateway stops the replaced replica there is noted too.
- failed start: an on-demand model whose engine exits at once (a flag it refuses); the
  time from its unit's failure (the first "Main process exited" of the unit in the
  node's journal) to the gateway's 503 `model_start_failed`, and from the request to it.
  Each run uses its own model (`broken-1`...), so no back-off of an earlier run applies.

Run as root where no lab is up (it boots its own, two nodes, and takes it down); under
the lab lock on a shared machine:

    flock /tmp/llmgw-lab.lock .venv/bin/python bench/controller.py --runs 5

The gateway runs with its defaults (`node_grace` 20s, `--discover-every` 15,
`--health-every` 2) unless `--node-grace` or `--gateway-args` say otherwise; the
simulated engine loads in 2 s.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

# the repository, for the tests' port picker (a port is never handed out twice)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.ports import free_port

STATE = Path("/var/lib/llmgw-bench-lab")
NODES = ("node01", "node02")
SOURCE = "/data/models/Mistral-7B-Instruct-v0.3"
MESSAGES = [{"role": "user", "content": "Say hi."}]


def llmgw(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmgw_cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def must(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def ssh(node: str, command: str) -> str | None:
    """``command``'s output on ``node``; None when ssh itself failed (a node just healed
    may not answer yet: that must not read as "nothing runs there")."""
    done = subprocess.run(
        ["ssh", "-F", str(STATE / "ssh_config"), node, command],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    return done.stdout if done.returncode == 0 else None


def running(node: str, model: str) -> set[str] | None:
    """The model's units that run on ``node``; None when the node could not be asked."""
    pattern = shlex.quote(f"llmgw-{model}-*")
    out = ssh(
        node,
        f"systemctl list-units --plain --no-legend --state=active,activating,reloading {pattern}"
        " | awk '{print $1}'",
    )
    return None if out is None else set(out.split())


def where(model: str) -> list[str] | None:
    """The nodes the model runs on once exactly one does (every node answering)."""
    found = {n: running(n, model) for n in NODES}
    if any(units is None for units in found.values()):
        return None
    nodes = [n for n, units in found.items() if units]
    return nodes if len(nodes) == 1 else None


def wait(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.25) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise SystemExit(f"waited {timeout:g}s for {what}")
        time.sleep(interval)


class Gateway:
    def __init__(self, folder: Path, node_grace: str | None, extra: list[str]) -> None:
        self.folder = folder
        self.port, self.admin_port = free_port(), free_port()
        data = yaml.safe_load((STATE / "cluster.yaml").read_text())
        data["nodes"] = [n for n in data["nodes"] if n["name"] in NODES]
        data["gateway"].update(
            listen=f"127.0.0.1:{self.port}",
            admin_listen=f"127.0.0.1:{self.admin_port}",
            metrics_listen=f"127.0.0.1:{free_port()}",
            state_dir=str(folder / "state"),
        )
        if node_grace:
            data["gateway"]["node_grace"] = node_grace
        self.load_wait = float(str(data["gateway"].get("load_wait", "20s")).rstrip("s"))
        self.models: list[dict[str, Any]] = [
            {"name": "keeper", "source": SOURCE, "profile": "vllm", "scaling": {"min": 1, "max": 1}}
        ]
        self.cluster = folder / "cluster.yaml"
        self.data = data
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None
        self.key = ""

    def add_broken(self, runs: int) -> None:
        self.models += [
            {
                "name": f"broken-{i}",
                "source": SOURCE,
                "profile": "vllm",
                "args": ["--no-such-flag"],
                "scaling": {"min": 0, "max": 1},
            }
            for i in range(1, runs + 1)
        ]

    def start(self) -> None:
        self.data["models"] = self.models
        self.cluster.write_text(yaml.safe_dump(self.data, sort_keys=False))
        print(must(llmgw("apply", "-f", str(self.cluster), "--yes")).strip().splitlines()[-1])
        self.key = must(llmgw("keys", "create", "--name", "bench", "-f", str(self.cluster))).strip()
        argv = [sys.executable, "-m", "llmgw_cli", "gateway", "run", "-f", str(self.cluster)]
        argv += ["--engine-keys-file", str(self.folder / "state/engine-keys.json")]
        argv += ["--identity-file", str(self.folder / "state/ssh-key"), "--no-access-log", *self.extra]
        with (self.folder / "gateway.log").open("ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)

        def up() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait(up, 60, "the gateway to answer /health")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def ask(self, model: str, timeout: float) -> httpx.Response | None:
        try:
            return httpx.post(
                f"http://127.0.0.1:{self.port}/v1/chat/completions",
                json={"model": model, "messages": MESSAGES, "max_tokens": 4},
                headers={"Authorization": f"Bearer {self.key}"},
                timeout=timeout,
            )
        except httpx.HTTPError:
            return None


def node_loss(gw: Gateway, runs: int) -> tuple[list[float], list[float]]:
    recovered: list[float] = []
    stopped: list[float] = []

    def answered() -> bool:
        got = gw.ask("keeper", gw.load_wait + 5)
        return got is not None and got.status_code == 200

    wait(answered, 120, "keeper to answer")
    for run in range(1, runs + 1):
        (lost,) = wait(lambda: where("keeper"), 60, "keeper on exactly one node")
        must(llmgw("lab", "fault", lost, "node", "unreachable", "--state", str(STATE)))
        t0 = time.monotonic()
        try:
            wait(answered, 300, f"keeper to answer again after {lost} was lost")
            recovered.append(time.monotonic() - t0)
        finally:
            must(llmgw("lab", "fault", lost, "node", "reachable", "--state", str(STATE)))
        healed = time.monotonic()
        wait(lambda: running(lost, "keeper") == set(), 300, f"the replaced replica on {lost} to stop")  # noqa: B023
        stopped.append(time.monotonic() - healed)
        print(f"node lost, run {run}: answered again after {recovered[-1]:.1f} s; "
              f"replaced replica stopped {stopped[-1]:.1f} s after {lost} came back", flush=True)  # fmt: skip
    return recovered, stopped


def exit_time(model: str) -> float | None:
    """Wall time of the first exit of the model's replica 0 unit, from the node's journal."""
    unit = f"llmgw-{model}-0.service"
    for node in NODES:
        out = ssh(
            node,
            f"journalctl --sync; journalctl -u {unit} -o short-unix --no-pager | grep -m1 'Main process exited'",
        )
        if out and out.strip():
            return float(out.split()[0])
    return None


def failed_starts(gw: Gateway, runs: int) -> tuple[list[float], list[float]]:
    after_exit: list[float] = []
    after_request: list[float] = []
    for run in range(1, runs + 1):
        model = f"broken-{run}"
        asked, asked_wall = time.monotonic(), time.time()
        answer_wall = 0.0

        def start_failed() -> bool:
            nonlocal answer_wall
            got = gw.ask(model, gw.load_wait + 5)  # noqa: B023
            answer_wall = time.time()
            if got is None or got.status_code != 503:
                return False
            return bool(got.json().get("error", {}).get("code") == "model_start_failed")

        wait(start_failed, 120, f"503 model_start_failed for {model}", interval=0.1)
        after_request.append(time.monotonic() - asked)
        exited = wait(lambda: exit_time(model), 30, f"{model}'s exit in its journal")  # noqa: B023
        after_exit.append(answer_wall - exited)
        print(f"failed start, run {run}: 503 {after_exit[-1]:.2f} s after the unit failed, "
              f"{after_request[-1]:.2f} s after the request (unit failed "
              f"{exited - asked_wall:.2f} s after it)", flush=True)  # fmt: skip
    return after_exit, after_request


def describe(values: list[float]) -> str:
    return f"median {statistics.median(values):.1f} s (min {min(values):.1f}, max {max(values):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--node-grace", help="gateway.node_grace, e.g. 5s (unset: the default)")
    parser.add_argument("--gateway-args", default="", help="more `llmgw gateway run` options, one string")
    parser.add_argument("--skip", choices=("node-loss", "failed-start"), action="append", default=[])
    args = parser.parse_args()
    llmgw("lab", "down", "--state", str(STATE))
    must(llmgw("lab", "up", "--nodes", str(len(NODES)), "--state", str(STATE)))
    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-controller-") as tmp:
        gw = Gateway(Path(tmp), args.node_grace, shlex.split(args.gateway_args))
        gw.add_broken(args.runs)
        try:
            gw.start()
            if "failed-start" not in args.skip:
                results["failed_start_after_unit_failure_s"], results["failed_start_after_request_s"] = (
                    failed_starts(gw, args.runs)
                )
            if "node-loss" not in args.skip:
                results["node_loss_recovery_s"], results["replaced_stopped_after_heal_s"] = node_loss(
                    gw, args.runs
                )
        finally:
            gw.stop()
            llmgw("lab", "down", "--state", str(STATE))
            written = Path(tmp) / "gateway.log"
            log = written.read_text(errors="replace") if written.exists() else ""
            kept = [line for line in log.splitlines() if not line.startswith("[conn=")]
            Path("/tmp/llmgw-bench-controller.log").write_text("\n".join(kept) + "\n")
    for name, values in results.items():
        print(f"{name}: {describe(values)}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
