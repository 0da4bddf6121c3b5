"""The whole plan: host steps built from what the shell read, and the digests a saved plan
is checked against (pure; tests/integration/test_saved_plan_lab.py runs it for real)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar, cast

import pytest

from llmgw_cli.cli import host_steps as cli_steps
from llmgw_cli.cli.session import Session
from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.observe.facts import NodeFacts
from llmgw_cli.core.planning.plan import Plan, make_plan
from llmgw_cli.core.planning.steps import GatewayState, HostFacts, host_lines
from llmgw_cli.core.planning.whole_plan import (
    PLAN_FORMAT,
    action_needs,
    has_work,
    saved_refusal,
    what_changed,
    whole,
)
from llmgw_cli.errors import InputError

from .facts_factory import node_facts, with_units

T = TypeVar("T")

URL = "https://example.org/org/repo/m.Q4.gguf?token=hf_secretsecretsecretsecret"
CLUSTER = f"""\
cluster: {{name: t}}
nodes:
  - {{name: a, address: 10.0.0.1, weights: [/w]}}
  - {{name: b, address: 10.0.0.2, weights: [/w]}}
profiles: {{p: {{engine: llama-server, ports: 8100-8199}}}}
models:
  - {{name: m, source: '{URL}', profile: p, scaling: {{min: 1, max: 1}}}}
