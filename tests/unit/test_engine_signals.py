"""Engine signals read from real /metrics text, and from text meant to break the parser."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from llmgw_cli.core.serving.engine_signals import Signals, signals_from_samples, wanted_names
from llmgw_cli.gateway.serving.engine_scrape import parse_signals

DATA = Path(__file__).resolve().parent.parent / "data"


def fixture(name: str) -> str:
    return (DATA / name).read_text()


def test_real_vllm_scrape() -> None:
    """A real vLLM V1 scrape (one engine, idle): its gauges and prefix-cache counters."""
    s = parse_signals("vllm", fixture("vllm_metrics.prom"))
    assert s == Signals(running=0.0, waiting=0.0, kv_usage=0.0, prefix_queries=242.0, prefix_hits=0.0)


def test_vllm_excerpt_sums_requests_over_its_engines() -> None:
    s = parse_signals("vllm", fixture("vllm_metrics_excerpt.prom"))
    assert s == Signals(running=3.0, waiting=1.0)


def test_real_llama_server_scrape() -> None:
    """A real scrape of this repository's llama-server build: its gauges are read, and the
    KV-cache gauge it lacks is None."""
    s = parse_signals("llama-server", fixture("llama_server_metrics.prom"))
    assert s == Signals(running=0.0, waiting=0.0, kv_usage=None)


def test_sglang_gauges_as_its_source_declares_them() -> None:
    s = parse_signals("sglang", fixture("sglang_metrics_handwritten.prom"))
    assert s == Signals(running=5.0, waiting=2.0, kv_usage=0.28)


def test_vllm_current_names_with_prefix_counters() -> None:
    text = (
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.2\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.6\n'
        "# TYPE vllm:prefix_cache_queries counter\n"
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0\n'
        'vllm:prefix_cache_queries_total{engine="1",model_name="m"} 50.0\n'
        'vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e+09\n'
        "# TYPE vllm:prefix_cache_hits counter\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 40.0\n'
    )
    s = parse_signals("vllm", text)
    assert s.kv_usage == pytest.approx(0.4)  # the mean of the engines, not the fullest
    assert (s.prefix_queries, s.prefix_hits) == (150.0, 40.0)
    assert (s.running, s.waiting) == (None, None)


def test_vllm_older_names_are_read() -> None:
    text = (
        "# TYPE vllm:gpu_cache_usage_perc gauge\n"
        'vllm:gpu_cache_usage_perc{model_name="m"} 0.7\n'
        "# TYPE vllm:gpu_prefix_cache_queries counter\n"
        'vllm:gpu_prefix_cache_queries_total{model_name="m"} 10.0\n'
        "# TYPE vllm:gpu_prefix_cache_hits counter\n"
        'vllm:gpu_prefix_cache_hits_total{model_name="m"} 4.0\n'
    )
    assert parse_signals("vllm", text) == Signals(kv_usage=0.7, prefix_queries=10.0, prefix_hits=4.0)


def test_the_current_name_wins_over_the_older_one() -> None:
    text = "vllm:kv_cache_usage_perc 0.1\nvllm:gpu_cache_usage_perc 0.9\n"
    assert parse_signals("vllm", text).kv_usage == pytest.approx(0.1)


def test_an_older_llama_server_kv_gauge_is_read() -> None:
    text = "# TYPE llamacpp:kv_cache_usage_ratio gauge\nllamacpp:kv_cache_usage_ratio 0.5\n"
    assert parse_signals("llama-server", text).kv_usage == 0.5


def test_other_engines_metrics_are_not_read() -> None:
    assert parse_signals("sglang", fixture("vllm_metrics_excerpt.prom")) == Signals()
    assert parse_signals("no-such-engine", fixture("vllm_metrics_excerpt.prom")) == Signals()


HOSTILE = [
    "",
    "garbage",
    "\x00\xff{{{{ }}}",
    "vllm:num_requests_running{engine= 3\n",
    'vllm:num_requests_running{engine="0"} not-a-number\n',
    "# TYPE vllm:num_requests_running histogram\nvllm:num_requests_running 1\n",
    "vllm:num_requests_running 1 2 3 4\n",
    "{} 1\n",
    "vllm:num_requests_running" + "{a=" * 1000 + "\n",
]


@pytest.mark.parametrize("text", HOSTILE)
@pytest.mark.parametrize("engine", ["vllm", "sglang", "llama-server"])
def test_hostile_text_never_raises(engine: str, text: str) -> None:
    s = parse_signals(engine, text)
    assert all(v is None or math.isfinite(v) for v in vars(s).values())


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf", "-3", "1e999", "-0.5"], ids=lambda v: f"value={v}")
def test_non_finite_or_negative_values_are_ignored(value: str) -> None:
    text = f"vllm:num_requests_running {value}\nvllm:kv_cache_usage_perc {value}\n"
    assert parse_signals("vllm", text) == Signals()


def test_a_sum_that_overflows_is_dropped_and_a_ratio_is_clamped() -> None:
    text = (
        'vllm:num_requests_waiting{engine="0"} 1e308\n'
        'vllm:num_requests_waiting{engine="1"} 1e308\n'
        "vllm:kv_cache_usage_perc 7.5\n"
        "vllm:num_requests_running 2\n"
    )
    assert parse_signals("vllm", text) == Signals(running=2.0, kv_usage=1.0)


def test_a_bad_sample_spoils_only_itself_in_the_pure_core() -> None:
    samples = [("sglang:num_running_reqs", 2.0), ("sglang:num_running_reqs", math.nan)]
    assert signals_from_samples("sglang", samples) == Signals(running=2.0)


def test_a_scrape_the_parser_refuses_anywhere_tells_nothing() -> None:
    """The parser raises on a bad line after good ones: the whole scrape is dropped rather
    than half read, so a replica's signals never mix two readings' worth of lines."""
    assert parse_signals("vllm", "vllm:num_requests_running 3\ngarbage\n") == Signals()


def test_only_the_wanted_lines_are_parsed_and_the_others_must_still_look_right() -> None:
    """Lines of metrics the router never reads are skipped unparsed (a vLLM page is mostly
    histograms), yet a mangled one still spoils the page; a hostile long line is judged in
    linear time."""
    page = (DATA / "vllm_metrics.prom").read_text()
    assert parse_signals("vllm", page) == Signals(0.0, 0.0, 0.0, 242.0, 0.0)
    assert parse_signals("vllm", page + "vllm:iteration_tokens_total_bucket{le=\n") == Signals()
    started = time.monotonic()
    for hostile in ("x{" + "}" * 200_000, "x " + "1 " * 200_000, "x{" + '"' * 200_000):
        assert parse_signals("vllm", "vllm:num_requests_running 3\n" + hostile + "\n") == Signals()
    assert time.monotonic() - started < 2.0
    assert wanted_names("tgi") == frozenset()
    assert "vllm:prefix_cache_hits_total" in wanted_names("vllm")
