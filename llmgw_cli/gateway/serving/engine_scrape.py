"""Parse an engine's Prometheus /metrics text into Signals.

The core decides which samples count (core/serving/engine_signals.py); the text parser
is prometheus_client's, which the core may not import. The text comes from a replica the
gateway does not trust to be well-formed: a scrape the parser refuses anywhere gives
all-None Signals (the router then uses its own in-flight counts), never an exception.
The caller bounds the size of the text it reads.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from llmgw_cli.core.serving.engine_signals import Signals, signals_from_samples


def parse_signals(engine: str, text: str) -> Signals:
    """Signals of one scrape of an engine of kind ``engine`` (vllm, sglang, llama-server)."""
    try:
        samples = [(s.name, s.value) for f in text_string_to_metric_families(text) for s in f.samples]
    except Exception:  # the parser raises ValueError, IndexError, KeyError... on bad text
        return Signals()
    return signals_from_samples(engine, samples)