"""
GATEWAY = GatewayState(
    host="a", how="reload", files=(("cluster.yaml", "abc"),), said="gateway on a: reload (cluster.yaml)"
)


def spec(text: str = CLUSTER) -> ClusterSpec:
    return parse_cluster(text)


def fresh() -> dict[str, NodeFacts]:
    return {n: node_facts(n) for n in "ab"}


def host(**changes: object) -> HostFacts:
    base = HostFacts(stale_helper=("a", "b"), helper_missing=("b",), keyless=("a",), gateways=(GATEWAY,))
    return base.model_copy(update=changes)


def planned(s: ClusterSpec | None = None, h: HostFacts | None = None) -> Plan:
    s = s or spec()
    return whole(s, make_plan(s, fresh()), fresh(), h or host())


def test_every_host_step_is_in_the_plan_with_its_target_reason_and_dependencies() -> None:
    plan = planned()
    [start] = plan.changes
    steps = {s.id: s for s in plan.steps}
    node = start.nodes[0]
    assert steps["node_helper:a"].action == "update" and steps["node_helper:b"].action == "install"
    assert steps["engine_key:a"].action == "write" and "engine_key:b" not in steps
    weights = steps[f"weights:{node}:m"]
    assert weights.action == "fetch" and weights.reason
    assert "hf_secret" not in " ".join(weights.detail)  # a URL's token never lands in the plan
    assert steps["gateway:a"].action == "reload" and steps["gateway:a"].detail == ("cluster.yaml",)
    assert steps["gateway:a"].depends == ("engine_key:a",)  # it is given the keys' map
    # the replica waits on its node's helper, key (if any) and weights
    wanted = {f"node_helper:{node}", f"weights:{node}:m"} | ({"engine_key:a"} if node == "a" else set())
    assert set(action_needs(plan)[(start.model, start.replica)]) == wanted
    assert plan.format == PLAN_FORMAT


def test_the_host_lines_say_what_plan_printed_before_and_the_weights_too() -> None:
    lines = host_lines(planned().steps)
    assert ("gateway on a: reload (cluster.yaml)", True) in lines
    assert ("node helper: install or update on a, b", True) in lines
    assert ("engine key: write on a", True) in lines
    assert any(text.startswith("weights of m: fetch https://example.org/") for text, _ in lines)
    quiet = GatewayState(host="a", how="none", said="gateway on a: unchanged")
    nothing = make_plan(spec(), fresh()).model_copy(update={"actions": ()})
    settled = whole(spec(), nothing, fresh(), HostFacts(gateways=(quiet,)))
    assert host_lines(settled.steps) == [("gateway on a: unchanged", False)]
    assert not has_work(settled)  # an unchanged gateway is shown, not carried out


def test_a_saved_plan_survives_json_and_holds_against_the_same_cluster_file() -> None:
    plan = planned()
    again = Plan.model_validate_json(plan.model_dump_json())
    assert again == plan
    assert saved_refusal(again, spec()) is None
    # the canonical form: comments and layout do not change what apply does
    assert saved_refusal(again, spec("# a comment\n" + CLUSTER.replace("{name: t}", "{ name: t }"))) is None


def test_a_changed_cluster_file_is_named_in_the_refusal() -> None:
    plan = planned()
    edited = spec(CLUSTER.replace("max: 1}", "max: 2}"))
    said = saved_refusal(plan, edited)
    assert said is not None
    assert "the cluster file changed since this plan was made (model m)" in said
    b = "  - {name: b, address: 10.0.0.2, weights: [/w]}\n"
    added = spec(CLUSTER.replace(b, b + "  - {name: c, address: 10.0.0.3, weights: [/w]}\n"))
    assert "(node c)" in (saved_refusal(plan, added) or "")


def test_a_plan_of_another_format_is_refused() -> None:
    old = planned().model_copy(update={"format": 1})
    assert "format 1" in (saved_refusal(old, spec()) or "")


def test_what_changed_names_the_nodes_and_steps_that_differ() -> None:
    plan = planned()
    [start] = plan.changes
    [node] = start.nodes
    other = "b" if node == "a" else "a"
    facts = with_units(fresh(), [(w.node, w.name, w.text) for w in start.write])
    now = whole(spec(), make_plan(spec(), facts), facts, host(keyless=()))
    assert not now.changes  # the replica runs: only the host steps are left
    said = what_changed(plan, now)
    assert f"facts of {node}" in said and f"facts of {other}" not in said
    assert "engine_key:a" in said and f"weights:{node}:m" in said


def test_the_host_digest_notices_a_changed_helper_key_or_gateway() -> None:
    digest = planned().host_digest
    assert planned(h=host()).host_digest == digest
    for changed in (
        host(stale_helper=("a",)),
        host(keyless=()),
        host(gateways=(GATEWAY.model_copy(update={"files": (("cluster.yaml", "def"),)}),)),
    ):
        assert planned(h=changed).host_digest != digest


class FakeSession:
    """What ``load_saved`` uses of a session: ``run`` and ``conns`` (the shell's reads are
    replaced below)."""

    conns = None

    def run(self, work: Coroutine[Any, Any, T]) -> T:
        return asyncio.run(work)


@pytest.fixture
def shell(monkeypatch: pytest.MonkeyPatch) -> list[HostFacts]:
    """The host facts the shell read: ``host()`` until a test sets another."""
    seen = [host()]

    async def no_answers(*_: object) -> dict[tuple[str, int], bool]:
        return {}

    monkeypatch.setattr(cli_steps, "health_answers", no_answers)
    return seen


def load(
    path: Path, facts: dict[str, NodeFacts], shell: list[HostFacts], written: ClusterSpec | None = None
) -> Plan | None:
    session = cast(Session, FakeSession())
    return cli_steps.load_saved(path, spec(), session, facts, shell[0], written=written or spec())


def test_a_saved_plan_holds_is_a_no_op_once_done_and_is_refused_otherwise(
    tmp_path: Path, shell: list[HostFacts]
) -> None:
    plan = planned()
    path = tmp_path / "plan.json"
    path.write_text(plan.model_dump_json())
    assert load(path, fresh(), shell) == plan  # nothing changed: carried out as saved
    # carried out: its replica runs, its keys and helpers are in place, the gateway took its files
    [start] = plan.changes
    done = with_units(fresh(), [(w.node, w.name, w.text) for w in start.write])
    shell[0] = HostFacts(gateways=(GATEWAY.model_copy(update={"how": "none", "said": "unchanged"}),))
    assert load(path, done, shell) is None
    # only part of it happened (the keys are still missing): refused, saying what differs
    shell[0] = host(stale_helper=())
    with pytest.raises(InputError, match=r"the nodes changed since this plan was made .*node_helper:a"):
        load(path, done, shell)
    # the cluster file changed: refused before the nodes are looked at
    with pytest.raises(InputError, match=r"cluster file changed since this plan was made \(model m\)"):
        load(path, fresh(), shell, spec(CLUSTER.replace("max: 1}", "max: 2}")))
    path.write_text("{}")
    with pytest.raises(InputError, match="not a plan saved by `llmgw plan --out`"):
        load(path, fresh(), shell)
