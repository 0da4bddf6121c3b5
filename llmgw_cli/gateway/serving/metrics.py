"""The gateway's Prometheus metrics (prometheus_client).

Two kinds:
- counted on the request path (requests, latency, time to first token, tokens, retries)
  and by the model controller (loads, evictions, idle stops, its actions): metric objects bumped
  where things happen, through the methods below;
- read when scraped (in flight, queue, replica health, the fleet from the one Summary):
  a collector registered by ``build``, so the request path pays nothing for them.

Several workers (``gateway/control/workers.py``): each counts in files of its own, and the one
that serves ``/metrics`` (worker 0) sums every worker's counters and histograms; the
scrape-time figures (in flight, queue) are its own.

Until ``build`` has run (the gateway has not finished starting: first discovery and, with
probing, the first probe of the nodes), ``render`` returns None and the endpoints answer
503: a half-empty page would look like a working target with nothing in it.

For the model controller: call ``loaded(model, seconds, ok)`` when a start ends
(ready, or given up), ``evicted(model)`` when a replica is stopped to make room, and
``idle_stopped(model)`` when one is stopped for ``idle_timeout``, and ``acted(model,
action, reason)`` for every action it carries out.

Contract (concurrency): everything is called on the event loop; prometheus_client's own
locks make a scrape from another thread safe too. Per request: one dict lookup for the
cached label children, a few increments, one bisect in each histogram; no allocation
unless a new (model, status, key) appears. The ``key`` label is bounded: beyond
``gateway.metrics_keys`` keys, the least used are counted as ``other`` (``label_keys``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from llmgw_cli.core.serving.key_labels import key_label
from llmgw_cli.gateway.control.workers import MULTIPROC_VAR
from llmgw_cli.gateway.serving.recent import RecentUse

# Seconds. Non-streamed answers and whole streams: from milliseconds to minutes.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
FIRST_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# Model loads: a small GGUF in seconds, a 400B model over several nodes in tens of minutes.
LOAD_BUCKETS = (1, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600)
MAX_CHILDREN = 10_000  # cached label sets; keys and models are bounded, this is a backstop


def _kept(cache: dict[tuple[str, ...], Any], metric: Any, labels: tuple[str, ...]) -> Any:
    """``metric``'s child for ``labels``, kept in ``cache`` (``labels()`` costs more than an
    increment); the cache starts again past ``MAX_CHILDREN`` label sets."""
    child = cache.get(labels)
    if child is None:
        if len(cache) > MAX_CHILDREN:
            cache.clear()
        child = cache[labels] = metric.labels(*labels)
    return child


class Metrics:
    def __init__(self) -> None:
        self.requests = Counter(
            "llmgw_requests",
            "Requests answered, by model, HTTP status and key.",
            ["model", "status", "key"],
            registry=None,
        )
        self.latency = Histogram(
            "llmgw_request_seconds",
            "Time from request to the end of the answer (whole stream).",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=None,
        )
        self.first_token = Histogram(
            "llmgw_time_to_first_token_seconds",
            "Streams: time from request to the first chunk from the engine.",
            ["model"],
            buckets=FIRST_TOKEN_BUCKETS,
            registry=None,
        )
        self.tokens = Counter(
            "llmgw_tokens",
            "Tokens reported by the engines, by kind (prompt, completion).",
            ["model", "key", "kind"],
            registry=None,
        )
        self.retries = Counter(
            "llmgw_upstream_retries", "Requests retried after a connection failure.", ["model"], registry=None
        )
        self.loads = Counter(
            "llmgw_model_loads",
            "Replica starts by the gateway, by result.",
            ["model", "result"],
            registry=None,
        )
        self.load_seconds = Histogram(
            "llmgw_model_load_seconds",
            "Time from a start to a ready replica (or to giving up).",
            ["model"],
            buckets=LOAD_BUCKETS,
            registry=None,
        )
        self.evictions = Counter(
            "llmgw_evictions",
            "Idle replicas stopped to make room for another model.",
            ["model"],
            registry=None,
        )
        self.idle_stops = Counter(
            "llmgw_idle_stops", "Replicas stopped after their idle_timeout.", ["model"], registry=None
        )
        self.scale_outs = Counter(
            "llmgw_scale_outs",
            "Extra replicas started because requests waited in the model's queue.",
            ["model"],
            registry=None,
        )
        self.actions = Counter(
            "llmgw_controller_actions",
            "Starts, stops, restarts and replacements by the model controller, by reason.",
            ["model", "action", "reason"],
            registry=None,
        )
        self.route_decisions = Counter(
            "llmgw_route_decisions",
            "Replica choices, by model, routing policy and reason (affinity: the key's own "
            "replica; overloaded: it was past a threshold, another took the request; no_prefix: "
            "no key, the least loaded; least_load; round_robin). A retry is a choice too.",
            ["model", "policy", "reason"],
            registry=None,
        )
        self.access_log_dropped = Counter(
            "llmgw_access_log_dropped",
            "Access log lines dropped: its queue was full (requests came faster than its "
            "writer could write them, or stderr did not drain) or the write failed.",
            registry=None,
        )
        self.recent = RecentUse()
        # the keys named in the ``key`` label, the rest are "other" (None: every key);
        # set by the gateway from its keys and their usage (core/serving/key_labels.py)
        self.labelled: frozenset[str] | None = None
        self.registry: CollectorRegistry | None = None
        self._children: dict[tuple[str, int, str], tuple[Any, ...]] = {}
        self._routes: dict[tuple[str, ...], Any] = {}
        self._retries: dict[tuple[str, ...], Any] = {}

    # --- the request path ----------------------------------------------------------

    def observe(
        self,
        model: str,
        status: int,
        key: str,
        *,
        prompt: int,
        completion: int,
        seconds: float,
        first_token: float | None = None,
    ) -> None:
        """One answered request. ``first_token``: seconds to the first streamed chunk."""
        children = self._children.get((model, status, key))
        if children is None:
            if len(self._children) > MAX_CHILDREN:
                self._children.clear()
            label = key_label(key, self.labelled)
            children = self._children[(model, status, key)] = (
                self.requests.labels(model, str(status), label),
                self.latency.labels(model),
                self.tokens.labels(model, label, "prompt"),
                self.tokens.labels(model, label, "completion"),
                self.first_token.labels(model),
            )
        requests, latency, prompt_tokens, completion_tokens, first = children
        requests.inc()
        latency.observe(seconds)
        if prompt:
            prompt_tokens.inc(prompt)
        if completion:
            completion_tokens.inc(completion)
        if first_token is not None:
            first.observe(first_token)
        if key != "-" and model != "-":
            self.recent.add(key, model, prompt + completion, time.monotonic())

    def label_keys(self, labelled: frozenset[str] | None) -> None:
        """Name these keys from now on (None: every key); the cached children follow."""
        if labelled != self.labelled:
            self.labelled = labelled
            self._children.clear()

    def routed(self, model: str, policy: str, reason: str) -> None:
        """A replica was chosen for a request of ``model``; all three labels are bounded.
        The labelled child is kept: ``labels()`` costs more than the increment."""
        _kept(self._routes, self.route_decisions, (model, policy, reason)).inc()

    def log_dropped(self, lines: int) -> None:
        """The access log dropped ``lines`` (called from its writer thread: prometheus_client
        counters take a lock)."""
        self.access_log_dropped.inc(lines)

    def retry(self, model: str) -> None:
        """A request of ``model`` is tried again after a connection failure (its child kept,
        as ``routed``'s: a flapping engine retries on every request)."""
        _kept(self._retries, self.retries, (model,)).inc()

    # --- the model controller --------------------------------------------------

    def loaded(self, model: str, seconds: float, ok: bool = True) -> None:
        """A start of ``model`` ended: ready (``ok``) or given up, after ``seconds``."""
        self.loads.labels(model, "ok" if ok else "failed").inc()
        self.load_seconds.labels(model).observe(seconds)

    def evicted(self, model: str) -> None:
        """A replica of ``model`` was stopped to make room for another model."""
        self.evictions.labels(model).inc()

    def idle_stopped(self, model: str) -> None:
        """A replica of ``model`` was stopped after its idle_timeout."""
        self.idle_stops.labels(model).inc()

    def scaled_out(self, model: str) -> None:
        """One more replica of a saturated ``model`` is being started."""
        self.scale_outs.labels(model).inc()

    def acted(self, model: str, action: str, reason: str) -> None:
        """The controller carried out ``action`` (start, stop, restart, replace, evict,
        start-failed) on ``model``; ``reason`` is a bounded label (never free text)."""
        self.actions.labels(model, action, reason).inc()

    # --- exposition ----------------------------------------------------------------

    def _own(self) -> Iterable[Collector]:
        return (
            self.requests,
            self.latency,
            self.first_token,
            self.tokens,
            self.retries,
            self.access_log_dropped,
            self.route_decisions,
            self.loads,
            self.load_seconds,
            self.evictions,
            self.idle_stops,
            self.scale_outs,
            self.actions,
        )

    def build(self, *collectors: Collector) -> None:
        """Make the registry: the counters above plus scrape-time ``collectors``. A worker
        of several (``$PROMETHEUS_MULTIPROC_DIR`` set by the supervisor) reports the
        counters of every worker, summed from their files there, instead of its own."""
        registry = CollectorRegistry(auto_describe=False)
        shared = os.environ.get(MULTIPROC_VAR)
        counters: Iterable[Collector] = self._own()
        if shared:
            counters = (MultiProcessCollector(None, shared),)  # type: ignore[no-untyped-call]
        for c in (*counters, *collectors):
            registry.register(c)
        self.registry = registry

    def render(self) -> bytes | None:
        """The exposition text, or None before ``build``."""
        return None if self.registry is None else generate_latest(self.registry)
