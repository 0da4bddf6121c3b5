"""The pure routing policy: least outstanding requests, leaving and rejoining rotation."""

from __future__ import annotations

import pytest

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.serving.affinity import Policy, Reason, Thresholds, rendezvous, request_key
from llmgw_cli.core.serving.engine_signals import Signals
from llmgw_cli.core.serving.routing import Health, Pool, endpoints, route_settings

pytestmark = pytest.mark.any_loop  # pure code

CLUSTER = """
cluster: {name: t}
nodes:
  - {name: a, address: 10.0.0.1}
  - {name: b, address: "fd00::2"}
profiles:
  p: {engine: vllm}
models:
  - {name: "on", source: o/on, fetch: engine, profile: p, scaling: {min: 1, max: 2}}
  - {name: lazy, source: o/lazy, fetch: engine, profile: p, scaling: {min: 0, max: 1}}
  - {name: "off", source: o/off, fetch: engine, profile: p}
"""


def ready_pool(*addresses: str) -> Pool:
    pool = Pool(max_failures=2)
    pool.replace({"m": list(addresses)}, now=0.0)
    for r in pool.of("m"):
        pool.checked(r, 200, now=0.0)
    return pool


def test_pick_prefers_fewest_outstanding() -> None:
    pool = ready_pool("a:1", "b:1")
    first = pool.pick("m", now=1.0)
    assert first is not None
    first.outstanding += 1
    second = pool.pick("m", now=2.0)
    assert second is not None and second.address != first.address


def test_equal_replicas_take_turns() -> None:
    pool = ready_pool("a:1", "b:1", "c:1")
    picked = [r.address for r in (pool.pick("m", now=float(t)) for t in range(1, 7)) if r]
    assert sorted(picked[:3]) == ["a:1", "b:1", "c:1"]
    assert picked[3:] == picked[:3]


def test_unchecked_and_loading_replicas_get_nothing() -> None:
    pool = Pool()
    pool.replace({"m": ["a:1"]}, now=0.0)
    assert pool.pick("m", now=1.0) is None
    pool.checked(pool.of("m")[0], 503, now=1.0)
    assert pool.of("m")[0].health is Health.loading
    assert pool.pick("m", now=2.0) is None


def test_repeated_failures_leave_rotation_until_healthy() -> None:
    pool = ready_pool("a:1", "b:1")
    bad = pool.of("m")[0]
    pool.failed(bad, now=1.0)
    assert bad.health is Health.ready  # one failure is not enough
    pool.failed(bad, now=2.0)
    assert bad.health is Health.failing
    assert all(pool.pick("m", now=3.0 + i).address == "b:1" for i in range(3))  # type: ignore[union-attr]
    pool.checked(bad, None, now=4.0)
    assert bad.health is Health.failing
    pool.checked(bad, 200, now=5.0)
    assert bad.health is Health.ready and bad.failures == 0


def test_success_resets_the_failure_count() -> None:
    pool = ready_pool("a:1")
    r = pool.of("m")[0]
    pool.failed(r, now=1.0)
    pool.succeeded(r)
    pool.failed(r, now=2.0)
    assert r.health is Health.ready


def test_exclude_skips_replicas_already_tried() -> None:
    pool = ready_pool("a:1", "b:1")
    assert pool.pick("m", now=1.0, exclude=frozenset({"a:1", "b:1"})) is None
    assert pool.pick("m", now=1.0, exclude=frozenset({"a:1"})).address == "b:1"  # type: ignore[union-attr]


def test_replace_keeps_state_of_known_replicas() -> None:
    pool = ready_pool("a:1")
    pool.of("m")[0].outstanding = 3
    pool.replace({"m": ["a:1", "b:1"]}, now=5.0)
    states = {r.address: (r.health, r.outstanding) for r in pool.of("m")}
    assert states == {"a:1": (Health.ready, 3), "b:1": (Health.unknown, 0)}
    pool.replace({}, now=6.0)
    assert pool.all() == []


