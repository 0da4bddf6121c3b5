"""The gateway's view of the fleet: the one Summary (``core/views/summary.py``) fed with the
latest probe and the gateway's own state, and the metrics read from it when scraped.

The dashboard, ``/admin/api/summary`` and ``/metrics`` all call ``summary_of``, and
``llmgw status`` calls the same ``summarize`` on its own probe: one arithmetic.

Contract (concurrency): everything here runs on the event loop and only reads the
gateway's state (pool, admission, the source's last snapshot); nothing awaits, so a
scrape sees one consistent moment.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from llmgw_cli.core.serving.routing import Health, RoutedReplica
from llmgw_cli.core.views.summary import Live, LiveReplica, Summary, UseRow, engine_load, summarize
from llmgw_cli.gateway.control.sources import ProbeSource
from llmgw_cli.gateway.control.state import Gateway
from llmgw_cli.gateway.store.sqlite import Usage

GPU_STATES = ("used", "free", "faulty")


def _idle_seconds(r: RoutedReplica, now: float) -> float | None:
    """Since its last request ended (the time the controller goes by, kept across
    restarts), else since the last request was routed to it or it became ready; None
    when not ready, 0 with a request in flight."""
    if r.health is not Health.ready:
        return None
    if r.outstanding:
        return 0.0
    if r.last_used is not None:
        return max(0.0, time.time() - r.last_used)
    return max(0.0, now - max(r.last_pick, r.changed))


def live(gw: Gateway, day_usage: Iterable[Usage] = ()) -> Live:
    """The gateway's state as the Summary takes it. ``day_usage``: stored plus pending
    usage rows; today's (UTC) count as the day."""
    now = time.monotonic()
    stale_after = gw.signals_stale_after()
    replicas = tuple(
        LiveReplica(
            model=r.model,
            address=r.address,
            health=r.health.value,
            in_flight=r.outstanding,
            idle_seconds=_idle_seconds(r, now),
            load=engine_load(r.signals, None if r.signals_at is None else now - r.signals_at, stale_after),
        )
        for r in gw.pool.all()
    )
    usage = [
        UseRow(window="hour", key=k, model=m, requests=n, tokens=t)
        for (k, m), (n, t) in sorted(gw.metrics.recent.totals(now).items())
    ]
    today = datetime.now(UTC).strftime("%Y-%m-%d")
    usage += [
        UseRow(
            window="day",
            key=u.key,
            model=u.model,
            requests=u.requests,
            tokens=u.prompt_tokens + u.completion_tokens,
        )
        for u in day_usage
        if u.day == today
    ]
    controller = gw.controller
    phases = {name: phase.value for name, phase in controller.phases().items()}
    progress = {name: controller.progress(name) for name in phases if controller.progress(name)}
    return Live(replicas=replicas, usage=tuple(usage), phases=phases, progress=progress)


def probing(gw: Gateway) -> ProbeSource | None:
    """The source when it probes the nodes (``--replicas`` does not: no fleet facts)."""
    return gw.source if isinstance(gw.source, ProbeSource) else None


def summary_of(gw: Gateway, day_usage: Iterable[Usage] = ()) -> Summary:
    source = probing(gw)
    return summarize(gw.spec, source.facts if source else {}, live(gw, day_usage))


def probe_ages(source: ProbeSource, nodes: Iterable[str]) -> dict[str, float]:
    """Seconds since each node's last successful probe (since probing began when never)."""
    now = time.monotonic()
    return {n: round(now - source.probed.get(n, source.since), 3) for n in nodes}


def _gauge(name: str, doc: str, labels: list[str], rows: Iterable[tuple[list[str], float]]) -> Metric:
    family = GaugeMetricFamily(name, doc, labels=labels)
    for values, value in rows:
        family.add_metric(values, value)
    return family


def _signal_gauges(replicas: list[RoutedReplica], now: float) -> Iterator[Metric]:
    """What each replica's engine last said on its /metrics, as this gateway process read
    it (each process scrapes for itself), and how old that reading is: a replica whose
    scrapes fail keeps its last values with a growing age, and the router stops using
    them once they are stale."""
    read = [r for r in replicas if r.signals is not None and r.signals_at is not None]
    for name, doc, field in (
        ("llmgw_replica_engine_waiting", "Requests queued inside the replica's engine.", "waiting"),
        ("llmgw_replica_engine_running", "Requests the replica's engine is computing.", "running"),
        ("llmgw_replica_engine_kv_usage", "Share of the replica's KV cache in use (0 to 1).", "kv_usage"),
    ):
        values = ((r, getattr(r.signals, field)) for r in read)
        yield _gauge(
            name, doc, ["model", "address"], (([r.model, r.address], v) for r, v in values if v is not None)
        )
    yield _gauge(
        "llmgw_replica_signals_age_seconds",
        "Seconds since this gateway process last read the replica's /metrics successfully.",
        ["model", "address"],
        (([r.model, r.address], max(0.0, now - (r.signals_at or now))) for r in read),
    )


