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
  apply reports and the ones the gateway logged.

The figures are printed (`pytest -s`).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.waiting import wait_until

from .conftest import Lab
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
