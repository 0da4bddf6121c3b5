"""The pure routing policy: least outstanding requests, leaving and rejoining rotation."""

from __future__ import annotations

import pytest

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.serving.routing import Health, Pool, endpoints

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
