"""On-demand policy with a fake clock: every on-demand rule that is a decision (``core/planning/lifecycle.py``)."""

from __future__ import annotations

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.planning.lifecycle import (
    EVICTION_GRACE,
    ReplicaUse,
    eviction_candidate,
    idle_to_stop,
    known_last_use,
    should_scale_out,
)

SPEC = parse_cluster(
    """\
cluster: {name: t}
profiles: {vllm: {engine: vllm}}
models:
  - {name: always, source: org/a, profile: vllm, scaling: {min: 1, max: 2, idle_timeout: 10m}}
  - {name: lazy, source: org/b, profile: vllm, scaling: {min: 0, max: 2, idle_timeout: 5m}}
  - {name: other, source: org/c, profile: vllm, scaling: {min: 0, max: 1, idle_timeout: 5m}}
  - {name: never-idle, source: org/d, profile: vllm, scaling: {min: 0, max: 1}}
  - {name: off, source: org/e, profile: vllm, scaling: {min: 0, max: 0}}
  - {name: no-scaling, source: org/f, profile: vllm}
""".replace("name: off,", "name: 'off',")
)
T0 = 1_000_000.0


def use(
    model: str,
    replica: int = 0,
    *,
    ready: float = T0,
    last: float | None = T0,
    flight: int = 0,
    nodes: int = 1,
) -> ReplicaUse:
    return ReplicaUse(model, replica, nodes, ready, last, flight)


def test_idle_timeout_stops_on_demand_replicas() -> None:
    assert idle_to_stop(SPEC, [use("lazy")], T0 + 299) == []
    assert idle_to_stop(SPEC, [use("lazy")], T0 + 300) == [use("lazy")]


def test_use_and_in_flight_streams_keep_a_replica_alive() -> None:
    assert idle_to_stop(SPEC, [use("lazy", last=T0 + 200)], T0 + 300) == []
    assert idle_to_stop(SPEC, [use("lazy", flight=1)], T0 + 3600) == []


def test_unknown_use_is_not_idle() -> None:
    assert idle_to_stop(SPEC, [use("lazy", last=None)], T0 + 3600) == []
    assert eviction_candidate(SPEC, [use("other", last=None)], "lazy", T0 + 3600) is None


def test_min_is_a_promise() -> None:
    assert idle_to_stop(SPEC, [use("always")], T0 + 3600) == []  # never below min
    extra = [use("always", 0), use("always", 1, ready=T0 - 200, last=T0 - 100)]
    assert idle_to_stop(SPEC, extra, T0 + 3600) == [extra[1]]  # above min: the longest idle goes
    assert eviction_candidate(SPEC, extra, "lazy", T0 + 3600) is None  # never evicted


def test_models_without_idle_timeout_are_never_idled() -> None:
    assert idle_to_stop(SPEC, [use("never-idle")], T0 + 86400) == []


def test_eviction_takes_the_longest_idle_single_node_on_demand_replica() -> None:
    running = [use("other", last=T0 + 50), use("never-idle", last=T0), use("lazy", last=T0 - 500)]
    assert eviction_candidate(SPEC, running, "other", T0 + 600) == use("never-idle", last=T0)
    assert eviction_candidate(SPEC, [use("never-idle", nodes=2)], "other", T0 + 600) is None
    assert eviction_candidate(SPEC, [use("never-idle", flight=1)], "other", T0 + 600) is None


def test_two_models_cannot_take_turns_evicting_each_other() -> None:
    # "other" was just started by evicting "lazy"; now "lazy" is requested again:
    just_started = use("other", ready=T0 + 100, last=T0 + 101)
    assert eviction_candidate(SPEC, [just_started], "lazy", T0 + 110) is None
    assert eviction_candidate(SPEC, [just_started], "lazy", T0 + 100 + 121) == just_started


def test_found_running_without_a_saved_time_is_unknown_until_watched_for_idle_timeout() -> None:
    # recorded (saved before a restart, or seen by this gateway): known at once
    assert known_last_use(T0 - 10, first_seen=T0, idle_timeout=300, now=T0) == T0 - 10
    # nothing recorded: unknown (so neither idle nor evictable) ...
    assert known_last_use(None, first_seen=T0, idle_timeout=300, now=T0 + 299) is None
    # ... until watched unused for a whole idle_timeout; then unused since first seen
    assert known_last_use(None, first_seen=T0, idle_timeout=300, now=T0 + 300) == T0
    # a model without idle_timeout is watched for the eviction grace
    assert known_last_use(None, first_seen=T0, idle_timeout=None, now=T0 + EVICTION_GRACE - 1) is None
    assert known_last_use(None, first_seen=T0, idle_timeout=None, now=T0 + EVICTION_GRACE) == T0
    watched = use("lazy", last=known_last_use(None, T0, 300, T0 + 300))
    assert idle_to_stop(SPEC, [watched], T0 + 300) == [watched]


def test_scale_out_only_when_saturated_running_and_below_max() -> None:
    def out(model: str, replicas: int = 1, starting: bool = False, wait: float = 6.0) -> bool:
        return should_scale_out(
            SPEC, model, replicas=replicas, starting=starting, queue_wait=wait, threshold=5.0
        )

    assert out("lazy")  # max 2, one running, requests waited 6 s
    assert not out("lazy", wait=4.9)  # not saturated
    assert not out("lazy", replicas=2)  # max reached
    assert not out("lazy", starting=True)  # one start at a time
    assert not out("lazy", replicas=0)  # a stopped model is started by a request, not scaled
    assert out("always")  # min 1, max 2
    assert not out("other")  # max 1
    assert not out("off") and not out("no-scaling") and not out("missing")
