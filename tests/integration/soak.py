"""A soak on the lab: streams through the real gateway while replicas' engines are killed.

One always-on model, ``soak``, two replicas (each takes a whole node, so they sit on
node01 and node02), the simulated vLLM at a slow token rate so that a stream lasts about
2 s. The official ``openai`` client streams at a set concurrency for a set time (the
load generator of tests/integration/load.py); every ``kill_every`` seconds one replica's
engine is SIGKILLed (``systemctl kill -s KILL``, the two in turn, or the one that holds
streams in their middle when asked to; systemd restarts it after the unit's RestartSec),
but only once the other replica is in the gateway's rotation again: with none ready
every request would fail.

Each failure is attributed from the gateway's access log (``replica``, ``cut``,
``status``, ``attempts``) and the kill times: what the gateway promises is that no
request fails before its first byte (a request sent to the killed replica is retried on
the other one) and that the only streams cut are those that were running on the
replica killed while they ran. Used by tests/integration/test_soak_lab.py and
bench/soak.py.
"""

from __future__ import annotations

import asyncio
import shlex
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.gateway.harness import start_gateway, stop
from tests.ports import free_port
from tests.waiting import wait_until

from .conftest import Lab
from .lab_helpers import admin_replicas, reset, run
from .load import Load, Request, access_log

MODEL = "soak"
TOKENS_PER_SECOND = 8  # the simulator's 16-token reply: a stream of about 2 s
SLACK = 1.0  # seconds around a kill: the access log's times and the node's are read apart


@dataclass
class SoakGateway:
    cluster: Path
    port: int
    key: str
    admin: str
    admin_port: int
    log: Path
    units: dict[str, tuple[str, str]]  # replica address -> (node, unit)
    halt: Any
    model: str = MODEL

    def ready(self) -> set[str]:
        """Addresses of the soak replicas in the gateway's rotation."""
        replicas = admin_replicas(self.admin_port, self.admin, self.model)
        return {r["address"] for r in replicas if r["health"] == "ready"}


def _cluster(lab: Lab, folder: Path, port: int, admin_port: int) -> Path:
    data = yaml.safe_load(lab.cluster_file.read_text())
    data["nodes"] = [n for n in data["nodes"] if n["name"] in ("node01", "node02")]
    data["gateway"].update(
        listen=f"127.0.0.1:{port}",
        admin_listen=f"127.0.0.1:{admin_port}",
        metrics_listen=f"127.0.0.1:{free_port()}",
        state_dir=str(folder / "state"),
    )
    data["models"] = [
        {
            "name": MODEL,
            "source": "/data/models/Mistral-7B-Instruct-v0.3",
            "profile": "vllm",
            "tensor_parallel": 8,  # a whole node each: the two replicas are on two nodes
            "env": {"LLMGW_LAB_TOKENS_PER_SECOND": str(TOKENS_PER_SECOND)},
            "scaling": {"min": 2, "max": 2},
        }
    ]
    path = folder / "cluster.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@contextmanager
def soak_gateway(lab: Lab, folder: Path) -> Iterator[SoakGateway]:
    """apply (the two replicas), then the gateway on this machine; cleans the lab after."""
    reset(lab)
    port, admin_port = free_port(), free_port()
    cluster = _cluster(lab, folder, port, admin_port)
    applied = run("apply", "-f", str(cluster), "--yes")
    assert applied.returncode == 0, applied.stdout + applied.stderr
    key = run("keys", "create", "--name", "soak", "-f", str(cluster)).stdout.strip()
    admin = run("keys", "create", "--name", "ops", "--admin", "-f", str(cluster)).stdout.strip()
    units: dict[str, tuple[str, str]] = {}
    for node in lab.nodes:
        shown = lab.ssh(node.name, f"grep -h '^X-Llmgw-Port=' /etc/systemd/system/llmgw-{MODEL}-*.service")
        names = lab.ssh(node.name, f"ls /etc/systemd/system/ | grep '^llmgw-{MODEL}-' || true").stdout.split()
        if names:
            (name,) = names
            units[f"{node.ip}:{shown.stdout.strip().split('=')[1]}"] = (node.name, name)
    assert len(units) == 2 and len({n for n, _ in units.values()}) == 2, units
    log = folder / "gateway.log"
    options = ["--engine-keys-file", str(folder / "state/engine-keys.json"), "--health-every", "0.5"]
    options += ["--identity-file", str(folder / "state/ssh-key")]
    proc = start_gateway(cluster, log, *options, port=port)
    try:
        gw = SoakGateway(cluster, port, key, admin, admin_port, log, units, lambda: stop(proc))
        wait_until(lambda: gw.ready() == set(units), timeout=60, interval=0.5, what="both replicas ready")
        yield gw
    finally:
        stop(proc)
        reset(lab)


@dataclass
class Kill:
    at: float  # wall time on the node just before `systemctl kill` (the lab shares this clock)
    done: float  # wall time on the node once `systemctl kill` returned
    address: str
    unit: str
    sought: float = 0.0  # seconds spent looking for a victim that held streams in their middle
    chosen: float = 0.0  # wall time of the victim's choice, here

    @property
    def lag(self) -> float:
        """Seconds from the choice of the victim to the kill's return on its node."""
        return self.done - self.chosen