class FleetCollector(Collector):
    """Scrape-time metrics: the gateway's replicas and queues, and the fleet from the Summary."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    def collect(self) -> Iterator[Metric]:
        gw = self.gw
        s = summary_of(gw)
        active = gw.admission.active
        queued = gw.admission.queued()
        yield _gauge(
            "llmgw_in_flight",
            "Requests holding a slot of the model (forwarded or about to be).",
            ["model"],
            (([m], active.get(m, 0)) for m in gw.catalog),
        )
        yield _gauge(
            "llmgw_queued",
            "Requests waiting for a slot of the model.",
            ["model"],
            (([m], queued.get(m, 0)) for m in gw.catalog),
        )
        replicas = s.replicas
        yield _gauge(
            "llmgw_replica_up",
            "1 when the replica is in rotation (its health check passes).",
            ["model", "address"],
            (([r.model, r.address], float(r.health == Health.ready.value)) for r in replicas),
        )
        yield _gauge(
            "llmgw_replica_outstanding",
            "Requests in flight to the replica.",
            ["model", "address"],
            (([r.model, r.address], r.in_flight) for r in replicas),
        )
        yield _gauge(
            "llmgw_replica_idle_seconds",
            "Seconds since the replica was last asked for (ready replicas only).",
            ["model", "address"],
            (([r.model, r.address], r.idle_seconds) for r in replicas if r.idle_seconds is not None),
        )
        yield _gauge(
            "llmgw_replica_idle",
            "1 when the replica holds hardware nobody asked for within its model's idle_timeout (or 30 min).",
            ["model", "address"],
            (([r.model, r.address], float(r.idle)) for r in replicas),
        )
        yield from _signal_gauges(gw.pool.all(), time.monotonic())
        yield _gauge(
            "llmgw_model_min_replicas",
            "Replicas the cluster file promises (scaling.min).",
            ["model"],
            (([m.name], m.desired) for m in s.models),
        )
        yield _gauge(
            "llmgw_model_ready_replicas",
            "Replicas of the model in rotation.",
            ["model"],
            (([m.name], m.ready or 0) for m in s.models),
        )
        yield _gauge(
            "llmgw_model_state",
            "1 for the model's current state (its controller's phase: off, stopped, starting, ready, "
            "degraded, failed).",
            ["model", "state"],
            (([m.name, m.state or "unknown"], 1) for m in s.models),
        )
        source = probing(gw)
        if source is None:
            return  # --replicas: nodes are not probed; no fleet numbers rather than zeros
        yield from self._fleet(s, source)

    def _fleet(self, s: Summary, source: ProbeSource) -> Iterator[Metric]:
        yield _gauge(
            "llmgw_gpus",
            "GPUs by class and state; a faulty card is neither used nor free.",
            ["gpu_class", "state"],
            (([c.gpu_class, state], getattr(c, state)) for c in s.classes for state in GPU_STATES),
        )
        yield _gauge(
            "llmgw_node_up",
            "1 when the node's last probe succeeded.",
            ["node"],
            (([n.name], float(n.reachable)) for n in s.nodes),
        )
        yield _gauge(
            "llmgw_node_last_probe_age_seconds",
            "Seconds since the node was last probed successfully.",
            ["node"],
            (([n], age) for n, age in probe_ages(source, (n.name for n in s.nodes)).items()),
        )
        reachable = [n for n in s.nodes if n.reachable]
        yield _gauge(
            "llmgw_node_gpus",
            "GPUs of the node by state (used, free, faulty).",
            ["node", "state"],
            (
                ([n.name, state], value)
                for n in reachable
                for state, value in (
                    ("used", n.used),
                    ("free", n.gpus - n.used - n.faulty),
                    ("faulty", n.faulty),
                )
            ),
        )
        yield _gauge(
            "llmgw_gpu_fault",
            "1 for each faulty card (out of placement) and each cause the probe found: nvidia-smi, "
            "reset-required, drain-and-reset, remap-pending, remap-failed, ecc, xid-<code> (a fatal "
            "XID in the kernel log), lost (nvidia-smi cannot open it). gpu is the card's index, or "
            "its PCI bus id when it is lost.",
            ["node", "gpu", "cause"],
            (
                ([n.name, card.gpu, cause], 1)
                for n in reachable
                for card in n.faulty_cards
                for cause in (card.causes or ("unknown",))
            ),
        )
        yield _gauge(
            "llmgw_gpu_nvlink_peers",
            "Most NVLink peers of any card of the node; 0 is PCIe only. Absent when the "
            "topology is unknown (see llmgw_node_topology_known).",
            ["node"],
            (([n.name], n.nvlink_peers) for n in reachable if n.gpus and n.nvlink_peers is not None),
        )
        yield _gauge(
            "llmgw_node_topology_known",
            "1 when nvidia-smi topo -m was read on the node, 0 when its topology is unknown.",
            ["node"],
            (([n.name], float(n.nvlink_peers is not None)) for n in reachable if n.gpus),
        )
        yield _gauge(
            "llmgw_node_model_files",
            "Complete model folders and files in the node's weights directories.",
            ["node"],
            (([n.name], len(n.models)) for n in reachable),
        )
        yield _gauge(
            "llmgw_fabric_free_nodes",
            "Whole nodes of the fabric with every card free (where a multi-node replica can land).",
            ["fabric"],
            (([f.name], f.free_nodes) for f in s.fabrics),
        )
        yield _gauge(
            "llmgw_fabric_nodes",
            "Nodes declared on the fabric.",
            ["fabric"],
            (([f.name], f.nodes) for f in s.fabrics),
        )
        yield _gauge(
            "llmgw_model_running_replicas",
            "Ready replicas: units running and, while within the start timeout, seen ready by the health checks.",
            ["model"],
            (([m.name], m.running) for m in s.models),
        )
