"""The model controller's decisions with a fake clock (``core/planning/controller.py``): every rule
of ``reconcile``, the phases, back-off and what a request is told."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, replace

import pytest

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.planning.controller import (
    BACKOFF_MAX,
    Attempts,
    Lifecycle,
    Phase,
    Restart,
    Seen,
    Start,
    Stop,
    StopCause,
    UnitCondition,
    backoff,
    phase,
    reconcile,
    unavailable,
)
from llmgw_cli.core.planning.drain import DRAIN_GRACE
from llmgw_cli.core.serving.routing import Health

SPEC = parse_cluster(
    """\
cluster: {name: t}
gateway: {node_grace: 20s, unhealthy_restart: 60s, start_backoff: 5s, scale_out_wait: 5s}
profiles: {vllm: {engine: vllm, readiness: {start_timeout: 10m}}}
models:
  - {name: always, source: org/a, profile: vllm, scaling: {min: 1, max: 2}}
  - {name: pair, source: org/p, profile: vllm, scaling: {min: 2, max: 2}}
  - {name: lazy, source: org/b, profile: vllm, scaling: {min: 0, max: 2, idle_timeout: 5m}}
  - {name: 'off', source: org/e, profile: vllm, scaling: {min: 0, max: 0}}
"""
)
T0 = 1_000_000.0
BACKOFF = SPEC.gateway.start_backoff


def seen(
    model: str = "always",
    replica: int = 0,
    *,
    units: UnitCondition = UnitCondition.up,
    health: Health = Health.ready,
    first_seen: float = T0 - 3600,
    ready_at: float | None = T0 - 3000,
    **more: object,
) -> Seen:
    return Seen(
        model=model,
        replica=replica,
        address=f"10.0.0.{replica + 1}:8000",
        nodes=(f"node{replica + 1:02d}",),
        gpus=frozenset({f"GPU-{model}-{replica}"}),
        units=units,
        health=health,
        first_seen=first_seen,
        ready_at=ready_at,
        **more,  # type: ignore[arg-type]
    )


def decide(
    replicas: list[Seen],
    *,
    attempts: dict[str, Attempts] | None = None,
    busy: frozenset[str] = frozenset(),
    queue: dict[str, float] | None = None,
    now: float = T0,
    models: tuple[str, ...] = ("always",),
) -> list[object]:
    """Decisions for the listed models only (the others are made busy)."""
    others = {m.name for m in SPEC.models} - set(models)
    return list(reconcile(SPEC, replicas, attempts or {}, busy | others, queue or {}, now=now))


def test_a_healthy_model_at_min_needs_nothing() -> None:
    assert decide([seen()]) == []


def test_an_always_on_model_below_min_is_started() -> None:
    assert decide([]) == [Start("always", "below min (0 of 1)")]
    assert decide([seen("pair", 0)], models=("pair",)) == [Start("pair", "below min (1 of 2)")]


def test_one_start_per_model_per_call() -> None:
    starts = [d for d in decide([], models=("pair",)) if isinstance(d, Start)]
    assert len(starts) == 1


def test_a_busy_model_is_left_alone() -> None:
    assert decide([], busy=frozenset({"always"})) == []


def test_a_lost_node_is_given_its_grace_then_replaced() -> None:
    lost = seen(units=UnitCondition.lost, health=Health.failing, lost_since=T0 - 19)
    assert decide([lost]) == []  # an SSH hiccup is not a lost node
    late = replace(lost, lost_since=T0 - 20)
    (start,) = decide([late])
    assert isinstance(start, Start)
    assert "replica 0 lost with node01" in start.reason


def test_a_replaced_replica_is_not_counted_and_is_stopped_when_seen_again() -> None:
    old = seen(units=UnitCondition.lost, lost_since=T0 - 100, replaced=True)
    new = seen(replica=1)
    assert decide([old, new]) == []  # its replacement counts; nothing to stop while unreachable
    back = replace(old, units=UnitCondition.up)
    assert decide([back, new]) == [
        Stop("always", 0, "replaced while its node did not answer", StopCause.replaced)
    ]


def test_a_unit_systemd_gave_up_on_is_stopped_and_replaced_on_other_cards() -> None:
    broken = seen(units=UnitCondition.gave_up, health=Health.failing)
    stop, start = decide([broken])
    assert stop == Stop("always", 0, "systemd gave up on its unit on node01", StopCause.gave_up)
    assert isinstance(start, Start) and start.avoid == frozenset({"GPU-always-0"})
    assert start.shun == frozenset({"node01"})  # the node can be the cause too
    assert "systemd gave up" in start.reason


def test_failed_starts_remember_their_nodes_until_one_succeeds() -> None:
    history = Attempts().failed("exit 1", T0, ("node01",)).failed("exit 1", T0 + 5, ("node02", "node03"))
    assert history.failures == 2 and history.nodes == frozenset({"node01", "node02", "node03"})
    assert history.succeeded().nodes == frozenset()


def test_a_down_unit_is_stopped_and_replaced() -> None:
    down = seen(units=UnitCondition.down, health=Health.failing)
    stop, start = decide([down])
    assert isinstance(stop, Stop) and stop.cause is StopCause.down
    assert isinstance(start, Start) and start.avoid == frozenset() and start.shun == frozenset()


def test_an_unhealthy_replica_is_restarted_after_the_bound() -> None:
    sick = seen(health=Health.failing, failing_since=T0 - 59)
    assert decide([sick]) == []
    (restart,) = decide([replace(sick, failing_since=T0 - 60)])
    assert isinstance(restart, Restart) and restart.replica == 0
    # a replica that never was ready is judged by its start_timeout instead
    loading = seen(health=Health.failing, ready_at=None, first_seen=T0 - 10, failing_since=T0 - 600)
    assert decide([loading]) == []


def test_a_replica_on_a_faulty_card_is_replaced_successor_first_even_while_it_answers() -> None:
    why = "node01 GPU 3: XID 79: GPU has fallen off the bus"
    bad = seen(units=UnitCondition.faulty_card, faults=(why,))  # its health check still passes
    assert decide([bad]) == [Restart("always", 0, f"it holds a faulty card: {why}", "faulty-card")]
    # it counts towards min until its successor serves: no second start beside the restart
    assert not [d for d in decide([bad]) if isinstance(d, Start)]
    # and it serves meanwhile: the model stays ready
    assert (
        phase(MODELS["always"], [bad], Attempts(), starting=False, now=T0, backoff_first=BACKOFF)
        is Phase.ready
    )


def test_a_replica_never_ready_within_start_timeout_is_stopped() -> None:
    found = seen("lazy", health=Health.loading, ready_at=None, first_seen=T0 - 599)
    assert decide([found], models=("lazy",)) == []
    (stop,) = decide([replace(found, first_seen=T0 - 600)], models=("lazy",))
    assert isinstance(stop, Stop) and stop.cause is StopCause.never_ready
    # for an always-on model, its replacement starts in the same breath
    stuck = seen(health=Health.loading, ready_at=None, first_seen=T0 - 600)
    stop, start = decide([stuck])
    assert isinstance(stop, Stop) and isinstance(start, Start)


def test_back_off_holds_starts_then_lets_one_through() -> None:
    failed = {"always": Attempts().failed("boom", T0 - 4)}
    assert decide([], attempts=failed) == []
    assert decide([], attempts=failed, now=T0 + 1) == [Start("always", "below min (0 of 1)")]
    twice = {"always": Attempts().failed("a", T0 - 100).failed("b", T0 - 9)}
    assert decide([], attempts=twice) == []  # the second failure waits 10 s
    assert len(decide([], attempts=twice, now=T0 + 1)) == 1


def test_backoff_doubles_up_to_a_bound() -> None:
    assert [backoff(n, 5) for n in range(5)] == [0, 5, 10, 20, 40]
    assert backoff(30, 5) == BACKOFF_MAX
    assert Attempts().retry_at(5) is None
    assert Attempts().failed("x", T0).succeeded() == Attempts()


def test_idle_on_demand_replicas_are_stopped() -> None:
    idle = seen("lazy", last_used=T0 - 300)
    (stop,) = decide([idle], models=("lazy",))
    assert stop == Stop("lazy", 0, "idle for 300s", StopCause.idle)
    assert decide([replace(idle, in_flight=1)], models=("lazy",)) == []


def test_a_saturated_model_scales_out_unless_its_back_off_runs() -> None:
    (start,) = decide([seen("lazy", last_used=T0)], models=("lazy",), queue={"lazy": 6})
    assert isinstance(start, Start) and start.reason.startswith("scale out")
    failed = {"lazy": Attempts().failed("boom", T0 - 1)}
    assert decide([seen("lazy", last_used=T0)], models=("lazy",), queue={"lazy": 6}, attempts=failed) == []
    assert decide([seen("lazy", last_used=T0)], models=("lazy",), queue={"lazy": 4}) == []


def test_a_draining_replica_counts_towards_min_and_gets_no_decision_until_abandoned() -> None:
    """apply is replacing it: no start of a replacement, no restart, stop or idle stop,
    whatever its health or units say, until its deadline + DRAIN_GRACE."""
    deadline = T0 - DRAIN_GRACE  # the last second it is waited for
    for draining in (
        seen(draining=deadline),
        seen(draining=deadline, health=Health.failing, failing_since=T0 - 3600),
        seen(draining=deadline, units=UnitCondition.down, health=Health.unknown),
        seen(draining=deadline, units=UnitCondition.gave_up, health=Health.unknown),
    ):
        assert decide([draining]) == [], draining
    assert decide([seen("pair", 0), seen("pair", 1, draining=T0 + 30)], models=("pair",)) == []
    assert decide([seen("lazy", last_used=T0 - 3600, draining=T0 + 30)], models=("lazy",)) == []
    stop, start = decide([seen(draining=deadline - 1)])
    assert stop == Stop(
        "always",
        0,
        "left draining by an apply that did not finish: its drain ended 61s ago (more than the 60s grace)",
        StopCause.drain_abandoned,
    )
    assert isinstance(start, Start) and start.reason.startswith(
        "below min (0 of 1): replacing replica 0 left"
    )


def test_a_draining_replica_on_a_lost_node_is_judged_as_a_lost_one() -> None:
    lost = seen(units=UnitCondition.lost, health=Health.failing, lost_since=T0 - 20, draining=T0 + 30)
    (start,) = decide([lost])
    assert isinstance(start, Start) and "replica 0 lost with node01" in start.reason


def test_a_draining_replica_is_not_ready_for_the_phase() -> None:
    model = MODELS["pair"]
    pair = [seen("pair", 0), seen("pair", 1, draining=T0 + 30)]
    assert phase(model, pair, Attempts(), starting=False, now=T0, backoff_first=BACKOFF) is Phase.degraded


def test_switched_off_models_are_not_touched() -> None:
    assert decide([seen("off", units=UnitCondition.gave_up)], models=("off",)) == []


MODELS = {m.name: m for m in SPEC.models}


@pytest.mark.parametrize(
    ("model", "replicas", "attempts", "starting", "expected"),
    [
        ("off", [], Attempts(), False, Phase.off),
        ("lazy", [], Attempts(), False, Phase.stopped),
        ("always", [], Attempts(), False, Phase.stopped),
        ("lazy", [], Attempts(), True, Phase.starting),
        ("lazy", [seen("lazy", health=Health.loading, ready_at=None)], Attempts(), False, Phase.starting),
        ("lazy", [seen("lazy")], Attempts(), False, Phase.ready),
        ("pair", [seen("pair", 0), seen("pair", 1)], Attempts(), False, Phase.ready),
        (
            "pair",
            [seen("pair", 0), seen("pair", 1, health=Health.failing)],
            Attempts(),
            False,
            Phase.degraded,
        ),
        ("pair", [seen("pair", 0)], Attempts(), True, Phase.degraded),
        ("lazy", [], Attempts().failed("x", T0 - 1), False, Phase.failed),
        ("lazy", [], Attempts().failed("x", T0 - 5), False, Phase.stopped),  # back-off over
        ("always", [], Attempts().failed("x", T0 - 50), False, Phase.failed),  # min still unmet
        ("always", [seen(replaced=True)], Attempts(), False, Phase.stopped),
        (
            "always",
            [seen(units=UnitCondition.gave_up, health=Health.failing)],
            Attempts(),
            False,
            Phase.stopped,
        ),
    ],
)
def test_phase(model: str, replicas: list[Seen], attempts: Attempts, starting: bool, expected: Phase) -> None:
    assert (
        phase(MODELS[model], replicas, attempts, starting=starting, now=T0, backoff_first=BACKOFF) is expected
    )


def test_a_failed_start_is_told_with_the_back_off_left_and_its_reason_kept_for_the_log() -> None:
    attempts = Attempts().failed("llmgw-lazy-0.service failed\nerror: unknown flag", T0 - 2)
    answer = unavailable(
        MODELS["lazy"], Phase.failed, attempts, progress="", manages=True, now=T0, backoff_first=BACKOFF
    )
    assert (answer.status, answer.code) == (503, "model_start_failed")
    assert "unknown flag" not in answer.message and "unknown flag" in answer.detail
    assert answer.headers == {"Retry-After": "3"}


def test_what_a_request_is_told_in_each_other_phase() -> None:
    none = Attempts()

    def told(model: str, p: Phase, progress: str = "", manages: bool = True) -> tuple[int, str]:
        answer = unavailable(
            MODELS[model], p, none, progress=progress, manages=manages, now=T0, backoff_first=BACKOFF
        )
        assert answer.retry_after >= 1
        return answer.status, answer.code

    assert told("off", Phase.off) == (404, "model_off")
    assert told("lazy", Phase.starting, "engine loading") == (503, "model_loading")
    assert (
        "engine loading"
        in unavailable(
            MODELS["lazy"],
            Phase.starting,
            none,
            progress="engine loading",
            manages=True,
            now=T0,
            backoff_first=5,
        ).message
    )
    assert told("lazy", Phase.stopped, manages=False) == (503, "model_unavailable")
    assert told("always", Phase.stopped) == (503, "model_unavailable")


# --- a model's record: one value, changed by its transitions -----------------------------


def test_a_start_that_succeeds_ends_the_failures_and_allows_an_eviction_again() -> None:
    failed = Lifecycle().start_began("placing").start_failed("no room", T0 - 9, ["node01"]).evicted_now()
    assert failed.attempts == Attempts(1, T0 - 9, "no room", frozenset({"node01"})) and failed.evicted
    began = failed.start_began("probing the nodes")
    assert began.starting and began.busy and began.progress == "probing the nodes"
    assert began.start_progress("engine loading").progress == "engine loading"
    done = began.start_succeeded()
    assert done.attempts == Attempts() and not done.evicted and done.starting  # not ended yet
    assert failed.attempts.failures == 1 and failed.evicted  # the old value stays as it was


def test_a_failed_start_adds_to_the_back_off_and_its_nodes() -> None:
    once = Lifecycle().start_failed("unit failed", T0 - 10, ["node01"])
    twice = once.start_failed("not ready", T0, ["node02", "node03"])
    assert twice.attempts.failures == 2 and twice.attempts.reason == "not ready"
    assert twice.attempts.nodes == {"node01", "node02", "node03"}
    assert twice.attempts.retry_at(BACKOFF) == T0 + 2 * BACKOFF
    assert not twice.starting and not twice.evicted


def test_a_start_that_ends_clears_its_progress_and_its_loading_replica() -> None:
    loading = Lifecycle().start_began("placing").start_progress("engine loading").loading_at("10.0.0.1:8000")
    assert loading.loading == {"10.0.0.1:8000"}
    ended = loading.start_ended("10.0.0.1:8000")
    assert (ended.starting, ended.progress, ended.loading) == (False, "", frozenset())
    unplaced = Lifecycle().start_began("placing").start_ended(None)
    assert not unplaced.starting and not unplaced.busy and unplaced.progress == ""


def test_a_replica_ready_loads_no_more_and_others_still_do() -> None:
    both = Lifecycle().loading_at("10.0.0.1:8000").loading_at("10.0.0.2:8000")
    assert both.ready("10.0.0.1:8000").loading == {"10.0.0.2:8000"}
    assert both.ready("10.0.0.9:8000") == both and both.ready(None) == both


def test_stops_under_way_keep_the_model_busy_until_the_last_ends() -> None:
    two = Lifecycle().stop_began().stop_began()
    assert two.stopping == 2 and two.busy
    assert two.stop_ended().busy and not two.stop_ended().stop_ended().busy


def test_a_look_is_kept_as_ready_and_on_their_way() -> None:
    assert Lifecycle().look == (0, 0)
    assert Lifecycle().looked(1, 2).look == (1, 2)


def test_the_phase_reads_the_records_history_and_start_under_way() -> None:
    lazy = MODELS["lazy"]
    assert Lifecycle().phase(lazy, [], now=T0, backoff_first=BACKOFF) is Phase.stopped
    starting = Lifecycle().start_began("placing")
    assert starting.phase(lazy, [], now=T0, backoff_first=BACKOFF) is Phase.starting
    failed = starting.start_failed("x", T0 - 1).start_ended(None)
    assert failed.phase(lazy, [], now=T0, backoff_first=BACKOFF) is Phase.failed
    assert failed.phase(lazy, [seen("lazy")], now=T0, backoff_first=BACKOFF) is Phase.ready


def test_a_record_cannot_be_changed_in_place() -> None:
    record = Lifecycle()
    with pytest.raises(FrozenInstanceError):
        record.starting = True  # type: ignore[misc]
    with pytest.raises(AttributeError):
        record.loading.add("10.0.0.1:8000")  # type: ignore[attr-defined]
    assert record == Lifecycle() and hash(record) == hash(Lifecycle())
