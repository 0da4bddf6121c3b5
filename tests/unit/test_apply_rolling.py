"""`llmgw plan` and `llmgw apply` on a rolling replacement, with the nodes, the lock and
the executor replaced: `--replace MODEL#N` names a running replica or is refused with the
ones that run; a plan that leaves a model with no serving replica is shown (`--dry-run`
exits 0) and refused before anything changes unless `--allow-downtime` is given."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from llmgw_cli.cli import apply_steps as apply_cli
from llmgw_cli.cli.main import app
from llmgw_cli.cli.views import plan_view
from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.hosts.gateway_install import GatewayChange
from llmgw_cli.core.observe.facts import NodeFacts
from llmgw_cli.core.planning.plan import Plan, make_plan
from llmgw_cli.core.weights.pins import parse_pins
from llmgw_cli.core.weights.snapshot import Snapshot as RepoSnapshot
from llmgw_cli.errors import DowntimeRefused, InputError, UsageError
from llmgw_cli.remote import hub
from llmgw_cli.remote.execute import Outcome
from llmgw_cli.remote.gateway_install import GatewayPreview, GatewayPreviews
from llmgw_cli.remote.probe import Snapshot
from tests.security.hostile_values import HOSTILE_ARGS

from .facts_factory import node_facts, with_units

CLUSTER = """\
cluster: {{name: t}}
nodes:
  - {{name: node01, address: 10.0.0.1}}
profiles:
  vllm: {{engine: vllm, ports: 8100-8199}}
gateway: {{host: gw.example}}
models:
  - {{name: m, source: org/m, fetch: engine, profile: vllm, tensor_parallel: 2, args: [{arg}], gpu_class: H100-80GB,
      scaling: {{min: {min}, max: 4}}}}