class ArmedKill:
    """``systemctl kill -s KILL`` of one replica's unit, made ready before it is wanted: an
    SSH session to the unit's node waits for a line on its standard input, then kills.

    A kill is aimed at streams in their middle. An SSH connection opened only once the
    victim was chosen took seconds on a machine whose cores the engines kept busy: the
    streams it was chosen for could end meanwhile and new ones begin on it, and the kill
    then cut only streams that had not had a token yet. Once armed, a kill lands in the
    time of a write to a pipe and one ``systemctl`` on the node."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def arm(cls, lab: Lab, node: str, unit: str) -> ArmedKill:
        # reset-failed first: the soak kills more often than the unit's StartLimitBurst
        # allows in StartLimitIntervalSec, and systemd would give up on it. The node tells
        # when the kill ran (`date`, before and after).
        u = shlex.quote(unit)
        script = (
            f"systemctl reset-failed {u}; echo armed; read -r go || exit 0; "
            f"date +%s.%N; systemctl kill -s KILL {u}; date +%s.%N"
        )
        proc = await asyncio.create_subprocess_exec(
            "ssh", "-F", str(lab.ssh_config), node, script,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=60)
        if line.strip() != b"armed":
            _, err = await asyncio.wait_for(proc.communicate(b""), timeout=60)  # see disarm
            raise AssertionError(f"the kill of {unit} on {node} could not be armed: {err.decode()[-500:]}")
        return cls(proc)

    async def fire(self) -> tuple[float, float]:
        """Kill now: the node's wall times before and after ``systemctl kill``."""
        out, err = await asyncio.wait_for(self.proc.communicate(b"go\n"), timeout=60)
        assert self.proc.returncode == 0, err.decode()[-500:]
        at, landed = (float(x) for x in out.split())
        return at, landed

    async def disarm(self) -> None:
        """Let the session end without killing: its standard input ends (``communicate``
        closes it only when given something to write)."""
        await asyncio.wait_for(self.proc.communicate(b""), timeout=60)


@dataclass
class SoakResult:
    streams: list[Request]  # what the client saw of each request
    kills: list[Kill]
    log: list[dict[str, Any]]  # the gateway's access log lines of the model
    waits: list[float] = field(default_factory=list)  # seconds a kill waited for the other replica

    @property
    def before_first_byte(self) -> list[Request]:
        return [s for s in self.streams if not s.opened]

    @property
    def broken(self) -> list[Request]:
        """Streams the client got a head for but not the whole answer."""
        return [s for s in self.streams if s.opened and not s.complete]

    @property
    def logged_failures(self) -> list[dict[str, Any]]:
        """Lines of requests that failed before their first byte (an error status)."""
        return [x for x in self.log if x["status"] != 200]

    @property
    def cut(self) -> list[dict[str, Any]]:
        return [x for x in self.log if x["cut"]]

    @property
    def retried(self) -> list[dict[str, Any]]:
        return [x for x in self.log if x["attempts"] > 1]

    def killer(self, line: dict[str, Any]) -> Kill | None:
        """The kill of ``line``'s replica while the request ran, if any."""
        end = float(line["ts"])
        start = end - float(line["ms"]) / 1000
        for kill in self.kills:
            if kill.address == line["replica"] and start - SLACK <= kill.at and kill.done <= end + SLACK:
                return kill
        return None

    @property
    def unexplained_cuts(self) -> list[dict[str, Any]]:
        return [x for x in self.cut if self.killer(x) is None]

    def totals(self) -> str:
        on_killed = len(self.cut) - len(self.unexplained_cuts)
        return (
            f"requests {len(self.streams)} (logged {len(self.log)}), kills {len(self.kills)}, "
            f"retried {len(self.retried)}, failed before the first byte {len(self.before_first_byte)} "
            f"(logged {len(self.logged_failures)}), streams cut {len(self.cut)} "
            f"({on_killed} on the replica killed while they ran), broken at the client {len(self.broken)}, "
            f"longest wait for the other replica before a kill {max(self.waits, default=0):.1f}s, "
            f"longest look for a victim {max((k.sought for k in self.kills), default=0):.1f}s, "
            f"longest from its choice to its kill {max((k.lag for k in self.kills), default=0):.2f}s"
        )


def surely_in_middle(held: dict[str, int], chunks: list[int], late: int) -> dict[str, int]:
    """By replica, how many of its streams are surely in their middle: past their first
    token (a role chunk, then content) and at most ``late`` chunks in (one further in could
    end before the kill lands). The gateway says how many streams each replica ``held``;
    the client how many ``chunks`` each of its running streams got, not where it runs. So
    a replica holds at least its streams less every stream not in its middle, and at least
    the streams in their middle less what the other replicas hold."""
    middle = sum(1 for n in chunks if 2 <= n <= late)
    others = len(chunks) - middle
    total = sum(held.values())
    return {address: max(0, n - others, middle - (total - n)) for address, n in held.items()}


