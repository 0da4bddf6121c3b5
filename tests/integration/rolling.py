"""A lab rig for rolling changes: a cluster file of chosen lab nodes and models, `apply`,
the real gateway on this machine in front of them, and a look at the nodes' units.

Used by tests/integration/test_rolling_lab.py and bench/rolling.py. The gateway runs
with the cluster file's state folder (its routes files are where `apply` reads them:
the lab's gateway host is this machine) and probes at its default discovery interval:
what makes it see a new replica, or drop a draining one, within a second is `apply`'s
signal, not a short interval. The cluster file is rewritten in place for a change
(``write``); the gateway keeps the one it read (nothing it routes by changes).
"""

from __future__ import annotations

import re
import shlex
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from llmgw_cli.cli.common import read_cluster
from llmgw_cli.core.engine.engines import spec_hash
from tests.gateway.harness import free_port, start_gateway, stop
from tests.waiting import wait_until

from .conftest import Lab
from .lab_helpers import admin_replicas, reset, run
from .load import running_load

SOURCE = "/data/models/Mistral-7B-Instruct-v0.3"


def model(
    name: str, *, tp: int = 1, replicas: int = 1, tokens_per_second: float = 8, **extra: Any
) -> dict[str, Any]:
    """An always-on model of the simulated vLLM (``replicas`` of ``tp`` cards each); its
    16-token reply streams at ``tokens_per_second`` (8: about 2 s)."""
    return {
        "name": name,
        "source": SOURCE,
        "profile": "vllm",
        "tensor_parallel": tp,
        "env": {"LLMGW_LAB_TOKENS_PER_SECOND": f"{tokens_per_second:g}"},
        "scaling": {"min": replicas, "max": replicas},
        **extra,
    }


@dataclass(frozen=True)
class Unit:
    """One replica unit on a node, as its file and systemd say."""

    node: str
    name: str
    replica: int
    port: int
    spec_hash: str
    active: str
    pid: int


