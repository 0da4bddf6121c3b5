"""Engine key rotation (``remote/engine_keys.py``) replaces every running replica through
the rolling path, the gateway holding a node's old and new keys until every replica on
it was replaced. The keys' reads and writes and the replacements themselves are replaced
here (their own tests cover them): what is checked is which replicas are rolled, and
which nodes keep their old key."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.observe.facts import NodeFacts
from llmgw_cli.core.planning.plan import Action, make_plan
from llmgw_cli.progress import silent
from llmgw_cli.remote import engine_keys
from llmgw_cli.remote.connect import Connections
from llmgw_cli.remote.execute import Outcome
from llmgw_cli.remote.executor import Rolled
from llmgw_cli.remote.transport import Transport

from .facts_factory import node_facts, with_units

CLUSTER = """\
cluster: {name: t}
fabrics: {ib: {kind: infiniband}}
nodes:
  - {name: a, address: 10.0.0.1, fabric: ib, hcas: [mlx5_0]}
  - {name: b, address: 10.0.0.2, fabric: ib, hcas: [mlx5_0]}
profiles:
  vllm: {engine: vllm, ports: 8100-8199}
gateway: {host: gw.example}
models:
  - {name: m, source: org/m, fetch: engine, profile: vllm, scaling: {min: 2, max: 2}}
  - {name: n, source: org/n, fetch: engine, profile: vllm, scaling: {min: 1, max: 1}}
"""


class NoNode:
    node = "x"

    async def run(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the fakes answer everything")

    async def write_file(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("the fakes answer everything")

    async def close(self) -> None:
        pass


def settled(gpus: tuple[int, int]) -> tuple[Any, dict[str, NodeFacts]]:
    spec = parse_cluster(CLUSTER)
    fresh = {"a": node_facts("a", gpus=gpus[0]), "b": node_facts("b", gpus=gpus[1])}
    start = make_plan(spec, fresh)
    return spec, with_units(fresh, [(u.node, u.name, u.text) for a in start.changes for u in a.write])


def rotate(
    monkeypatch: pytest.MonkeyPatch,
    gpus: tuple[int, int],
    *,
    fails: frozenset[str] = frozenset(),
    allow_downtime: bool = False,
) -> tuple[list[Outcome], list[dict[str, tuple[str, ...]]], list[Action]]:
    spec, facts = settled(gpus)
    maps: list[dict[str, tuple[str, ...]]] = []
    rolled: list[Action] = []

    async def keys(ts: list[Any], *, rotate: bool = False) -> dict[str, str]:
        return {t.node: f"{'new' if rotate else 'old'}-{t.node}" for t in ts}

    async def nothing(*args: Any) -> list[Outcome]:
        return []

    async def roll_each(
        spec: Any, conns: Any, actions: Sequence[Action], report: Any, **kw: Any
    ) -> list[Rolled]:
        assert kw["engine_keys"] == {"a": "new-a", "b": "new-b"}  # successors start with the new keys
        rolled.extend(actions)
        out = []
        for a in actions:
            assert a.retire is not None
            ok = f"{a.model}#{a.retire.replica}" not in fails
            out.append(Rolled(a, [Outcome(f"{a.model}#{a.retire.replica}", ok, "done")], ok))
        return out

    async def give(keymap: dict[str, tuple[str, ...]]) -> Outcome:
        maps.append(keymap)
        return Outcome("gateway", True, "reloaded")

    class Node:
        def __init__(self, node: str) -> None:
            self.node = node

    monkeypatch.setattr(engine_keys, "node_engine_keys", keys)
    monkeypatch.setattr(engine_keys, "_write_all", nothing)
    monkeypatch.setattr(engine_keys, "roll_each", roll_each)
    monkeypatch.setattr(engine_keys, "GATEWAY_PICKUP", 0.0)

    def opener(*args: Any) -> Transport:
        return NoNode()

    async def scenario() -> list[Outcome]:
        async with Connections(spec, Path(), opener=opener) as conns:
            transports: dict[str, Any] = {"a": Node("a"), "b": Node("b")}
            return await engine_keys.rotate_engine_keys(
                spec,
                conns,
                facts,
                give,
                silent,
                transports=transports,
                take_lock=None,
                allow_downtime=allow_downtime,
            )

    return asyncio.run(scenario()), maps, rolled


def test_every_replica_is_rolled_and_the_gateway_ends_with_the_new_keys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    outcomes, maps, rolled = rotate(monkeypatch, gpus=(4, 4))
    assert sorted((a.model, a.retire.replica, a.surge) for a in rolled if a.retire) == [
        ("m", 0, True),
        ("m", 1, True),
        ("n", 0, True),
    ]
    assert maps == [
        {"a": ("old-a", "new-a"), "b": ("old-b", "new-b")},
        {"a": ("new-a",), "b": ("new-b",)},
    ]
    assert all(o.ok for o in outcomes)


def test_a_replica_not_replaced_leaves_its_nodes_both_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    outcomes, maps, rolled = rotate(monkeypatch, gpus=(4, 4), fails=frozenset({"n#0"}))
    n = next(a for a in rolled if a.model == "n")
    assert n.retire is not None
    old_node = n.retire.nodes[0]
    other = "b" if old_node == "a" else "a"
    assert maps[-1] == {old_node: (f"new-{old_node}", f"old-{old_node}"), other: (f"new-{other}",)}
    assert [o.subject for o in outcomes if not o.ok] == ["n#0"]


def test_without_free_cards_a_single_replica_is_not_taken_down_unless_allowed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # three cards, three replicas: each replacement is in place, and n has no other replica
    outcomes, maps, rolled = rotate(monkeypatch, gpus=(2, 1))
    refused = [o for o in outcomes if not o.ok]
    assert [o.subject for o in refused] == ["n#0"] and "--allow-downtime" in refused[0].message
    assert not any(a.downtime for a in rolled)
    assert any(len(keys) == 2 for keys in maps[-1].values())  # those nodes keep both keys
    _, maps, rolled = rotate(monkeypatch, gpus=(2, 1), allow_downtime=True)
    assert any(a.downtime for a in rolled)
    assert all(len(keys) == 1 for keys in maps[-1].values())
