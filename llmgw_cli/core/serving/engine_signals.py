"""What an engine says about its own load, read from the samples of its Prometheus /metrics
(pure).

The text itself is parsed in the gateway (gateway/serving/engine_scrape.py): the core
imports no metrics library. This module decides which samples count and how samples of
several label sets combine:

- request gauges (running, waiting) and prefix-cache counters are **summed** over label
  sets: vLLM with data parallelism reports one series per engine (``engine="0"``,
  ``engine="1"``), and the replica as a whole holds all their requests;
- usage ratios are **averaged** over label sets: the replica's API server spreads new
  requests over its engines, so the room a new request finds is the replica's mean room,
  not its fullest engine's. A ratio is clamped to [0, 1].

A sample whose value is not finite or is negative is ignored; a sum that overflows is
dropped. A signal no sample speaks of is None: the router then falls back to its own
in-flight count for that replica.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Signals:
    """One replica's load as its engine reports it; None: the engine did not say."""

    running: float | None = None  # requests being computed
    waiting: float | None = None  # requests queued inside the engine
    kv_usage: float | None = None  # KV cache in use, 0..1
    prefix_queries: float | None = None  # prefix-cache lookups (tokens), a counter
    prefix_hits: float | None = None  # prefix-cache hits (tokens), a counter


# Sample names per signal, first found wins: current name first, the older spelling after.
# Counters are matched with and without the `_total` their exposition appends.
_NAMES: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm": {
        "running": ("vllm:num_requests_running",),
        "waiting": ("vllm:num_requests_waiting",),
        "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        "prefix_queries": ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"),
        "prefix_hits": ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"),
    },
    # SGLang reports its prefix cache as a hit-rate gauge (sglang:cache_hit_rate), not as
    # the query and hit counters a rate over time needs: left out.
    "sglang": {
        "running": ("sglang:num_running_reqs",),
        "waiting": ("sglang:num_queue_reqs",),
        "kv_usage": ("sglang:token_usage",),
    },
    # Current llama-server builds export no KV-cache gauge; older ones did.
    "llama-server": {
        "running": ("llamacpp:requests_processing",),
        "waiting": ("llamacpp:requests_deferred",),
        "kv_usage": ("llamacpp:kv_cache_usage_ratio",),
    },
}
_COUNTERS = frozenset({"prefix_queries", "prefix_hits"})
_RATIOS = frozenset({"kv_usage"})


def wanted_names(engine: str) -> frozenset[str]:
    """Every sample name that can give a signal of ``engine`` (counters with and without
    their ``_total``), so a scrape's other lines need not be parsed at all; empty for an
    engine kind not known here."""
    names = _NAMES.get(engine, {})
    found = {n for signal, wanted in names.items() for n in wanted}
    return frozenset(found | {n + "_total" for s, w in names.items() if s in _COUNTERS for n in w})


def signals_from_samples(engine: str, samples: Iterable[tuple[str, float]]) -> Signals:
    """The Signals of one scrape given as (sample name, value) pairs; an engine kind not
    known here gives all-None Signals."""
    names = _NAMES.get(engine)
    if names is None:
        return Signals()
    values: dict[str, list[float]] = {}
    for name, value in samples:
        if isinstance(value, float | int) and math.isfinite(value) and value >= 0:
            values.setdefault(name, []).append(float(value))
    found = {signal: _combine(signal, wanted, values) for signal, wanted in names.items()}
    return Signals(**found)


def _combine(signal: str, wanted: tuple[str, ...], values: dict[str, list[float]]) -> float | None:
    for name in wanted:
        seen = values.get(name)
        if seen is None and signal in _COUNTERS:
            seen = values.get(name + "_total")
        if seen:
            return _aggregate(signal, seen)
    return None


def _aggregate(signal: str, seen: list[float]) -> float | None:
    total = sum(seen)  # math.fsum raises on overflow; sum gives inf, refused below
    if not math.isfinite(total):
        return None
    if signal in _RATIOS:
        return min(1.0, total / len(seen))
    return total