def test_endpoints_take_rank_zero_of_active_replicas() -> None:
    spec = parse_cluster(CLUSTER)
    running = [
        ("on", 8100, ("a", "b"), True),
        ("on", 8101, ("b",), True),
        ("lazy", 8102, ("a",), False),  # unit not active
        ("gone", 8103, ("a",), True),  # no longer in the catalog
        ("on", 8104, ("zz",), True),  # node no longer in the spec
    ]
    assert endpoints(spec, running) == {"on": ["10.0.0.1:8100", "[fd00::2]:8101"]}


# choose: the model's routing policy over the ready replicas


LONG = {"model": "m", "messages": [{"role": "system", "content": "Answer as the billing desk. " * 60}]}


def choose(pool: Pool, policy: Policy = Policy.prefix, now: float = 1.0, **kw: object) -> tuple[str, Reason]:
    found = pool.choose(
        "m",
        now,
        key=kw.pop("key", request_key(LONG, None)),  # type: ignore[arg-type]
        policy=policy,
        thresholds=Thresholds(),
        exclude=kw.pop("exclude", frozenset()),  # type: ignore[arg-type]
        stale_after=3.0,
    )
    assert found is not None
    return found[0].address, found[1]


def test_choose_sends_one_key_to_its_rendezvous_replica_from_any_pool() -> None:
    key = request_key(LONG, None)
    assert key is not None
    first = rendezvous(key, ["a:1", "b:1", "c:1"])[0]
    assert choose(ready_pool("a:1", "b:1", "c:1")) == (first, Reason.affinity)
    assert choose(ready_pool("c:1", "a:1", "b:1")) == (first, Reason.affinity)


def test_choose_skips_a_replica_whose_fresh_signals_say_overloaded() -> None:
    pool = ready_pool("a:1", "b:1")
    first, _ = choose(pool)
    replica = next(r for r in pool.of("m") if r.address == first)
    pool.scraped(replica, Signals(waiting=9.0), now=1.0)
    other, reason = choose(pool, now=2.0)
    assert other != first and reason is Reason.overloaded
    # The same signals, older than stale_after, no longer count: the key's replica again.
    assert choose(pool, now=10.0) == (first, Reason.affinity)


def test_choose_excludes_tried_replicas_and_unready_ones() -> None:
    pool = ready_pool("a:1", "b:1")
    first, _ = choose(pool)
    other, reason = choose(pool, exclude=frozenset({first}))
    # A retry: the key's first replica among those not tried yet.
    assert other != first and reason is Reason.affinity
    assert pool.choose(
        "m", 1.0, key=None, policy=Policy.prefix, thresholds=Thresholds(),
        exclude=frozenset({"a:1", "b:1"}), stale_after=3.0,
    ) is None  # fmt: skip


def test_choose_round_robin_takes_turns_per_model() -> None:
    pool = ready_pool("a:1", "b:1")
    picked = [choose(pool, Policy.round_robin)[0] for _ in range(4)]
    assert picked == ["a:1", "b:1", "a:1", "b:1"]


def test_as_dict_shows_the_signals_and_their_age() -> None:
    pool = ready_pool("a:1")
    replica = pool.of("m")[0]
    assert replica.as_dict()["signals"] is None
    pool.scraped(replica, Signals(running=2.0, waiting=1.0), now=5.0)
    shown = replica.as_dict(now=6.5)
    assert shown["signals_age"] == 1.5
    assert shown["signals"] == {
        "running": 2.0, "waiting": 1.0, "kv_usage": None, "prefix_queries": None, "prefix_hits": None,
    }  # fmt: skip


def test_route_settings_follow_the_cluster_file() -> None:
    spec = parse_cluster(
        CLUSTER.replace("profile: p, scaling: {min: 1, max: 2}}", "profile: p, scaling: {min: 1, max: 2}, "
        "routing: {policy: least_load, max_waiting: 2, load_factor: 0}}"),
        "t.yaml",
    )  # fmt: skip
    assert route_settings(spec.model("on")) == (Policy.least_load, Thresholds(2.0, 0.9, 0.0))
    assert route_settings(spec.model("lazy")) == (Policy.prefix, Thresholds())
