"""An engine program its unit's account may not run, or its unit's sandbox hides, fails
that node's start before any unit is written, whoever starts it: the gateway asks the
installed node helper (its code, run here as root on a file of this machine), apply pipes
that code itself. The program, the account, the owner and mode in the way and the fix
are named; a program the account may run asks nothing more of the start."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.engine.engine_programs import ProgramCheck, judge, program_checks, unit_programs
from llmgw_cli.core.planning.plan import Action, Plan, UnitFile
from llmgw_cli.remote.connect import Connections
from llmgw_cli.remote.weights import ensure_for_plan
from tests.rendered_units import every_replica_unit
from tests.unit.test_path_source_starts import ensure, gateway

ROOT = Path(__file__).resolve().parents[2]
as_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="becoming the engine's account takes root, as the helper has"
)


@pytest.fixture
def engine() -> Iterator[Path]:
    """An engine program in a folder every account may enter (pytest's own are root's)."""
    folder = Path(tempfile.mkdtemp(dir="/var/lib"))
    folder.chmod(0o755)
    program = folder / "engine"
    program.write_text(f"#!/bin/sh\ntouch {folder}/ran\n")
    program.chmod(0o700)  # root's alone
    yield program
    assert not (folder / "ran").exists()  # looked at, never run
    shutil.rmtree(folder)


def cluster(program: Path, *, local: str = "") -> ClusterSpec:
    node = "address: 127.0.0.1, connection: local" if local else "address: 10.0.0.1"
    return parse_cluster(
        f"cluster: {{name: t}}\nnodes:\n  - {{name: n1, {node}}}\n"
        f"profiles: {{v: {{engine: vllm, user: nobody, command: [{program}, serve]}}}}\n"
        "models:\n  - {name: hub, source: org/engine-downloads, profile: v, fetch: engine}\n"
    )


def unit(program: Path, sandbox: str = "") -> str:
    return (
        "[Unit]\nDescription=x\n\n[Service]\nType=exec\nUser=nobody\n"
        f"{sandbox}ExecStart={program} serve org/engine-downloads --port 8100\n"
    )


def starts(text: str) -> Plan:
    write = (UnitFile(node="n1", name="llmgw-hub-0.service", text=text),)
    action = Action(op="+", model="hub", replica=0, nodes=("n1",), reason="on demand", write=write)
    return Plan(actions=(action,), unplaced=(), warnings=(), facts_digest="")


@as_root
def test_the_gateway_refuses_a_start_whose_account_may_not_run_the_engine(
    engine: Path, tmp_path: Path
) -> None:
    spec = cluster(engine)
    conns = gateway(spec, tmp_path)
    failed, _ = ensure(spec, starts(unit(engine)), conns)
    assert failed == {
        "n1": f"engine of hub on n1: the engine program {engine} cannot be run by nobody, the engine's "
        f"account: {engine} (owner root, mode 0700); let nobody run it (for example `chmod o+rx {engine}`, "
        "or its group), or point the profile's `command` at a program it may run"
    }
    assert conns.nodes["n1"].verbs == ["exists"]  # one question, before any unit is written
    engine.chmod(0o755)
    assert ensure(spec, starts(unit(engine)), conns)[0] == {}
    engine.parent.chmod(0o700)  # the folder it lies in
    failed, _ = ensure(spec, starts(unit(engine)), conns)
    assert f"{engine.parent} (owner root, mode 0700)" in failed["n1"]


@as_root
def test_a_program_the_units_sandbox_hides_is_refused_with_the_directive(
    engine: Path, tmp_path: Path
) -> None:
    engine.chmod(0o755)
    spec = cluster(engine)
    hidden = unit(engine, f"InaccessiblePaths={engine.parent}\n")
    failed, _ = ensure(spec, starts(hidden), gateway(spec, tmp_path))
    assert failed == {
        "n1": f"engine of hub on n1: the engine program {engine} is hidden from its unit by "
        f"InaccessiblePaths={engine.parent}: install the engine where the unit can see it (for example "
        "under /opt) and point the profile's `command` there"
    }


@as_root
def test_apply_as_root_pipes_the_helper_and_refuses_the_same(engine: Path, tmp_path: Path) -> None:
    """The operator's transport on a ``connection: local`` node: no helper installed, no
    config file; the piped helper code answers, bounded by the config apply writes."""
    spec = cluster(engine, local="yes")

    async def go() -> dict[str, str]:
        async with Connections(spec, tmp_path) as conns:
            assert conns.access is None
            return await ensure_for_plan(spec, starts(unit(engine)), conns, lambda *_a: None)

    assert "cannot be run by nobody, the engine's account" in asyncio.run(go())["n1"]
    engine.chmod(0o755)
    assert asyncio.run(go()) == {}


def test_every_program_a_replica_unit_runs_is_checked_as_its_user() -> None:
    spec = parse_cluster((ROOT / "inventories/lab.yaml").read_text())
    seen = set()
    for u in every_replica_unit(spec):
        user, programs = unit_programs(u.text)
        assert user == spec.profiles[spec.model(u.name.removeprefix("llmgw-").rsplit("-", 1)[0]).profile].user
        seen.update(programs)
    assert {"/opt/vllm/bin/vllm", "/opt/sglang/bin/python3", "/usr/local/bin/llama-server"} <= seen
    # the Ray head's ExecStartPre too, each program once
    head = "[Service]\nUser=llmgw\nExecStartPre=/opt/vllm/bin/ray start --head\nExecStart=/opt/vllm/bin/vllm serve\n"
    assert unit_programs(head) == ("llmgw", ("/opt/vllm/bin/ray", "/opt/vllm/bin/vllm"))
    plan = starts(unit(Path("/opt/vllm/bin/vllm")))
    assert program_checks(plan) == (
        ProgramCheck("hub", "n1", "/opt/vllm/bin/vllm", "nobody", unit(Path("/opt/vllm/bin/vllm"))),
    )


def test_a_nodes_answer_is_judged_as_hostile_data() -> None:
    check = ProgramCheck("m", "n1", "vllm", "llmgw", "[Service]\nPrivateTmp=yes\nExecStart=vllm serve\n")
    assert judge({}, check) == ""  # no answer: not held against the start
    assert judge({"vllm": {"kind": "missing", "empty": True, "path": None}}, check) == ""  # systemd says it
    # a bare name is judged by where it resolved to: the sandbox hides /tmp
    said = judge({"vllm": {"kind": "file", "empty": False, "path": "/tmp/venv/bin/vllm"}}, check)
    assert said.startswith(
        "the engine program vllm (/tmp/venv/bin/vllm) is hidden from its unit by PrivateTmp=yes"
    )
    hostile = {"path": "/x\n\x1b[2J", "owner": "r" * 9000, "mode": "0700"}
    said = judge(
        {"vllm": {"kind": "file", "empty": False, "path": "/usr/bin/vllm", "unrunnable": {"llmgw": hostile}}},
        check,
    )
    assert "\n" not in said and "\x1b" not in said and len(said) < 2000
