"""Rolling changes on the lab: `apply` replaces replicas under load through the real
gateway, and no request is refused or cut where a replica could start first.

Each test has its own rig (tests/integration/rolling.py: a cluster file of chosen lab
nodes, `apply`, the gateway on this machine) and streams through the gateway with the
official openai client (tests/integration/load.py) while `apply` runs:

- a spec change of an always-on `min: 1` model with free cards: the plan says the new
  replica starts first; 0 refused, 0 cut; one replica after, with the new spec hash;
- the same with no free cards (the replica holds every card of the only node): `apply`
  refuses before changing anything and says why, `--dry-run` shows it, and
  `--allow-downtime` goes through (the refusals it costs are counted, not bounded);
- `--replace MODEL#N` of one replica of two: 0 refused, 0 cut, the other untouched;
- a replica whose streams outlast its drain bound (`drain_timeout: 2s`, 16 s streams):
  stopped at the bound, and the streams cut are the ones the client saw cut, the ones
  apply reports and the ones the gateway logged;
- `llmgw drain` of the node holding an always-on replica, under load: its successor
  starts on the other node first, 0 refused, 0 cut; the drained node stays cordoned
  (`status` says who and since when), so an on-demand start finds no room there, and
  `llmgw uncordon` lets the next start go there.

The figures are printed (`pytest -s`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from tests.waiting import wait_until

from .conftest import Lab
from .lab_helpers import run
from .load import access_log
from .rolling import Rig, cut_at_bound, model, rig

pytestmark = pytest.mark.integration

CHANGE = {"args": ["--gpu-memory-utilization", "0.85"]}  # a spec change: new units


def changed(entry: dict[str, object]) -> dict[str, object]:
    return {**entry, **CHANGE}


def figures(made: Rig, load_failures: str) -> str:
    return f"{load_failures}\n{made.applied()}\n{made.tail()}"


def test_a_spec_change_with_free_cards_starts_the_new_replica_first(lab: Lab, tmp_path: Path) -> None:
    roller = model("roller", tp=2)
    with rig(lab, tmp_path, ("node01",), [roller]) as made:
        (old,) = made.units("roller")
        made.write([changed(roller)])
        with made.load("roller", concurrency=8) as load:
            done = made.apply("--yes")
        print(f"\nspec change with free cards: {load.totals()}")
        assert done.returncode == 0, figures(made, load.failures())
        assert "new replica first" in done.stdout, made.applied()
        assert not load.refused and not load.cut, figures(made, load.failures())
        assert len(load.completed) >= 8, load.totals()
        (new,) = made.units("roller")
        assert new.active == "active" and new.spec_hash == made.expected_hash("roller"), new
        assert new.spec_hash != old.spec_hash and new.replica != old.replica and new.port != old.port, (
            old,
            new,
        )
        made.wait_routed("roller", [new])


def test_with_no_free_cards_apply_refuses_unless_downtime_is_allowed(lab: Lab, tmp_path: Path) -> None:
    whole = model("whole", tp=8)  # every card of the only node
    with rig(lab, tmp_path, ("node01",), [whole]) as made:
        before = made.units("whole")
        made.write([changed(whole)])

        shown = made.apply("--dry-run")
        assert shown.returncode == 0, made.applied()
        assert "whole will be unavailable for its load time" in shown.stdout, made.applied()
        assert "--allow-downtime" in shown.stdout, made.applied()

        refused = made.apply("--yes")
        assert refused.returncode == 1, made.applied()
        said = refused.stdout + refused.stderr
        assert "whole will be unavailable for its load time" in said and "no free" in said, made.applied()
        assert "--allow-downtime" in said, made.applied()
        assert made.units("whole") == before, made.applied()  # nothing changed: same units, same processes

        with made.load("whole", concurrency=4) as load:
            allowed = made.apply("--yes", "--allow-downtime")
            returned = time.monotonic()
            assert allowed.returncode == 0, figures(made, load.failures())
            (new,) = made.units("whole")
            made.wait_routed("whole", [new])
            routed = time.monotonic() - returned
            served = len(load.completed)
            wait_until(lambda: len(load.completed) >= served + 4, timeout=60, what=load.failures)
        print(
            f"\nin-place replace with --allow-downtime: {load.totals()}; routed {routed:.1f}s after apply returned"
        )
        assert new.spec_hash == made.expected_hash("whole") and new.active == "active", new


def test_replace_one_replica_of_two_under_load(lab: Lab, tmp_path: Path) -> None:
    pair = model("pair", replicas=2)
    with rig(lab, tmp_path, ("node01",), [pair]) as made:
        first, second = made.units("pair")
        unknown = made.apply("--yes", "--replace", "pair#7")
        assert unknown.returncode == 2 and "pair#7" in unknown.stdout + unknown.stderr, made.applied()
        assert made.units("pair") == [first, second], made.applied()

        with made.load("pair", concurrency=4) as load:
            done = made.apply("--yes", "--replace", f"pair#{first.replica}")
        print(f"\n--replace pair#{first.replica}: {load.totals()}")
        assert done.returncode == 0, figures(made, load.failures())
        assert "replace requested" in done.stdout, made.applied()
        assert not load.refused and not load.cut, figures(made, load.failures())
        after = made.units("pair")
        assert second in after, (second, after)  # the other replica untouched: same process
        (new,) = [u for u in after if u != second]
        assert new.replica not in (first.replica, second.replica) and new.active == "active", after
        assert new.spec_hash == first.spec_hash, after  # unchanged spec, replaced as asked
        made.wait_routed("pair", [second, new])


def test_a_replica_that_does_not_drain_is_stopped_at_its_bound(lab: Lab, tmp_path: Path) -> None:
    # 16-token replies at 1 token/s: every stream lasts 16 s, the drain bound is 2 s
    sticky = model("sticky", tokens_per_second=1, drain_timeout="2s")
    with rig(lab, tmp_path, ("node01",), [sticky]) as made:
        (old,) = made.units("sticky")
        made.write([changed(sticky)])
        with made.load("sticky", concurrency=4, warm=0) as load:
            wait_until(
                lambda: sum(1 for r in load.requests if r.chunks > 1 and not r.done) == 4,
                timeout=30,
                what=load.failures,
            )
            began = time.time()
            done = made.apply("--yes")
        print(f"\na replica stopped at its 2s drain bound: {load.totals()}")
        assert done.returncode == 0, figures(made, load.failures())
        # the four streams on the old replica when it was drained, cut before their end
        assert len(load.cut) == 4 and not load.refused, figures(made, load.failures())
        assert all(r.started < began and r.ended - r.started < 15 for r in load.cut), load.failures()
        # apply says so (its progress line, once: on stderr without a terminal) ...
        assert cut_at_bound(done.stdout + done.stderr) == [(2.0, 4)], made.applied()
        # ... and the gateway logged them cut, on the old replica
        address = made.address(old)

        def cut_logged() -> list[dict[str, object]]:
            return [x for x in access_log(made.log, "sticky") if x["cut"]]

        wait_until(lambda: len(cut_logged()) >= 4, timeout=10, what=lambda: figures(made, load.failures()))
        assert {x["replica"] for x in cut_logged()} == {address}, cut_logged()
        assert len(cut_logged()) == 4, cut_logged()
        (new,) = made.units("sticky")
        assert new.replica != old.replica and new.spec_hash == made.expected_hash("sticky"), new


def ask(made: Rig, name: str) -> httpx.Response:
    """One short chat completion of ``name`` through the gateway (not streamed)."""
    return httpx.post(
        f"http://127.0.0.1:{made.port}/v1/chat/completions",
        headers={"Authorization": f"Bearer {made.key}"},
        json={"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=120,
    )


def test_drain_moves_an_always_on_replica_under_load_and_a_cordon_holds_placement(
    lab: Lab, tmp_path: Path
) -> None:
    roller = model("roller", tp=8)  # a whole node: its successor can only go to the other
    on_demand = {**model("od", tp=8), "scaling": {"min": 0, "max": 1}}
    with rig(lab, tmp_path, ("node01", "node02"), [roller, on_demand]) as made:
        (old,) = made.units("roller")
        other = next(n for n in made.nodes if n != old.node)
        file = str(made.cluster)

        shown = run("drain", old.node, "-f", file, "--dry-run")
        assert shown.returncode == 0, shown.stderr
        assert f"roller#{old.replica} on {old.node} -> {other} as #" in shown.stdout, shown.stdout
        assert made.units("roller") == [old]  # the dry run changed nothing
        assert json.loads(run("cordons", "--json", "-f", file).stdout) == []

        with made.load("roller", concurrency=8) as load:
            began = time.monotonic()
            done = run("drain", old.node, "-f", file, "--json")
            took = time.monotonic() - began
            served = len(load.completed)
            wait_until(lambda: len(load.completed) >= served + 8, timeout=60, what=load.failures)
        print(
            f"\ndrain of {old.node} (roller, tp=8) at concurrency 8: {len(load.finished)} requests sent,"
            f" {len(load.refused)} failed before their first byte, {len(load.cut)} failed after it;"
            f" llmgw drain took {took:.1f}s"
        )
        assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{made.tail()}"
        report = json.loads(done.stdout)
        assert report["drained"] and [m["to"] for m in report["moves"]] == [[other]], report
        assert not load.refused and not load.cut, figures(made, load.failures())
        (new,) = made.units("roller")
        assert new.node == other and new.active == "active", new
        made.wait_routed("roller", [new])

        # the drained node stays cordoned, as `status` says; the on-demand model finds no
        # room (the other node is full): it is not started there
        status = json.loads(run("status", "--json", "-f", file).stdout)
        (cordon,) = status["cordons"]
        assert (cordon["node"], cordon["draining"], cordon["source"]) == (old.node, False, "store")
        assert "@" in cordon["by"] and cordon["since"] > time.time() - 600, cordon
        # draining the other node now would leave roller with nothing: refused, nothing changed
        blocked = run("drain", other, "-f", file)
        said = blocked.stdout + blocked.stderr
        assert blocked.returncode == 1 and "roller would have no serving replica" in said, said
        assert f"cordoned: {old.node}" in said and "--allow-downtime" in said, said
        assert made.units("roller") == [new]
        assert [c["node"] for c in json.loads(run("cordons", "--json", "-f", file).stdout)] == [old.node]
        refused = ask(made, "od")
        assert refused.status_code == 503, refused.text
        assert made.units("od") == []
        wait_until(lambda: f"cordoned: {old.node}" in made.log_text(), timeout=10, what=made.tail)

        # uncordon: the next start of the on-demand model may go there again
        lifted = run("uncordon", old.node, "-f", file)
        assert lifted.returncode == 0 and f"uncordoned {old.node}" in lifted.stdout, lifted.stderr
        wait_until(lambda: ask(made, "od").status_code == 200, timeout=90, interval=2, what=made.tail)
        (started,) = made.units("od")
        assert started.node == old.node, started