"""


def spec(arg: str = "--x", min: int = 1) -> ClusterSpec:
    return parse_cluster(CLUSTER.format(arg=arg, min=min))


def running(cards: int, min: int = 1) -> dict[str, NodeFacts]:
    """node01 with ``cards`` cards, running what a plan of the ``--x`` spec starts."""
    facts = {"node01": node_facts("node01", gpus=cards)}
    plan = make_plan(spec(min=min), facts)
    return with_units(facts, [(w.node, w.name, w.text) for a in plan.changes for w in a.write])


def shown(plan: Plan) -> str:
    console = Console(file=io.StringIO(), width=300, color_system=None)
    console.print(plan_view(plan))
    return console.file.getvalue()  # type: ignore[attr-defined,no-any-return]


def test_the_plan_says_new_replica_first_or_in_place_and_why() -> None:
    surge = shown(make_plan(spec("--y"), running(8)))
    assert (
        "~ m #0 -> #1 on node01:8102  (spec changed; new replica first, then #0 drained and stopped)"
    ) in surge
    assert "downtime" not in surge and "--allow-downtime" not in surge
    two = shown(make_plan(spec("--y", min=2), running(4, min=2)))
    assert (
        "~ m #0 on node01:8100  (spec changed; replaced in place: no free cards, 1 other replica serves)"
        in two
    )
    alone = shown(make_plan(spec("--y"), running(2)))
    assert (
        "~ m #0 on node01:8100  (spec changed; replaced in place: no free cards, no other replica serves)"
        in alone
    )
    assert (
        "downtime: m will be unavailable for its load time: no free H100-80GB cards to start the new "
        "replica first"
    ) in alone
    assert "apply refuses without --allow-downtime" in alone.split("\n")[-2]


@pytest.mark.parametrize("text", ["[/x]", "[bold red]boom", "[link=https://evil.example]x[/link]"])
def test_downtime_and_reasons_are_shown_literally(text: str) -> None:
    plan = make_plan(spec("--y"), running(2))
    (action,) = plan.changes
    hostile = action.model_copy(update={"reason": text, "downtime": text, "model": text})
    out = shown(plan.model_copy(update={"actions": (hostile,)}))
    assert f"downtime: {text}" in out and f"({text})" in out


def test_replace_names_a_running_replica_or_says_which_run() -> None:
    facts = running(8, min=2)
    assert apply_cli.replacements(["m#1", "m#0", "m#1"], facts) == {("m", 0), ("m", 1)}
    with pytest.raises(InputError) as missing:
        apply_cli.replacements(["m#7"], facts)
    said = str(missing.value)
    assert "m#7" in said and "the replicas of m that run: m#0, m#1" in said and "llmgw status" in said
    with pytest.raises(InputError, match="no replica of other runs"):
        apply_cli.replacements(["other#0"], facts)
    for bad in ["m", "m#", "#0", "m#x", "m#-1", "m#\u00b2", *HOSTILE_ARGS[:3]]:
        with pytest.raises(InputError):
            apply_cli.replacements([bad], facts)
    with pytest.raises(UsageError, match="expected MODEL#N"):
        apply_cli.replacements(["m0"], facts)


def test_downtime_is_refused_with_what_to_do() -> None:
    plan = make_plan(spec("--y"), running(2))
    apply_cli.refuse_downtime(plan, allowed=True)
    apply_cli.refuse_downtime(make_plan(spec("--y"), running(8)), allowed=False)
    with pytest.raises(DowntimeRefused) as refused:
        apply_cli.refuse_downtime(plan, allowed=False)
    said = str(refused.value)
    assert plan.downtime[0] in said
    assert "Nothing was changed" in said and "--allow-downtime" in said and "free cards" in said
    assert DowntimeRefused.exit_code == 1


@dataclass
class World:
    facts: dict[str, NodeFacts]
    executed: list[Plan] = field(default_factory=list)
    locks: int = 0
    pins: list[str] = field(default_factory=list)  # the pins file each preview was given


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    w = World(facts={})

    def probe(spec: ClusterSpec, file: Path, nodes: Any, console: Any, session: Any) -> Snapshot:
        return Snapshot(tuple(w.facts.values()), 0.0)

    async def preview(spec: ClusterSpec, conns: Any, text: str, pins: str) -> GatewayPreviews:
        w.pins.append(pins)
        return GatewayPreviews((GatewayPreview("gw.example", GatewayChange((), "none")),))

    async def no_nodes(*args: Any) -> list[str]:
        return []

    def fetch_and_lock(spec: ClusterSpec, file: Path, session: Any, chosen: Plan, how: Any) -> Any:
        w.locks += 1
        apply_cli.refuse_downtime(chosen, how.allow_downtime)
        return chosen, Snapshot(tuple(w.facts.values()), 0.0), None, None

    async def execute(spec: ClusterSpec, conns: Any, chosen: Plan, **kw: Any) -> list[Outcome]:
        w.executed.append(chosen)
        return [Outcome("node01", True, "units in place")]

    monkeypatch.setattr(apply_cli, "probe_with_progress", probe)
    monkeypatch.setattr(apply_cli, "preview", preview)
    monkeypatch.setattr(apply_cli, "stale_nodes", no_nodes)
    monkeypatch.setattr(apply_cli, "nodes_without_key", no_nodes)
    monkeypatch.setattr(apply_cli, "_fetch_and_lock", fetch_and_lock)
    monkeypatch.setattr(apply_cli, "_execute_with_progress", execute)
    yield w


def cli(tmp_path: Path, arg: str, *args: str) -> Any:
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(CLUSTER.format(arg=arg, min=1))
    return CliRunner().invoke(app, [*args, "-f", str(cluster)])


def test_apply_refuses_downtime_before_changing_anything(world: World, tmp_path: Path) -> None:
    world.facts = running(2)
    dry = cli(tmp_path, "--y", "apply", "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert "downtime: m will be unavailable" in dry.output
    refused = cli(tmp_path, "--y", "apply", "--yes")
    assert isinstance(refused.exception, DowntimeRefused), refused.output  # exit 1 (cli.main)
    assert "no free H100-80GB cards" in str(refused.exception)
    assert world.executed == [] and world.locks == 0  # not even the lock was taken
    shown_by_plan = cli(tmp_path, "--y", "plan")
    assert shown_by_plan.exit_code == 0 and "apply refuses without --allow-downtime" in shown_by_plan.output
    allowed = cli(tmp_path, "--y", "apply", "--yes", "--allow-downtime")
    assert allowed.exit_code == 0, allowed.output
    (plan,) = world.executed
    assert plan.downtime and [a.replica for a in plan.changes] == [0]


def test_apply_replace_rolls_an_unchanged_replica(world: World, tmp_path: Path) -> None:
    world.facts = running(8)
    nothing = cli(tmp_path, "--x", "apply", "--yes")
    assert nothing.exit_code == 0 and world.executed == []
    done = cli(tmp_path, "--x", "apply", "--yes", "--replace", "m#0")
    assert done.exit_code == 0, done.output
    (plan,) = world.executed
    (action,) = plan.changes
    assert action.surge and action.retire is not None and action.retire.replica == 0
    assert "~ m #0 -> #1 on node01:8102  (replace requested; new replica first" in done.output
    unknown = cli(tmp_path, "--x", "apply", "--yes", "--replace", "m#3")
    assert isinstance(unknown.exception, InputError)  # exit 2 (cli.main)
    assert "the replicas of m that run: m#0" in str(unknown.exception)
    preview = cli(tmp_path, "--x", "plan", "--replace", "m#0")
    assert preview.exit_code == 0 and "~ m #0 -> #1" in preview.output
    saved = tmp_path / "plan.json"
    saved.write_text(plan.model_dump_json())
    both = CliRunner().invoke(
        app, ["apply", str(saved), "-f", str(tmp_path / "cluster.yaml"), "--replace", "m#0"]
    )
    assert isinstance(both.exception, UsageError)
    assert "a saved plan carries its own" in str(both.exception)


def test_a_key_rotation_that_would_take_a_model_down_is_refused_unless_allowed(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    allowed_by: list[bool] = []

    async def execute(spec: ClusterSpec, conns: Any, chosen: Plan, **kw: Any) -> list[Outcome]:
        world.executed.append(chosen)
        rotates = any(s.kind == "engine_key" and s.action == "rotate" for s in chosen.steps)
        allowed_by.append(rotates and kw["allow_downtime"])
        return []

    monkeypatch.setattr(apply_cli, "_execute_with_progress", execute)
    world.facts = running(2)  # the only replica holds both cards: rotating replaces it in place
    refused = cli(tmp_path, "--x", "apply", "--yes", "--rotate-engine-key")
    assert isinstance(refused.exception, DowntimeRefused), refused.output
    assert "m will be unavailable for its load time" in str(refused.exception)
    assert world.executed == []
    allowed = cli(tmp_path, "--x", "apply", "--yes", "--rotate-engine-key", "--allow-downtime")
    assert allowed.exit_code == 0, allowed.output
    assert allowed_by == [True]  # the rotation is told it may
    world.facts = running(4)  # a free pair: the successor starts first, nothing to refuse
    rolled = cli(tmp_path, "--x", "apply", "--yes", "--rotate-engine-key")
    assert rolled.exit_code == 0, rolled.output


FETCHED = """\
cluster: {name: t}
nodes:
  - {name: node01, address: 10.0.0.1, weights: [/w]}
