"""On-demand lifecycle policy (pure): which replicas are idle, which one to evict, when to
start one more. Functions of (spec, state, now); the clock is a parameter.

The gateway's model controller (``gateway/control/controller.py``) owns the effects: it asks these
functions, then starts or stops replicas through the same executor as ``apply``.

Rules:
- ``min: 0, max >= 1`` is on demand; ``min >= 1`` is a promise: never evicted, never
  idled below ``min``; a model that is off is never started by a request.
- A replica is idle when nobody used it for ``idle_timeout`` and nothing is in flight.
  Unknown use (``last_used is None``, e.g. after a restart without saved times) is never
  idle: unknown is not idle.
- Eviction makes room for a requested on-demand model: one idle replica of another
  on-demand model, single-node only, usage known, nothing in flight, and ready for longer
  than a grace period, so two models cannot take turns evicting each other. The one idle
  longest goes first.
- Scale out: when requests for a model wait in its queue for ``scale_out_wait`` and
  ``max`` allows, one more replica starts (one start at a time per model); idle stops
  scale it back towards ``min``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from llmgw_cli.core.clusterfile.spec import ClusterSpec, ScalingMode

EVICTION_GRACE = 120.0  # seconds a replica is safe from eviction after it became ready


@dataclass(frozen=True)
class ReplicaUse:
    """What the gateway knows about one running replica."""

    model: str
    replica: int
    nodes: int  # how many nodes it spans
    ready_at: float | None  # when it became ready; None while loading
    last_used: float | None  # end of the last request; None = unknown
    in_flight: int = 0


def _idle_for(r: ReplicaUse, now: float) -> float | None:
    if r.in_flight or r.last_used is None or r.ready_at is None:
        return None
    return now - max(r.last_used, r.ready_at)


def idle_to_stop(spec: ClusterSpec, running: list[ReplicaUse], now: float) -> list[ReplicaUse]:
    """Replicas past their model's ``idle_timeout``, never taking a model below ``min``;
    the longest idle of a model go first."""
    count = Counter(r.model for r in running)
    stop: list[ReplicaUse] = []
    for r in sorted(running, key=lambda r: _idle_for(r, now) or 0.0, reverse=True):
        model = next((m for m in spec.models if m.name == r.model), None)
        if model is None or model.scaling is None or model.scaling.idle_timeout is None:
            continue
        idle = _idle_for(r, now)
        if idle is None or idle < model.scaling.idle_timeout or count[r.model] <= model.scaling.min:
            continue
        stop.append(r)
        count[r.model] -= 1
    return stop


def eviction_candidate(
    spec: ClusterSpec, running: list[ReplicaUse], requested: str, now: float, grace: float = EVICTION_GRACE
) -> ReplicaUse | None:
    """The replica to stop so ``requested`` fits, or None when none may go."""
    models = {m.name: m for m in spec.models}
    candidates = []
    for r in running:
        model = models.get(r.model)
        if r.model == requested or model is None or model.mode is not ScalingMode.on_demand:
            continue  # min >= 1 is a promise; off models should not be running at all
        idle = _idle_for(r, now)
        if r.nodes != 1 or idle is None or r.ready_at is None or now - r.ready_at < grace:
            continue
        candidates.append((idle, r))
    if not candidates:
        return None
    return max(candidates, key=lambda c: (c[0], -c[1].replica))[1]


def known_last_use(
    recorded: float | None, first_seen: float, idle_timeout: float | None, now: float
) -> float | None:
    """The last use the policy may rely on. A recorded time is known. A replica found
    running without one (started before this gateway, no saved time) is unknown until the
    gateway has watched it unused for a whole ``idle_timeout`` (or the eviction grace when
    it has none); from then on it is known unused since it was first seen."""
    if recorded is not None:
        return recorded
    watch = idle_timeout if idle_timeout is not None else EVICTION_GRACE
    return first_seen if now - first_seen >= watch else None


def should_scale_out(
    spec: ClusterSpec, model: str, *, replicas: int, starting: bool, queue_wait: float, threshold: float
) -> bool:
    """One more replica of ``model``: it runs, every replica is saturated (requests waited
    ``threshold`` in its queue), ``max`` allows, and no start of it is under way."""
    found = next((m for m in spec.models if m.name == model), None)
    if found is None or found.scaling is None or found.mode is ScalingMode.off:
        return False
    return not starting and 1 <= replicas < found.scaling.max and queue_wait >= threshold
