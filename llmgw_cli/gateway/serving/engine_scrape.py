"""Parse an engine's Prometheus /metrics text into Signals.

The core decides which samples count (core/serving/engine_signals.py); the text parser
is prometheus_client's, which the core may not import. The text comes from a replica the
gateway does not trust to be well-formed: a scrape the parser refuses anywhere gives
all-None Signals (the router then uses its own in-flight counts), never an exception.
The caller bounds the size of the text it reads.

A vLLM page is mostly histograms the router never reads (50 kB, 8 ms to parse whole on
the gateway's event loop): only the lines that name a wanted sample, and their ``# HELP``
and ``# TYPE`` lines, are handed to the parser. Every other line must still look like a
comment or a sample (a name, labels, a value): a page cut or mangled anywhere is dropped
whole, as the parser would drop it, never read in part.
"""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

from llmgw_cli.core.serving.engine_signals import Signals, signals_from_samples, wanted_names

# A line that is blank, a comment, or shaped like a sample: name, optional labels, value,
# optional timestamp (the parser checks the lines that are kept in full). Labels are read
# up to the first `}` so the match is linear on a hostile line: a label value holding a
# `}` makes the page unread, and the router falls back to its in-flight counts.
_SKIPPABLE = re.compile(r"\s*(#.*)?|[a-zA-Z_:][a-zA-Z0-9_:]*(\{[^}]*\})?[ \t]+\S+([ \t]+\S+)?[ \t]*")


def parse_signals(engine: str, text: str) -> Signals:
    """Signals of one scrape of an engine of kind ``engine`` (vllm, sglang, llama-server)."""
    wanted = wanted_names(engine)
    if not wanted:
        return Signals()
    try:
        kept: list[str] = []
        for line in text.splitlines():
            if _name_of(line) in wanted:
                kept.append(line)
            elif not _SKIPPABLE.fullmatch(line):
                return Signals()
        samples = [
            (s.name, s.value) for f in text_string_to_metric_families("\n".join(kept)) for s in f.samples
        ]
    except Exception:  # the parser raises ValueError, IndexError, KeyError... on bad text
        return Signals()
    return signals_from_samples(engine, samples)


def _name_of(line: str) -> str:
    """The metric a line speaks of: a sample's name, or the name a ``# HELP`` or ``# TYPE``
    comment gives; empty for any other line."""
    if line.startswith("#"):
        words = line.split(None, 3)
        return words[2] if len(words) > 2 and words[1] in ("HELP", "TYPE") else ""
    return line.split("{", 1)[0].split(None, 1)[0] if line.strip() else ""