profiles:
  vllm: {engine: vllm, ports: 8100-8199}
gateway: {host: gw.example}
models:
  - {name: big, source: org/big@main, profile: vllm, fetch: {}, scaling: {min: 1, max: 1}}
  - {name: fixed, source: "org/fixed@COMMIT", profile: vllm, fetch: {}, scaling: {min: 0, max: 1}}
"""


def test_plan_and_apply_give_the_gateway_the_commits_they_planned(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pins file the gateway host gets holds the commit the plan's units run (the
    resolution apply printed), for the cluster file's source as written; a model already
    at a commit needs no pin. A cluster with nothing to pin still gets a pins file, an
    empty one, so an older one does not survive."""
    commit, fixed = "c0" * 20, "f1" * 20

    def resolve_models(spec: ClusterSpec, token: Any, endpoint: str) -> dict[str, RepoSnapshot]:
        return {
            "big": RepoSnapshot("org/big", commit, (), revision="main"),
            "fixed": RepoSnapshot("org/fixed", fixed, (), revision=fixed),
        }

    monkeypatch.setattr(hub, "resolve_models", resolve_models)
    world.facts = {"node01": node_facts("node01", gpus=1)}
    cluster = tmp_path / "cluster.yaml"
    text = FETCHED.replace("COMMIT", fixed)
    cluster.write_text(text)
    planned = CliRunner().invoke(app, ["plan", "-f", str(cluster)])
    assert planned.exit_code == 0, planned.output
    applied = CliRunner().invoke(app, ["apply", "--yes", "-f", str(cluster)])
    assert applied.exit_code == 0, applied.output
    (plan,) = world.executed
    (unit,) = plan.changes[0].write
    assert f"/w/hf/org--big/{commit}" in unit.text
    assert len(world.pins) == 2 and world.pins[0] == world.pins[1]
    assert json.loads(world.pins[1])["models"] == {"big": {"source": "org/big@main", "commit": commit}}
    assert parse_pins(parse_cluster(text), world.pins[1]) == {"big": commit}
    # nothing to pin: the file is written all the same, pinning nothing
    world.pins.clear()
    world.facts = running(8)
    plain = cli(tmp_path, "--x", "plan")
    assert plain.exit_code == 0, plain.output
    assert [json.loads(p) for p in world.pins] == [{"format": 1, "models": {}}]