def _in_middle_on(gw: SoakGateway, load: Load, late: int) -> dict[str, int]:
    """``surely_in_middle`` now. The gateway is read first, so a stream that starts
    between the two reads is counted as not begun and the figures err low."""
    held = {r["address"]: r["outstanding"] for r in admin_replicas(gw.admin_port, gw.admin, gw.model)}
    return surely_in_middle(held, [r.chunks for r in list(load.requests) if not r.done], late)


async def _pick_victim(
    gw: SoakGateway, load: Load, order: list[str], *, mid_stream: int, late: int, until: float
) -> str | None:
    """The replica to kill: the first of ``order`` that holds ``mid_stream`` streams in
    their middle, looked for until ``until`` (the load's end; then None: no kill). A kill
    is meant to land in the middle of streams; on a busy CPU an engine is slow to begin
    and the gateway's routing keeps a prompt on one replica, so neither the time of a
    kill nor its victim can be fixed in advance. ``mid_stream`` 0: the first of ``order``."""
    if mid_stream <= 0:
        return order[0]
    while time.monotonic() < until:
        found = await asyncio.to_thread(_in_middle_on, gw, load, late)
        for address in order:
            if found.get(address, 0) >= mid_stream:
                return address
        await asyncio.sleep(0.1)
    return None


async def _arm(lab: Lab, gw: SoakGateway, order: list[str]) -> dict[str, ArmedKill]:
    """A kill armed for each replica (those armed are let go if one cannot be)."""
    made = await asyncio.gather(*(ArmedKill.arm(lab, *gw.units[a]) for a in order), return_exceptions=True)
    armed = {a: kill for a, kill in zip(order, made, strict=True) if isinstance(kill, ArmedKill)}
    failed = [x for x in made if isinstance(x, BaseException)]
    if failed:
        await asyncio.gather(*(kill.disarm() for kill in armed.values()))
        raise failed[0]
    return armed


async def _kill_loop(
    lab: Lab,
    gw: SoakGateway,
    load: Load,
    until: float,
    *,
    every: float,
    kills: list[Kill],
    waits: list[float],
    mid_stream: int,
    late: int,
) -> None:
    order = sorted(gw.units)
    turn = 0
    next_at = time.monotonic() + every
    while next_at < until:
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        began = time.monotonic()
        # Killing the last replica in rotation would fail every request: wait for both
        # to be in rotation (the one killed last time is back).
        await asyncio.to_thread(
            wait_until,
            lambda: gw.ready() == set(order),
            timeout=240,  # a real vLLM reloads its weights after its restart
            interval=0.2,
            what="both replicas in rotation before the next kill",
        )
        waits.append(time.monotonic() - began)
        armed = await _arm(lab, gw, order)
        preferred = order[turn % 2 :] + order[: turn % 2]  # the two in turn, when both could be
        looked = time.monotonic()
        try:
            victim = await _pick_victim(gw, load, preferred, mid_stream=mid_stream, late=late, until=until)
            if victim is None:  # the load ended first: a kill now would cut nothing
                return
            sought, chosen = time.monotonic() - looked, time.time()
            at, landed = await armed.pop(victim).fire()
        finally:
            await asyncio.gather(*(kill.disarm() for kill in armed.values()))
        kills.append(Kill(at, landed, victim, gw.units[victim][1], sought, chosen))
        turn += 1
        next_at = max(next_at + every, time.monotonic() + 1)


async def _soak(
    lab: Lab,
    gw: SoakGateway,
    *,
    concurrency: int,
    seconds: float,
    kill_every: float,
    max_tokens: int | None,
    mid_stream: int,
) -> tuple[list[Request], list[Kill], list[float]]:
    load = Load(
        f"http://127.0.0.1:{gw.port}/v1", gw.key, gw.model, concurrency=concurrency, max_tokens=max_tokens
    )
    until = time.monotonic() + seconds
    kills: list[Kill] = []
    waits: list[float] = []
    # a stream more than two thirds through could end before the kill lands
    late = sys.maxsize if max_tokens is None else max_tokens * 2 // 3
    await asyncio.gather(
        _kill_loop(
            lab, gw, load, until, every=kill_every, kills=kills, waits=waits, mid_stream=mid_stream, late=late
        ),
        load.run(until),
    )
    return load.requests, kills, waits


def soak(
    lab: Lab,
    gw: SoakGateway,
    *,
    concurrency: int,
    seconds: float,
    kill_every: float,
    max_tokens: int | None = None,
    mid_stream: int = 0,
) -> SoakResult:
    """Stream at ``concurrency`` for ``seconds``, killing a replica every ``kill_every``
    seconds (with ``mid_stream``, the first replica seen holding that many streams in
    their middle: past their first token, not two thirds through ``max_tokens``; none
    seen before the load ends, no kill); then stop the gateway (its log is complete) and
    read its access log."""
    streams, kills, waits = asyncio.run(
        _soak(
            lab,
            gw,
            concurrency=concurrency,
            seconds=seconds,
            kill_every=kill_every,
            max_tokens=max_tokens,
            mid_stream=mid_stream,
        )
    )
    gw.halt()
    return SoakResult(streams, kills, access_log(gw.log, gw.model), waits)
