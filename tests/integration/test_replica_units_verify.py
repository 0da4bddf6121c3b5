"""Every rendered replica unit passes `systemd-analyze verify`, with stderr treated as failure.

Units are verified in a scratch root holding systemd's own units and a stand-in executable
at each engine path, since verify checks that ExecStart= binaries exist."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.engine.engines import Member, ReplicaUnit, ray_program, replica_unit
from tests.rendered_units import every_replica_unit, pinned
from tests.security.hostile_values import HOSTILE_ARGS, exec_argv, unit_keys

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed"),
]


def scratch_root(tmp: Path, spec: ClusterSpec) -> Path:
    root = tmp / "root"
    (root / "etc/systemd/system").mkdir(parents=True)
    (root / "lib/systemd").mkdir(parents=True)
    shutil.copytree("/lib/systemd/system", root / "lib/systemd/system", symlinks=True)
    for profile in spec.profiles.values():
        program = profile.argv0[0]
        path = root / program.lstrip("/") if program.startswith("/") else root / "usr/bin" / program
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/bin/sh\n")
        path.chmod(0o755)
    return root


def verify(root: Path, name: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["systemd-analyze", "verify", f"--root={root}", name], capture_output=True, text=True, timeout=60
    )


def assert_verifies(root: Path, unit: ReplicaUnit) -> None:
    """Put ``unit`` in the scratch root: systemd-analyze verify accepts it, not a word on stderr."""
    (root / "etc/systemd/system" / unit.name).write_text(unit.text)
    result = verify(root, unit.name)
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", result.stderr


@pytest.mark.parametrize("inventory", ["hgx-two-fabrics.yaml", "single-box.yaml", "lab.yaml"])
def test_every_model_unit_verifies(inventory: str, tmp_path: Path) -> None:
    spec = parse_cluster(
        (ROOT / "inventories" / inventory).read_text().replace("profile: vllm-ray", "profile: vllm")
    )
    root = scratch_root(tmp_path, spec)
    units = every_replica_unit(spec)
    for unit in units:
        # each member lives on its own node; verify them one at a time under the same name
        assert_verifies(root, unit)
    assert len(units) >= len(spec.models)


def test_verify_catches_a_broken_replica_unit(tmp_path: Path) -> None:
    spec = pinned(parse_cluster((ROOT / "inventories/single-box.yaml").read_text()))
    root = scratch_root(tmp_path, spec)
    node = spec.nodes[0]
    model = spec.models[0]
    member = Member(node, 0, ("GPU-0",))
    unit = replica_unit(spec, model, replica=0, member=member, port=8100, members=(member,), dist_port=0)
    (root / "etc/systemd/system" / unit.name).write_text(unit.text.replace("KillMode=", "KillMood="))
    assert "KillMood" in verify(root, unit.name).stderr
    shutil.rmtree(root / "usr/bin")
    (root / "etc/systemd/system" / unit.name).write_text(unit.text)
    assert verify(root, unit.name).returncode != 0  # the engine binary is missing


@pytest.mark.parametrize("inventory", ["hgx-two-fabrics.yaml", "single-box.yaml", "lab.yaml"])
def test_hostile_args_add_no_directive_to_any_engine_unit(inventory: str, tmp_path: Path) -> None:
    """Every engine and shape (multi-node, Ray head) with args that mean something to
    systemd or a shell: the unit still verifies, has the directives of the clean unit, and
    its ExecStart= gives the engine each arg verbatim."""
    spec = pinned(parse_cluster((ROOT / "inventories" / inventory).read_text()))
    root = scratch_root(tmp_path, spec)
    for profile in spec.profiles.values():  # Ray heads and workers run `ray` beside the engine
        ray = root / ray_program(profile).lstrip("/")
        ray.parent.mkdir(parents=True, exist_ok=True)
        ray.write_text("#!/bin/sh\n")
        ray.chmod(0o755)
    fabric_nodes = [n for n in spec.nodes if n.fabric] or spec.nodes
    for i, model in enumerate(spec.models):
        hostile = model.model_copy(update={"args": HOSTILE_ARGS})
        nodes = fabric_nodes[: model.nodes] if model.nodes > 1 else spec.nodes[:1]
        members = tuple(Member(n, r, (f"GPU-{n.name}-0",), "=mlx5_0:1") for r, n in enumerate(nodes))
        for member in members:
            clean = replica_unit(
                spec, model, replica=i, member=member, port=8100, members=members, dist_port=29500
            )
            unit = replica_unit(
                spec, hostile, replica=i, member=member, port=8100, members=members, dist_port=29500
            )
            assert unit_keys(unit.text) == unit_keys(clean.text)
            (line,) = [x for x in unit.text.splitlines() if x.startswith("ExecStart=")]
            argv = exec_argv(line.removeprefix("ExecStart="))
            if "--address=" not in line:  # a Ray worker runs `ray start`, not the engine
                start = argv.index(HOSTILE_ARGS[0])
                assert argv[start : start + len(HOSTILE_ARGS)] == HOSTILE_ARGS
            assert_verifies(root, unit)