@dataclass
class Rig:
    lab: Lab
    folder: Path
    nodes: tuple[str, ...]
    cluster: Path
    port: int
    admin_port: int
    key: str
    admin: str
    log: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    applies: list[str] = field(default_factory=list)  # every apply's output, for a failure

    # --- the cluster file and apply -----------------------------------------------------

    def write(self, models: list[dict[str, Any]]) -> None:
        data = yaml.safe_load(self.lab.cluster_file.read_text())
        data["nodes"] = [n for n in data["nodes"] if n["name"] in self.nodes]
        data["gateway"].update(
            listen=f"127.0.0.1:{self.port}",
            admin_listen=f"127.0.0.1:{self.admin_port}",
            metrics_listen=f"127.0.0.1:{free_port()}",
            state_dir=str(self.folder / "state"),
        )
        data["models"] = models
        self.cluster.write_text(yaml.safe_dump(data, sort_keys=False))

    def apply(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """`llmgw apply -f cluster *args`; its output is kept for ``applied``."""
        done = run("apply", "-f", str(self.cluster), *args, timeout=timeout)
        self.applies.append(
            f"$ llmgw apply {' '.join(args)} -> {done.returncode}\n{done.stdout}{done.stderr}"
        )
        return done

    def applied(self) -> str:
        return "\n".join(self.applies)

    def expected_hash(self, name: str) -> str:
        spec = read_cluster(self.cluster)
        return spec_hash(spec, next(m for m in spec.models if m.name == name))

    # --- the nodes ----------------------------------------------------------------------

    def units(self, name: str) -> list[Unit]:
        """The model's replica units on the rig's nodes (installed, whatever their state)."""
        script = (
            f'for f in /etc/systemd/system/llmgw-{shlex.quote(name)}-*.service; do [ -e "$f" ] || continue; '
            'u=${f##*/}; echo "$u'
            " $(sed -n 's/^X-Llmgw-Replica=//p' \"$f\")"
            " $(sed -n 's/^X-Llmgw-Port=//p' \"$f\") $(sed -n 's/^X-Llmgw-Spec-Hash=//p' \"$f\")"
            ' $(systemctl show -p ActiveState --value "$u") $(systemctl show -p MainPID --value "$u")"; done'
        )
        found = []
        for node in self.nodes:
            done = self.lab.ssh(node, script, timeout=20)
            assert done.returncode == 0, done.stderr
            for line in done.stdout.splitlines():
                unit, replica, port, digest, active, pid = line.split()
                found.append(Unit(node, unit, int(replica), int(port), digest, active, int(pid)))
        return sorted(found, key=lambda u: (u.replica, u.node))

    def started_at(self, unit: Unit) -> float:
        """When its engine process started (wall clock, the node's: the lab shares this
        machine's)."""
        done = self.lab.ssh(
            unit.node, f"systemctl show --timestamp=unix -p ExecMainStartTimestamp --value {unit.name}"
        )
        assert done.returncode == 0 and done.stdout.startswith("@"), done
        return float(done.stdout.strip()[1:])

    def address(self, unit: Unit) -> str:
        return f"{next(n.ip for n in self.lab.nodes if n.name == unit.node)}:{unit.port}"

    # --- the gateway --------------------------------------------------------------------

    def start_gateway(self) -> None:
        options = ["--engine-keys-file", str(self.folder / "state/engine-keys.json")]
        options += ["--identity-file", str(self.folder / "state/ssh-key")]
        options += ["--health-every", "0.5", "--flush-every", "0.5"]
        self.procs.append(start_gateway(self.cluster, self.log, *options, port=self.port))

    def ready(self, name: str) -> list[str]:
        """Addresses of the model's replicas in the gateway's rotation."""
        replicas = admin_replicas(self.admin_port, self.admin, name)
        return sorted(r["address"] for r in replicas if r["health"] == "ready")

    def wait_routed(self, name: str, units: list[Unit], timeout: float = 60) -> None:
        """Until the gateway routes exactly these units of the model."""
        want = sorted(self.address(u) for u in units)
        wait_until(
            lambda: self.ready(name) == want,
            timeout=timeout,
            interval=0.5,
            what=lambda: f"the gateway to route {want} for {name}\n{self.tail()}",
        )

    def load(self, name: str, *, concurrency: int, **options: Any) -> Any:
        """``running_load`` through this gateway (a context manager giving a ``Load``)."""
        return running_load(
            f"http://127.0.0.1:{self.port}/v1", self.key, name, concurrency=concurrency, **options
        )

    def log_text(self, since: int = 0) -> str:
        return self.log.read_text(errors="replace")[since:]

    def tail(self, lines: int = 40) -> str:
        kept = [x for x in self.log_text().splitlines() if not x.startswith(("[conn=", "{"))]
        return "gateway log:\n" + "\n".join(kept[-lines:])

    def stop_gateway(self) -> None:
        while self.procs:
            stop(self.procs.pop())


@contextmanager
def rig(lab: Lab, folder: Path, nodes: tuple[str, ...], models: list[dict[str, Any]]) -> Iterator[Rig]:
    """A clean lab, `apply` of ``models`` on ``nodes``, API keys, the gateway routing every
    replica; the lab cleaned after."""
    reset(lab)
    folder.mkdir(parents=True, exist_ok=True)
    port, admin_port = free_port(), free_port()
    cluster = folder / "cluster.yaml"
    made = Rig(lab, folder, nodes, cluster, port, admin_port, "", "", folder / "gateway.log")
    made.write(models)
    try:
        applied = made.apply("--yes")
        assert applied.returncode == 0, made.applied()
        made.key = run("keys", "create", "--name", "load", "-f", str(cluster)).stdout.strip()
        made.admin = run("keys", "create", "--name", "ops", "--admin", "-f", str(cluster)).stdout.strip()
        made.start_gateway()
        for m in models:
            made.wait_routed(m["name"], made.units(m["name"]))
        yield made
    finally:
        made.stop_gateway()
        reset(lab)


IN_FLIGHT = re.compile(r"drain bound \(([\d.]+)s\) with (\d+) requests? in flight")


def cut_at_bound(output: str) -> list[tuple[float, int]]:
    """What apply said of replicas stopped at their drain bound: (bound, requests cut)."""
    return [(float(b), int(n)) for b, n in IN_FLIGHT.findall(output)]
