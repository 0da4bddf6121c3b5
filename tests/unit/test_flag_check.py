"""The plan's command lines against the engine version of each node: a flag it refuses is
a located problem of the cluster file, a version without a table a warning."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw_cli.cli.apply_steps import flags_checked
from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.engine.commands import engine_commands
from llmgw_cli.core.engine.engine_flags import table, unknown_flags
from llmgw_cli.core.engine.flag_check import check_flags
from llmgw_cli.core.observe.facts import Engine, NodeFacts
from llmgw_cli.core.planning.plan import make_plan
from llmgw_cli.errors import SpecError
from llmgw_cli.lab import cluster as lab_cluster
from tests.test_lab_shapes import lab_record

from .facts_factory import node_facts, with_units

ROOT = Path(__file__).parents[2]

CLUSTER = """\
cluster: {name: t}
nodes:
  - {name: a, address: 10.0.0.1}
profiles:
  vllm:
    engine: vllm
    version: "0.32.0"
    command: [/opt/vllm/bin/vllm, serve]
    args: [--swap-space, "4"]
  llama:
    engine: llama-server
    args: [--no-such-llama-flag]
models:
  - name: m
    source: org/m
    fetch: engine
    profile: vllm
    args: [--enforce-eager, --disable-log-requests]
    scaling: {min: 1, max: 1}
  - {name: g, source: /data/g.gguf, profile: llama, scaling: {min: 1, max: 1}}
"""


def facts(version: str) -> dict[str, NodeFacts]:
    engine = Engine(path="/opt/vllm/bin/vllm", found=True, version=version)
    return {"a": node_facts("a").model_copy(update={"engines": (engine,)})}


def test_a_flag_the_nodes_vllm_refuses_fails_the_plan_at_its_args_entry(tmp_path: Path) -> None:
    spec = parse_cluster(CLUSTER)
    found = facts("0.32.0+cpu")
    plan = make_plan(spec, found)
    report = check_flags(spec, found, plan)
    assert [(p.node, p.engine, p.version, p.flag, p.source) for p in report.problems] == [
        ("a", "vllm", "0.32.0", "--swap-space", ("profiles", "vllm", "args", 0)),
        ("a", "vllm", "0.32.0", "--disable-log-requests", ("models", 0, "args", 1)),
    ]
    assert report.warnings == ()  # llama-server has no table: its flags go unchecked, silently
    file = tmp_path / "cluster.yaml"
    file.write_text(CLUSTER)
    with pytest.raises(SpecError) as raised:
        flags_checked(spec, file, found, plan)
    said = [str(p) for p in raised.value.problems]
    assert said[0].startswith(
        f"{file}:9:12: profiles.vllm.args[0]: vllm 0.32.0 on a does not accept --swap-space"
    )
    assert said[1].startswith(f"{file}:18:29: models[0].args[1]: vllm 0.32.0 on a does not accept")


def test_a_replica_kept_running_is_checked_too() -> None:
    spec = parse_cluster(CLUSTER)
    found = facts("0.32.0")
    first = make_plan(spec, found)
    running = with_units(found, [(w.node, w.name, w.text) for a in first.actions for w in a.write])
    again = make_plan(spec, running)
    assert {a.op for a in again.actions} == {"="}
    assert [p.flag for p in check_flags(spec, running, again).problems] == [
        "--swap-space",
        "--disable-log-requests",
    ]


def test_a_node_version_without_a_table_is_a_warning_not_an_error() -> None:
    spec = parse_cluster(CLUSTER)
    found = facts("0.31.0")
    report = check_flags(spec, found, make_plan(spec, found))
    assert report.problems == ()
    assert report.warnings == (
        "a has vllm 0.31.0; profile vllm is written for 0.32.0",
        "flags not checked: no table for vllm 0.31.0",
    )


def test_a_version_the_probe_could_not_read_is_the_profiles() -> None:
    spec = parse_cluster(CLUSTER)
    found = facts("unknown")
    assert [p.version for p in check_flags(spec, found, make_plan(spec, found)).problems] == ["0.32.0"] * 2
    undeclared = parse_cluster(CLUSTER.replace('    version: "0.32.0"\n', ""))
    report = check_flags(undeclared, found, make_plan(undeclared, found))
    assert report.problems == ()
    assert report.warnings == ("flags not checked: the vllm version on a is not known",)


def test_accepted_flags_pass_and_the_plan_keeps_its_warnings(tmp_path: Path) -> None:
    text = CLUSTER.replace('[--swap-space, "4"]', '[--gpu-memory-utilization, "0.9"]').replace(
        "--disable-log-requests", "--runner=pooling"
    )
    spec = parse_cluster(text)
    found = facts("0.32.0")
    plan = make_plan(spec, found)
    file = tmp_path / "c.yaml"
    file.write_text(text)
    assert flags_checked(spec, file, found, plan) == plan


def shipped_files() -> list[tuple[str, str]]:
    files = [(p.name, p.read_text()) for p in sorted(ROOT.glob("inventories/*.yaml"))]
    files.append(("lab", lab_cluster.inventory(lab_record(4, "hgx"), hub_models=True)))
    return files


@pytest.mark.parametrize(("place", "text"), shipped_files())
def test_the_shipped_command_lines_pass_the_check(place: str, text: str) -> None:
    """Those the engines' own parsers accept (tests/integration/test_engine_parsers.py)."""
    spec = parse_cluster(text, place)
    for command in engine_commands(spec):
        profile = spec.profiles[spec.model(command.model).profile]
        flags = table(profile.engine.value, profile.version or "")
        if profile.engine.value == "llama-server" or command.argv[0] != profile.argv0[0]:
            continue  # no table; a Ray worker runs `ray start`
        assert flags is not None, (place, command.model)
        argv = list(command.argv[len(profile.argv0) :])
        assert unknown_flags(flags, argv) == [], (place, command.model, argv)
